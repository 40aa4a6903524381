// SPDX-License-Identifier: Apache-2.0
// The little of a device runtime tierstate uses: streams, events, device memory and copies.
// One API, declared here; two implementations behind it, chosen by TIERSTATE_ENABLE_CUDA.
//
// With TIERSTATE_ENABLE_CUDA (core/detail/device_runtime_cuda.inl) these wrap the CUDA
// runtime (any host compiler; link cudart): a `stream` is a non-blocking cudaStream_t, an
// `event` a cudaEvent_t without timing, device memory comes from cudaMallocAsync where the
// device has memory pools (cudaMalloc where it does not), and copies are cudaMemcpyAsync.
// Every failing call throws tierstate::cuda_error naming the call, after clearing CUDA's last
// error so that the next call does not see it.
//
// Without CUDA (core/detail/device_runtime_emulated.inl) the device is emulated on the host,
// the way Thrust's host backends treat "device" memory as host memory: device memory is host
// memory, a stream is a thread that runs its work in order, an event marks a point in a
// stream. The ordering rules are CUDA's (work on one stream runs in order; streams are
// ordered only by events), so code that forgets an event races here too, and the CPU test
// suite (ThreadSanitizer included) sees it. This is what lets the device compositions be
// tested on machines without a GPU. A failure inside a stream's work stays, like CUDA's
// sticky errors, until a synchronize() rethrows it.
//
//   stream s;                       // owns a stream
//   stream_view v = s;              // borrows one (or the default stream: stream_view{})
//   copy_async(dst, src, n, s);     // ordered on s; either side host or device
//   event e; e.record(s);           // a point in s
//   t.wait(e);                      // stream t waits for e, without blocking the host
//   e.synchronize();                // the host waits for e
//   void* p = allocate_async(n, s); deallocate_async(p, s);
//
// Where the two differ: the native handles (a cudaStream_t and cudaEvent_t, or the
// emulation's worker and recorded point); is_device_pointer, which only CUDA can answer (the
// emulation's device memory is host memory); and the emulation's default stream, which runs
// work at once on the calling thread, so it is always synchronized.
#pragma once

#include <tierstate/core/config.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

#if defined(TIERSTATE_ENABLE_CUDA)
#include <cuda_runtime_api.h>
#else
#include <memory>
#endif

