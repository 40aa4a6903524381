// SPDX-License-Identifier: Apache-2.0
// The little of a device runtime tierstate uses: streams, events, device memory and copies.
//
// With TIERSTATE_ENABLE_CUDA these wrap the CUDA runtime (any host compiler; link cudart):
// a `stream` is a non-blocking cudaStream_t, an `event` a cudaEvent_t without timing, device
// memory comes from cudaMallocAsync where the device has memory pools (cudaMalloc where it
// does not), and copies are cudaMemcpyAsync. Every failing call throws tierstate::cuda_error
// naming the call, after clearing CUDA's last error so that the next call does not see it.
//
// Without CUDA the device is emulated on the host, the way Thrust's host backends treat
// "device" memory as host memory: device memory is host memory, a stream is a thread that
// runs its work in order, an event marks a point in a stream. The ordering rules are CUDA's
// (work on one stream runs in order; streams are ordered only by events), so code that
// forgets an event races here too, and the CPU test suite (ThreadSanitizer included) sees
// it. This is what lets the device compositions be tested on machines without a GPU.
//
//   stream s;                       // owns a stream
//   stream_view v = s;              // borrows one (or the default stream: stream_view{})
//   copy_async(dst, src, n, s);     // ordered on s; either side host or device
//   event e; e.record(s);           // a point in s
//   t.wait(e);                      // stream t waits for e, without blocking the host
//   e.synchronize();                // the host waits for e
//   void* p = allocate_async(n, s); deallocate_async(p, s);
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
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <thread>
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

#if defined(TIERSTATE_ENABLE_CUDA)

/// Whether this build drives a real CUDA device (false: the host emulation).
inline constexpr bool is_emulated = false;

namespace detail {
[[noreturn]] inline void throw_cuda(cudaError_t e, char const* call)
{
  (void)cudaGetLastError();  // clear it: the next call must not report it again
  std::string text = "tierstate: ";
  text.append(call).append(" failed: ").append(cudaGetErrorName(e)).append(" (");
  text.append(cudaGetErrorString(e)).append(")");
  throw cuda_error(text);
}
}  // namespace detail

#define TIERSTATE_CUDA_TRY(call)                                                       \
  do {                                                                                 \
    cudaError_t const tierstate_cuda_status_ = (call);                                 \
    if (tierstate_cuda_status_ != cudaSuccess) [[unlikely]] {                          \
      ::tierstate::device::runtime::detail::throw_cuda(tierstate_cuda_status_, #call);\
    }                                                                                  \
  } while (false)

/// Devices this process can use (0 when there is no driver or no device).
[[nodiscard]] inline int count() noexcept
{
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

/// Why there is no device, or the device's name.
[[nodiscard]] inline std::string describe()
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

/// A stream someone else owns; stream_view{} is the legacy default stream.
class stream_view {
 public:
  constexpr stream_view() noexcept = default;
  constexpr stream_view(cudaStream_t s) noexcept : s_(s) {}  // NOLINT: implicit, like a view
  [[nodiscard]] constexpr cudaStream_t native() const noexcept { return s_; }
  /// Blocks the host until the stream's work is done.
  void synchronize() const { TIERSTATE_CUDA_TRY(cudaStreamSynchronize(s_)); }
  inline void wait(class event const& e) const;

 private:
  cudaStream_t s_ = nullptr;
};

/// An owned, non-blocking stream (it never waits for the legacy default stream).
class stream {
 public:
  stream() { TIERSTATE_CUDA_TRY(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking)); }
  ~stream()
  {
    if (s_ != nullptr) {
      (void)cudaStreamSynchronize(s_);
      (void)cudaStreamDestroy(s_);
    }
  }
  stream(stream const&)            = delete;
  stream& operator=(stream const&) = delete;

  [[nodiscard]] cudaStream_t native() const noexcept { return s_; }
  operator stream_view() const noexcept { return stream_view(s_); }  // NOLINT
  void synchronize() const { stream_view(s_).synchronize(); }
  void wait(class event const& e) const { stream_view(s_).wait(e); }

 private:
  cudaStream_t s_ = nullptr;
};

/// A point in a stream's work, for ordering another stream or the host after it.
class event {
 public:
  event() { TIERSTATE_CUDA_TRY(cudaEventCreateWithFlags(&e_, cudaEventDisableTiming)); }
  ~event()
  {
    if (e_ != nullptr) { (void)cudaEventDestroy(e_); }
  }
  event(event const&)            = delete;
  event& operator=(event const&) = delete;

  /// Marks the end of the work queued on `s` so far.
  void record(stream_view s) { TIERSTATE_CUDA_TRY(cudaEventRecord(e_, s.native())); }
  /// Blocks the host until the recorded work is done (at once if never recorded).
  void synchronize() const { TIERSTATE_CUDA_TRY(cudaEventSynchronize(e_)); }
  [[nodiscard]] cudaEvent_t native() const noexcept { return e_; }

 private:
  cudaEvent_t e_ = nullptr;
};

inline void stream_view::wait(event const& e) const
{
  TIERSTATE_CUDA_TRY(cudaStreamWaitEvent(s_, e.native(), 0));
}

/// Copies `bytes` bytes on stream `s`; each side may be host or device memory (copies to
/// or from pageable host memory may block the host; pinned memory never does).
inline void copy_async(void* dst, void const* src, std::size_t bytes, stream_view s)
{
  if (bytes == 0) { return; }
  TIERSTATE_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s.native()));
}

