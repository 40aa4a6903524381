// SPDX-License-Identifier: Apache-2.0
// core/device_runtime.hpp's API over the CUDA runtime (TIERSTATE_ENABLE_CUDA).
#pragma once

#include <cuda_runtime_api.h>

namespace tierstate::inline TIERSTATE_ABI::device::inline runtime {

namespace detail {

[[nodiscard]] constexpr bool succeeded(cudaError_t e) noexcept { return e == cudaSuccess; }

[[noreturn]] inline void throw_status(cudaError_t e, char const* call)
{
  (void)cudaGetLastError();  // clear it: the next call must not report it again
  std::string text = "tierstate: ";
  text.append(call).append(" failed: ").append(cudaGetErrorName(e)).append(" (");
  text.append(cudaGetErrorString(e)).append(")");
  throw cuda_error(text);
}

}  // namespace detail

inline int count() noexcept
{
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

inline std::string describe()
{
  int n               = 0;
  cudaError_t const e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return std::string("no CUDA device (cudaGetDeviceCount: ").append(cudaGetErrorString(e)).append(")");
  }
  if (n == 0) { return "no CUDA device (cudaGetDeviceCount: 0)"; }
  int d = 0;
  cudaDeviceProp p{};
  if (cudaGetDevice(&d) != cudaSuccess || cudaGetDeviceProperties(&p, d) != cudaSuccess) {
    (void)cudaGetLastError();
    return "a CUDA device";
  }
  return std::string(p.name);
}

inline void stream_view::synchronize() const { TIERSTATE_CUDA_TRY(cudaStreamSynchronize(s_)); }

inline void stream_view::wait(event const& e) const
{
  TIERSTATE_CUDA_TRY(cudaStreamWaitEvent(s_, e.native(), 0));
}

inline stream::stream() { TIERSTATE_CUDA_TRY(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking)); }

inline stream::~stream()
{
  if (s_ != nullptr) {
    (void)cudaStreamSynchronize(s_);
    (void)cudaStreamDestroy(s_);
  }
}

inline detail::native_stream stream::native() const noexcept { return s_; }
inline void stream::synchronize() const { stream_view(s_).synchronize(); }
inline void stream::wait(event const& e) const { stream_view(s_).wait(e); }

inline event::event() { TIERSTATE_CUDA_TRY(cudaEventCreateWithFlags(&e_, cudaEventDisableTiming)); }

inline event::~event()
{
  if (e_ != nullptr) { (void)cudaEventDestroy(e_); }
}

inline void event::record(stream_view s) { TIERSTATE_CUDA_TRY(cudaEventRecord(e_, s.native())); }
inline void event::synchronize() const { TIERSTATE_CUDA_TRY(cudaEventSynchronize(e_)); }

inline void copy_async(void* dst, void const* src, std::size_t bytes, stream_view s)
{
  if (bytes == 0) { return; }
  TIERSTATE_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s.native()));
}

inline void copy(void* dst, void const* src, std::size_t bytes)
{
  if (bytes == 0) { return; }
  TIERSTATE_CUDA_TRY(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault));
}

inline void launch_host_func(stream_view s, void (*fn)(void*), void* arg)
{
  TIERSTATE_CUDA_TRY(cudaLaunchHostFunc(s.native(), fn, arg));
}

inline void zero_async(void* dst, std::size_t bytes, stream_view s)
{
  if (bytes == 0) { return; }
  TIERSTATE_CUDA_TRY(cudaMemsetAsync(dst, 0, bytes, s.native()));
}

inline bool has_memory_pools()
{
  int d = 0;
  int pools = 0;
  TIERSTATE_CUDA_TRY(cudaGetDevice(&d));
  TIERSTATE_CUDA_TRY(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, d));
  return pools != 0;
}

inline void* allocate_async(std::size_t bytes, stream_view s)
{
  if (bytes == 0) { return nullptr; }
  void* p = nullptr;
  cudaError_t const e = has_memory_pools() ? cudaMallocAsync(&p, bytes, s.native()) : cudaMalloc(&p, bytes);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    std::string text = "tierstate: cannot allocate ";
    text.append(std::to_string(bytes)).append(" bytes of device memory: ").append(cudaGetErrorString(e));
    throw cuda_error(text);
  }
  return p;
}

inline void deallocate_async(void* p, stream_view s) noexcept
{
  if (p == nullptr) { return; }
  int d = 0;
  int pools = 0;
  if (cudaGetDevice(&d) == cudaSuccess &&
      cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, d) == cudaSuccess && pools != 0) {
    (void)cudaFreeAsync(p, s.native());
  } else {
    (void)cudaStreamSynchronize(s.native());
    (void)cudaFree(p);
  }
  (void)cudaGetLastError();
}

inline bool is_device_pointer(void const* p) noexcept
{
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

}  // namespace tierstate::inline TIERSTATE_ABI::device::inline runtime
