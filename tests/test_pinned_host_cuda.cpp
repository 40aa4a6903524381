// SPDX-License-Identifier: Apache-2.0
// The CUDA runtime path as an ordinary C++ compiler builds it (TIERSTATE_ENABLE_CUDA, cudart,
// no nvcc): PinnedHost's memory page-locked with cudaHostRegister, and ZeRO-Offload (OnHost +
// CudaOverlapped) with params and gradients in device memory, which needs no device kernel.
// Needs a CUDA device; without one it exits 77 (Meson's SKIP) and says why.
#include <tierstate/tierstate.hpp>

#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstring>
#include <utility>
#include <vector>

using namespace tierstate;

namespace {

int zero_offload_matches_host()
{
  constexpr std::size_t n = 100'003;
  std::vector<bf16> w0(n), g(n);
  for (std::size_t i = 0; i < n; ++i) {
    w0[i] = bf16(static_cast<float>(i % 1000) / 500.0f - 1.0f);
    g[i]  = bf16(static_cast<float>(i % 37) / 370.0f - 0.05f);
  }
  // On the host: PinnedHost + Synchronous, host params.
  std::vector<bf16> w_host = w0;
  OffloadedOptimizer<AdamW, Bf16Mixed, PinnedHost, Synchronous> reference({}, {.chunk_elements = 8192});
  reference.add_tensor("w", w_host.data(), n);
  // On the GPU: ZeRO-Offload.
  void *w_mem = nullptr, *g_mem = nullptr;
  if (cudaMalloc(&w_mem, n * sizeof(bf16)) != cudaSuccess || cudaMalloc(&g_mem, n * sizeof(bf16)) != cudaSuccess) {
    std::printf("FAIL: cudaMalloc\n");
    return 1;
  }
  auto* w_dev = static_cast<bf16*>(w_mem);
  auto* g_dev = static_cast<bf16*>(g_mem);
  cudaMemcpy(w_dev, w0.data(), n * sizeof(bf16), cudaMemcpyHostToDevice);
  cudaMemcpy(g_dev, g.data(), n * sizeof(bf16), cudaMemcpyHostToDevice);
  OffloadedOptimizer<AdamW, Bf16Mixed, PinnedHost, CudaOverlapped<2>, OnHost<>> offload({}, {.chunk_elements = 8192});
  offload.add_tensor("w", w_dev, n, location::device);
  bool refused = false;
  try {
    OffloadedOptimizer<AdamW, Bf16Mixed, PinnedHost, CudaOverlapped<2>, OnHost<>> wrong;
    wrong.add_tensor("w", w_host.data(), n, location::device);  // host memory called device
  } catch (tierstate::logic_error const&) {
    refused = true;
  }
  for (int t = 0; t < 5; ++t) {
    grad_view<bf16> const hg{g.data(), n, location::host};
    grad_view<bf16> const dg{g_dev, n, location::device};
    reference.step({&hg, 1});
    offload.step({&dg, 1});
  }
  std::vector<bf16> w_back(n);
  cudaMemcpy(w_back.data(), w_dev, n * sizeof(bf16), cudaMemcpyDeviceToHost);
  cudaFree(w_dev);
  cudaFree(g_dev);
  if (std::memcmp(w_back.data(), w_host.data(), n * sizeof(bf16)) != 0) {
    std::printf("FAIL: ZeRO-Offload on the GPU differs from the host composition\n");
    return 1;
  }
  if (!refused) {
    std::printf("FAIL: a host pointer registered as device memory was accepted\n");
    return 1;
  }
  std::printf("ZeRO-Offload with device params: the host composition's bits after 5 steps\n");
  return 0;
}

}  // namespace

int main()
{
  int devices          = 0;
  cudaError_t const e = cudaGetDeviceCount(&devices);
  if (e != cudaSuccess || devices == 0) {
    std::printf("SKIP: no CUDA device here (cudaGetDeviceCount: %s)\n", cudaGetErrorString(e));
    return 77;
  }
  // Sizes below a huge page, of a whole one plus a few bytes, and of several (moved once).
  for (std::size_t const bytes : {std::size_t{4097}, (std::size_t{2} << 20) + 5, std::size_t{3} << 20}) {
    tierstate::PinnedHost first(bytes);
    tierstate::PinnedHost tier = std::move(first);
    std::vector<std::byte> chunk(4096);
    tier.read(bytes - 4096, chunk);
    for (auto b : chunk) {
      if (b != std::byte{0}) { std::printf("FAIL: not zero-filled\n"); return 1; }
    }
    cudaPointerAttributes attributes{};
    if (cudaPointerGetAttributes(&attributes, tier.data()) != cudaSuccess ||
        attributes.type != cudaMemoryTypeHost) {
      std::printf("FAIL: PinnedHost memory of %zu bytes is not page-locked CUDA host memory\n", bytes);
      return 1;
    }
    // A copy to the device and back through it, as the transfers do.
    void* d = nullptr;
    std::memset(tier.data(), 0x5A, bytes);
    if (cudaMalloc(&d, bytes) != cudaSuccess || cudaMemcpy(d, tier.data(), bytes, cudaMemcpyHostToDevice) != cudaSuccess ||
        (std::memset(tier.data(), 0, bytes), cudaMemcpy(tier.data(), d, bytes, cudaMemcpyDeviceToHost)) != cudaSuccess || tier.data()[bytes - 1] != std::byte{0x5A}) {
      std::printf("FAIL: a copy through %zu bytes of PinnedHost memory\n", bytes);
      return 1;
    }
    cudaFree(d);
    std::printf("PinnedHost: %zu bytes of memory page-locked with cudaHostRegister\n", bytes);
  }
  return zero_offload_matches_host();
}
