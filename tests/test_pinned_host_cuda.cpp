// SPDX-License-Identifier: Apache-2.0
// PinnedHost with TIERSTATE_ENABLE_CUDA: page-locked memory from cudaHostAlloc. Needs a
// CUDA device; without one it exits 77 (Meson's SKIP) and says why.
#include <tierstate/tiers/pinned_host.hpp>

#include <cuda_runtime_api.h>

#include <cstdio>
#include <vector>

int main()
{
  int devices          = 0;
  cudaError_t const e = cudaGetDeviceCount(&devices);
  if (e != cudaSuccess || devices == 0) {
    std::printf("SKIP: no CUDA device here (cudaGetDeviceCount: %s)\n", cudaGetErrorString(e));
    return 77;
  }
  std::size_t const bytes = std::size_t{3} << 20;
  tierstate::PinnedHost tier(bytes);
  std::vector<std::byte> chunk(4096);
  tier.read(bytes - 4096, chunk);
  for (auto b : chunk) {
    if (b != std::byte{0}) { std::printf("FAIL: not zero-filled\n"); return 1; }
  }
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, tier.data()) != cudaSuccess ||
      attributes.type != cudaMemoryTypeHost) {
    std::printf("FAIL: PinnedHost memory is not page-locked CUDA host memory\n");
    return 1;
  }
  std::printf("PinnedHost: %zu bytes of page-locked memory from cudaHostAlloc\n", bytes);
  return 0;
}