namespace tierstate::inline TIERSTATE_ABI {

/// A failed device runtime call; what() names the call and the runtime's reason.
class cuda_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace device {
// An inline namespace of its own, so that the device kernels' detail namespace
// (device::TIERSTATE_DEVICE_ABI::detail, kernels/device/update.hpp) and this one never meet
// as two `device::detail`s: TIERSTATE_CUDA_TRY names this one in full.
inline namespace runtime {

// What the classes below hold: the implementation's handles.
namespace detail {
#if defined(TIERSTATE_ENABLE_CUDA)
using native_stream = cudaStream_t;  ///< a stream_view's, and what stream::native() gives
using owned_stream  = cudaStream_t;  ///< a stream's
using native_event  = cudaEvent_t;   ///< an event's, and what event::native() gives
#else
class stream_worker;  // core/detail/device_runtime_emulated.inl
using native_stream = stream_worker*;
using owned_stream  = std::shared_ptr<stream_worker>;
/// A point in a stream: its worker (kept alive, as a CUDA event outlives its stream) and
/// the number of tasks queued there before it.
struct event_point {
  std::shared_ptr<stream_worker> worker;
  std::uint64_t position = 0;
};
using native_event = event_point;
#endif
}  // namespace detail

/// Whether this build drives a real CUDA device (false) or the host emulation (true).
#if defined(TIERSTATE_ENABLE_CUDA)
inline constexpr bool is_emulated = false;
#else
inline constexpr bool is_emulated = true;
#endif

/// Evaluates `call`, which returns a status, and throws tierstate::cuda_error naming the call
/// and the status where it is not success. With CUDA the status is a cudaError_t; the error
/// says its name and text, and CUDA's last error is cleared first, so that the next call does
/// not report it again. In the emulation it is any integral or enum status whose zero is
/// success (the convention cudaError_t follows: cudaSuccess is 0); bool is refused, since
/// there `false` is usually the failure. The status is evaluated once; it never hides a
/// failure in either build.
#define TIERSTATE_CUDA_TRY(call)                                                                  \
  do {                                                                                            \
    auto const tierstate_cuda_status_ = (call);                                                   \
    if (!::tierstate::device::runtime::detail::succeeded(tierstate_cuda_status_)) [[unlikely]] { \
      ::tierstate::device::runtime::detail::throw_status(tierstate_cuda_status_, #call);         \
    }                                                                                             \
  } while (false)

/// Devices this process can use (0 when there is no driver or no device; 1, the host, in
/// the emulation).
[[nodiscard]] int count() noexcept;

/// Why there is no device, or the device's name.
[[nodiscard]] std::string describe();

class event;

/// A stream someone else owns; stream_view{} is the default stream (CUDA's legacy default
/// stream; in the emulation, the calling thread, at once).
class stream_view {
 public:
  constexpr stream_view() noexcept = default;
  constexpr stream_view(detail::native_stream s) noexcept : s_(s) {}  // NOLINT: implicit, like a view
  [[nodiscard]] constexpr detail::native_stream native() const noexcept { return s_; }
  /// Blocks the host until the stream's work is done; rethrows a failure of that work.
  void synchronize() const;
  /// Makes the work queued on this stream from now on wait for `e`, as recorded now (a later
  /// record() does not move this wait), without blocking the host.
  void wait(event const& e) const;

 private:
  detail::native_stream s_ = nullptr;
};

/// An owned stream (with CUDA, non-blocking: it never waits for the legacy default stream).
/// Destroying it lets the work queued on it finish.
class stream {
 public:
  stream();
  ~stream();
  stream(stream const&)            = delete;
  stream& operator=(stream const&) = delete;

  [[nodiscard]] detail::native_stream native() const noexcept;
  operator stream_view() const noexcept { return stream_view(native()); }  // NOLINT
  void synchronize() const;
  void wait(event const& e) const;

 private:
  detail::owned_stream s_{};
};

/// A point in a stream's work, for ordering another stream or the host after it.
class event {
 public:
  event();
  ~event();
  event(event const&)            = delete;
  event& operator=(event const&) = delete;

  /// Marks the end of the work queued on `s` so far.
  void record(stream_view s);
  /// Blocks the host until the recorded work is done (at once if never recorded).
  void synchronize() const;
  /// The handle (CUDA), or the point recorded: its stream and the number of tasks before it.
  [[nodiscard]] detail::native_event native() const noexcept { return e_; }

 private:
  detail::native_event e_{};
};

/// Copies `bytes` bytes on stream `s`; each side may be host or device memory (copies to
/// or from pageable host memory may block the host; pinned memory never does).
void copy_async(void* dst, void const* src, std::size_t bytes, stream_view s);

/// Copies and waits.
void copy(void* dst, void const* src, std::size_t bytes);

/// Queues `fn(arg)` on stream `s` (cudaLaunchHostFunc): it runs on a runtime thread once the
/// work queued before it is done, and the work queued after it waits for it. `fn` must not
/// call the device runtime, block, or throw. The tracer's marks (core/detail/stream_trace.hpp).
void launch_host_func(stream_view s, void (*fn)(void*), void* arg);

/// Sets `bytes` bytes of device memory to zero, on stream `s`.
void zero_async(void* dst, std::size_t bytes, stream_view s);

/// Whether the current device allocates in stream order (cudaMallocAsync; never in the
/// emulation). With CUDA, throws cuda_error where the runtime cannot say.
[[nodiscard]] bool has_memory_pools();

/// Device memory of `bytes` bytes (4 KiB-aligned in the emulation), usable by work queued
/// on `s` after this call; nullptr for 0 bytes. Throws cuda_error where there is not enough.
[[nodiscard]] void* allocate_async(std::size_t bytes, stream_view s);

/// Frees memory from allocate_async once the work queued on `s` so far is done. A failure
/// of that work is left to whoever synchronizes for it.
void deallocate_async(void* p, stream_view s) noexcept;

#if defined(TIERSTATE_ENABLE_CUDA)
/// CUDA only: whether `p` is device memory (false for host memory, pinned or not). The
/// emulation cannot tell, its device memory being host memory.
[[nodiscard]] bool is_device_pointer(void const* p) noexcept;
#endif

}  // namespace runtime
}  // namespace device
}  // namespace tierstate

#if defined(TIERSTATE_ENABLE_CUDA)
#include <tierstate/core/detail/device_runtime_cuda.inl>
#else
#include <tierstate/core/detail/device_runtime_emulated.inl>
#endif
