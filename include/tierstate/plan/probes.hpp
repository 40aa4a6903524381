// SPDX-License-Identifier: Apache-2.0
// The planner's probes (plan/plan.hpp): short loops of their own that measure host memory over
// a step's traffic, the disk through tierstate's I/O engine, and, in a CUDA build, PCIe. None
// runs the optimizer; none page-locks host memory but the PCIe probe (which needs a GPU).
#pragma once

#include <tierstate/core/device_runtime.hpp>
#include <tierstate/core/thread_pool.hpp>
#include <tierstate/io/engine.hpp>
#include <tierstate/io/error.hpp>
#include <tierstate/tiers/pinned_host.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <new>
#include <optional>
#include <string>
#include <vector>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

namespace tierstate::inline TIERSTATE_ABI::plan {

namespace detail {
/// Host memory for a probe, untouched, 2 MiB-aligned and on huge pages where the kernel gives
/// them (as PinnedHost's is), but never page-locked: a probe needs no GPU, nor memlock.
class probe_buffer {
 public:
  explicit probe_buffer(std::size_t bytes)
    : size_((bytes + (std::size_t{2} << 20) - 1) / (std::size_t{2} << 20) * (std::size_t{2} << 20)),
      p_(static_cast<std::byte*>(std::aligned_alloc(std::size_t{2} << 20, size_)))
  {
    if (p_ == nullptr) { throw std::bad_alloc(); }
    (void)::madvise(p_, size_, MADV_HUGEPAGE);
  }
  ~probe_buffer() { std::free(p_); }
  probe_buffer(probe_buffer const&)            = delete;
  probe_buffer& operator=(probe_buffer const&) = delete;
  [[nodiscard]] std::byte* data() const noexcept { return p_; }

 private:
  std::size_t size_;
  std::byte* p_;
};
}  // namespace detail

/// Host memory bandwidth over a step's traffic (28 bytes an element of fp32 AdamW: four arrays
/// read, three written), on every thread of `pool`, over `n` elements (beyond the caches from
/// 2^23 on); median of 5 passes.
inline double probe_host_gb_s(thread_pool& pool, std::size_t n)
{
  n = std::max<std::size_t>(n, 4096);
  detail::probe_buffer mem(4 * n * sizeof(float));  // four arrays
  float* const pp = reinterpret_cast<float*>(mem.data());
  pool.parallel_for(n, 4096, [&](std::size_t b, std::size_t e) {  // first touch by the threads that use them
    for (std::size_t i = b; i < e; ++i) { pp[i] = 1.0f, pp[n + i] = 1e-3f, pp[2 * n + i] = 0.0f, pp[3 * n + i] = 0.0f; }
  });
  auto pass = [&] {
    pool.parallel_for(n, 4096, [&](std::size_t b, std::size_t e) {
      float* __restrict p       = pp;
      float const* __restrict g = pp + n;
      float* __restrict m       = pp + 2 * n;
      float* __restrict v       = pp + 3 * n;
      for (std::size_t i = b; i < e; ++i) {
        float const gi = g[i];
        float const mi = std::fma(0.9f, m[i], 0.1f * gi);
        m[i]           = mi;
        v[i]           = std::fma(0.999f, v[i], 0.001f * gi * gi);
        p[i]           = std::fma(-1e-6f, mi, p[i]);
      }
    });
  };
  pass();
  std::vector<double> t;
  for (int r = 0; r < 5; ++r) {
    auto const t0 = std::chrono::steady_clock::now();
    pass();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return 28.0 * static_cast<double>(n) / t[t.size() / 2] / 1e9;
}

/// The disk under folder `dir` through tierstate's engine with options `eo`: `bytes` read and
/// `bytes` written at once, in pieces of `piece`, on a nameless O_DIRECT scratch file (nothing
/// is left behind); median of `reps`. io_error where the folder cannot hold 2 x `bytes`.
inline double probe_disk_gb_s(std::string const& dir, std::size_t bytes, io::engine_options const& eo = {},
                              std::size_t piece = std::size_t{4} << 20, int reps = 3)
{
  bytes = std::max<std::size_t>(bytes / 4096 * 4096, 4096);
  piece = std::max<std::size_t>(piece / 4096 * 4096, 4096);
  int const fd = ::open(dir.c_str(), O_TMPFILE | O_RDWR | O_DIRECT | O_CLOEXEC, 0600);
  if (fd < 0) { throw io_error(errno, dir, "open(O_TMPFILE | O_DIRECT)", 0, 0, "the planner's scratch file"); }
  struct closer {
    int fd;
    ~closer() { ::close(fd); }
  } const close_it{fd};
  if (int const e = ::posix_fallocate(fd, 0, static_cast<off_t>(2 * bytes)); e != 0) {
    throw io_error(e, dir, "fallocate", 0, 2 * bytes, "the planner's scratch file");
  }
  detail::probe_buffer buf(2 * bytes);
  std::memset(buf.data(), 1, 2 * bytes);
  io::engine engine(eo);
  std::vector<io::request> writes, mixed;
  for (std::size_t at = 0; at < 2 * bytes; at += piece) {  // the file written once, so reads read data
    writes.push_back({fd, at, buf.data() + at, std::min(piece, 2 * bytes - at), true, &dir});
  }
  engine.submit(writes);
  for (std::size_t at = 0; at < bytes; at += piece) {  // then the first half read while the second is written
    std::size_t const len = std::min(piece, bytes - at);
    mixed.push_back({fd, at, buf.data() + at, len, false, &dir});
    mixed.push_back({fd, bytes + at, buf.data() + bytes + at, len, true, &dir});
  }
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    auto const t0 = std::chrono::steady_clock::now();
    engine.submit(mixed);
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return 2.0 * static_cast<double>(bytes) / t[t.size() / 2] / 1e9;
}

#if defined(TIERSTATE_ENABLE_CUDA)
/// PCIe between PinnedHost memory and the current GPU: `bytes` to the device, then `bytes` back,
/// on one stream (a step's params go one way and its gradients the other); bytes moved per
/// second, median of 5. Nothing (std::nullopt) where the runtime sees no GPU; a failure of the
/// probe itself (no memory to page-lock) is thrown.
inline std::optional<double> probe_pcie_gb_s(std::size_t bytes = std::size_t{256} << 20)
{
  int count = 0;
  if (::cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    (void)::cudaGetLastError();
    return std::nullopt;
  }
  PinnedHost host(bytes);
  std::memset(host.data(), 1, bytes);
  device::runtime::stream s;
  struct device_buffer {
    void* p;
    device::runtime::stream& s;
    ~device_buffer()
    {
      device::runtime::deallocate_async(p, s);
      try {
        s.synchronize();
      } catch (...) {  // (the probe's own failure is the one reported)
      }
    }
  } const dev{device::runtime::allocate_async(bytes, s), s};
  std::vector<double> t;
  for (int r = 0; r < 6; ++r) {
    auto const t0 = std::chrono::steady_clock::now();
    device::runtime::copy_async(dev.p, host.data(), bytes, s);
    device::runtime::copy_async(host.data(), dev.p, bytes, s);
    s.synchronize();
    if (r > 0) { t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()); }  // the first warms up
  }
  std::sort(t.begin(), t.end());
  return 2.0 * static_cast<double>(bytes) / t[t.size() / 2] / 1e9;
}
#endif

}  // namespace tierstate::plan
