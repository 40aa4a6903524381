// SPDX-License-Identifier: Apache-2.0
// ranks::sharded over ranks::nccl with one rank (NCCL refuses two ranks on one GPU, and the
// lent machine has one): ZeRO-Offload (OnHost + CudaOverlapped) with params and gradients in
// device memory, clipped, an inf at step 3; every step's result and every param equal one
// OffloadedOptimizer given the same gradients, bit for bit. Built where NCCL is found; needs
// a CUDA device, and without one exits 77 (Meson's SKIP) and says why.
#include <tierstate/ranks/nccl.hpp>
#include <tierstate/ranks/sharded.hpp>
#include <tierstate/tierstate.hpp>

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <vector>

using namespace tierstate;

namespace {

using Opt = OffloadedOptimizer<AdamW, Bf16Mixed, PinnedHost, CudaOverlapped<2>, OnHost<>>;

int failures = 0;
void expect(bool ok, char const* what, int step)
{
  if (!ok) {
    std::printf("FAIL: %s at step %d\n", what, step);
    ++failures;
  }
}

/// A device array of n bf16 holding `host`.
bf16* on_device(std::vector<bf16> const& host)
{
  void* p = nullptr;
  TIERSTATE_CUDA_TRY(cudaMalloc(&p, host.size() * sizeof(bf16)));
  TIERSTATE_CUDA_TRY(cudaMemcpy(p, host.data(), host.size() * sizeof(bf16), cudaMemcpyHostToDevice));
  return static_cast<bf16*>(p);
}

}  // namespace

int main()
{
  if (device::count() == 0) {
    std::printf("SKIP: %s\n", device::describe().c_str());
    return 77;
  }
  std::vector<std::size_t> const sizes{100'003, 4096, 33};
  ncclUniqueId id;
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  if (ncclGetUniqueId(&id) != ncclSuccess || ncclCommInitRank(&comm, 1, id, 0) != ncclSuccess ||
      cudaStreamCreate(&stream) != cudaSuccess) {
    std::printf("FAIL: NCCL or the stream could not be made\n");
    return 1;
  }
  Opt::options o;
  o.chunk_elements = 16384;
  o.max_grad_norm  = 0.5;
  {
    ranks::nccl world(comm, stream);
    Opt ref({.lr = 1e-2, .weight_decay = 0.1}, o);
    ranks::sharded<Opt, ranks::nccl> sh(world, {.lr = 1e-2, .weight_decay = 0.1}, o);
    std::vector<bf16*> ref_w, sh_w, grads;
    std::vector<std::vector<bf16>> g_host;
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      std::vector<bf16> w(sizes[t]);
      for (std::size_t i = 0; i < w.size(); ++i) { w[i] = bf16(static_cast<float>(i % 1000) / 500.0f - 1.0f); }
      ref_w.push_back(on_device(w));
      sh_w.push_back(on_device(w));
      g_host.emplace_back(sizes[t]);
      grads.push_back(on_device(g_host.back()));
      std::string const name = std::string("t").append(std::to_string(t));  // (GCC 12's -Wrestrict: appended)
      ref.add_tensor(name, ref_w.back(), sizes[t], location::device);
      sh.add_tensor(name, sh_w.back(), sizes[t]);
    }
    for (int step = 1; step <= 6; ++step) {
      std::vector<grad_view<bf16>> views;
      for (std::size_t t = 0; t < sizes.size(); ++t) {
        for (std::size_t i = 0; i < sizes[t]; ++i) {
          g_host[t][i] = bf16(static_cast<float>((i * 7 + t * 13 + static_cast<std::size_t>(step) * 29) % 101) / 404.0f - 0.125f);
        }
        if (step == 3 && t == 0) { g_host[t][500] = bf16(std::numeric_limits<float>::infinity()); }
        TIERSTATE_CUDA_TRY(cudaMemcpy(grads[t], g_host[t].data(), sizes[t] * sizeof(bf16), cudaMemcpyHostToDevice));
        views.push_back({grads[t], sizes[t], location::device});
      }
      auto const a = ref.step(views);
      auto const b = sh.step(views);
      expect(a.skipped == b.skipped && a.found_nonfinite == b.found_nonfinite, "the non-finite verdict", step);
      expect(a.grad_norm == b.grad_norm, "the gradient norm", step);
      expect(a.step == b.step, "the step count", step);
      expect(step != 3 || b.skipped, "the inf's skip", step);
    }
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      std::vector<bf16> x(sizes[t]), y(sizes[t]);
      TIERSTATE_CUDA_TRY(cudaMemcpy(x.data(), ref_w[t], sizes[t] * sizeof(bf16), cudaMemcpyDeviceToHost));
      TIERSTATE_CUDA_TRY(cudaMemcpy(y.data(), sh_w[t], sizes[t] * sizeof(bf16), cudaMemcpyDeviceToHost));
      expect(std::memcmp(x.data(), y.data(), sizes[t] * sizeof(bf16)) == 0, "the params' bits", 6);
      cudaFree(ref_w[t]);
      cudaFree(sh_w[t]);
      cudaFree(grads[t]);
    }
  }
  ncclCommDestroy(comm);
  cudaStreamDestroy(stream);
  std::printf("%s: ranks::sharded over NCCL (1 rank), 6 steps against one optimizer\n", failures == 0 ? "PASS" : "FAIL");
  return failures == 0 ? 0 : 1;
}