/// Copies and waits.
inline void copy(void* dst, void const* src, std::size_t bytes)
{
  if (bytes == 0) { return; }
  TIERSTATE_CUDA_TRY(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault));
}

/// Sets `bytes` bytes of device memory to zero, on stream `s`.
inline void zero_async(void* dst, std::size_t bytes, stream_view s)
{
  if (bytes == 0) { return; }
  TIERSTATE_CUDA_TRY(cudaMemsetAsync(dst, 0, bytes, s.native()));
}

/// Whether the current device allocates in stream order (cudaMallocAsync).
[[nodiscard]] inline bool has_memory_pools()
{
  int d = 0;
  int pools = 0;
  TIERSTATE_CUDA_TRY(cudaGetDevice(&d));
  TIERSTATE_CUDA_TRY(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, d));
  return pools != 0;
}

/// Device memory of `bytes` bytes, usable by work queued on `s` after this call.
[[nodiscard]] inline void* allocate_async(std::size_t bytes, stream_view s)
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

/// Frees memory from allocate_async once the work queued on `s` so far is done.
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

/// Whether `p` is device memory (false for host memory, pinned or not).
[[nodiscard]] inline bool is_device_pointer(void const* p) noexcept
{
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

#else  // the host emulation

inline constexpr bool is_emulated = true;

[[nodiscard]] inline int count() noexcept { return 1; }
[[nodiscard]] inline std::string describe()
{
  return "the host (emulated device: built without TIERSTATE_ENABLE_CUDA)";
}

namespace detail {

/// A worker thread that runs tasks in the order they were queued. Shared: an event keeps
/// the worker it was recorded on alive, as a CUDA event outlives its stream.
class stream_worker : public std::enable_shared_from_this<stream_worker> {
 public:
  stream_worker() : thread_([this] { run(); }) {}
  ~stream_worker()
  {
    {
      std::lock_guard lock(m_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  stream_worker(stream_worker const&)            = delete;
  stream_worker& operator=(stream_worker const&) = delete;

  void enqueue(std::function<void()> task)
  {
    {
      std::lock_guard lock(m_);
      tasks_.push_back(std::move(task));
      ++queued_;
    }
    cv_.notify_all();
  }

  /// The number of tasks queued so far: a point in this stream.
  [[nodiscard]] std::uint64_t position()
  {
    std::lock_guard lock(m_);
    return queued_;
  }

  /// Waits until the first `position` tasks have run; rethrows the first task failure
  /// (which stays, like CUDA's sticky errors, until synchronize() reports it).
  void wait_for(std::uint64_t position)
  {
    std::unique_lock lock(m_);
    cv_.wait(lock, [&] { return done_ >= position; });
    if (failure_) { std::rethrow_exception(failure_); }
  }

  /// Waits for every task queued so far; rethrows, and clears, the first failure.
  void synchronize()
  {
    std::unique_lock lock(m_);
    std::uint64_t const position = queued_;
    cv_.wait(lock, [&] { return done_ >= position; });
    if (failure_) { std::rethrow_exception(std::exchange(failure_, nullptr)); }
  }

 private:
  void run()
  {
    std::unique_lock lock(m_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
      if (tasks_.empty()) { return; }
      auto task = std::move(tasks_.front());
      tasks_.pop_front();
      lock.unlock();
      std::exception_ptr failure;
      try {
        task();
      } catch (...) {
        failure = std::current_exception();
      }
      lock.lock();
      if (failure && !failure_) { failure_ = failure; }
      ++done_;
      cv_.notify_all();
    }
  }

  std::mutex m_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  std::uint64_t queued_ = 0;
  std::uint64_t done_   = 0;
  std::exception_ptr failure_;
  bool stop_ = false;
  std::thread thread_;  // last: starts after the members it uses
};

}  // namespace detail

class event;

/// A stream someone else owns; stream_view{} is the default stream, which in the emulation
/// runs work at once on the calling thread (so it is always synchronized).
class stream_view {
 public:
  constexpr stream_view() noexcept = default;
  explicit constexpr stream_view(detail::stream_worker* w) noexcept : w_(w) {}
  [[nodiscard]] constexpr detail::stream_worker* native() const noexcept { return w_; }

  /// Runs `task` in the stream's order (at once, for the default stream).
  void enqueue(std::function<void()> task) const
  {
    if (w_ == nullptr) {
      task();
    } else {
      w_->enqueue(std::move(task));
    }
  }
  void synchronize() const
  {
    if (w_ != nullptr) { w_->synchronize(); }
  }
  inline void wait(event const& e) const;

 private:
  detail::stream_worker* w_ = nullptr;
};

class stream {
 public:
  stream() : w_(std::make_shared<detail::stream_worker>()) {}
  stream(stream const&)            = delete;
  stream& operator=(stream const&) = delete;

  [[nodiscard]] detail::stream_worker* native() const noexcept { return w_.get(); }
  operator stream_view() const noexcept { return stream_view(w_.get()); }  // NOLINT
  void synchronize() const { w_->synchronize(); }
  void wait(event const& e) const { stream_view(w_.get()).wait(e); }

 private:
  std::shared_ptr<detail::stream_worker> w_;
};

class event {
 public:
  event() = default;
  event(event const&)            = delete;
  event& operator=(event const&) = delete;

  void record(stream_view s)
  {
    w_        = s.native() != nullptr ? s.native()->shared_from_this() : nullptr;
    position_ = w_ != nullptr ? w_->position() : 0;
  }
  void synchronize() const
  {
    if (w_ != nullptr) { w_->wait_for(position_); }
  }
  /// The recorded point: its stream and the number of tasks before it.
  [[nodiscard]] std::pair<std::shared_ptr<detail::stream_worker>, std::uint64_t> point() const noexcept
  {
    return {w_, position_};
  }

 private:
  std::shared_ptr<detail::stream_worker> w_;
  std::uint64_t position_ = 0;
};

inline void stream_view::wait(event const& e) const
{
  // The point as recorded now (a later record() does not move this wait, as in CUDA).
  auto [w, position] = e.point();
  if (w == nullptr || w.get() == w_) { return; }  // nothing recorded, or already in order
  // The task holds the other stream's worker: it outlives that stream's owner if need be.
  enqueue([w = std::move(w), position = position] { w->wait_for(position); });
}

inline void copy_async(void* dst, void const* src, std::size_t bytes, stream_view s)
{
  if (bytes == 0) { return; }
  s.enqueue([=] { std::memcpy(dst, src, bytes); });
}

inline void copy(void* dst, void const* src, std::size_t bytes)
{
  if (bytes != 0) { std::memcpy(dst, src, bytes); }
}

inline void zero_async(void* dst, std::size_t bytes, stream_view s)
{
  if (bytes == 0) { return; }
  s.enqueue([=] { std::memset(dst, 0, bytes); });
}

[[nodiscard]] inline bool has_memory_pools() noexcept { return false; }

[[nodiscard]] inline void* allocate_async(std::size_t bytes, stream_view)
{
  if (bytes == 0) { return nullptr; }
  void* p = ::operator new(bytes, std::align_val_t{4096}, std::nothrow);
  if (p == nullptr) {
    std::string text = "tierstate: cannot allocate ";
    text.append(std::to_string(bytes)).append(" bytes of (emulated) device memory");
    throw cuda_error(text);
  }
  return p;
}

inline void deallocate_async(void* p, stream_view s) noexcept
{
  if (p == nullptr) { return; }
  try {
    s.synchronize();
  } catch (...) {  // a failure belongs to whoever synchronizes for it, not to a release
  }
  ::operator delete(p, std::align_val_t{4096});
}

#endif

}  // namespace runtime
}  // namespace device
}  // namespace tierstate
