// SPDX-License-Identifier: Apache-2.0
// core/device_runtime.hpp's API over the host emulation (without TIERSTATE_ENABLE_CUDA):
// device memory is host memory, a stream is a worker thread, an event a point in a stream.
#pragma once

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <thread>
#include <type_traits>

namespace tierstate::inline TIERSTATE_ABI::device::inline runtime {

namespace detail {

/// TIERSTATE_CUDA_TRY's test: an integral or enum status, zero for success.
template <class Status>
  requires((std::is_integral_v<Status> && !std::is_same_v<Status, bool>) || std::is_enum_v<Status>)
[[nodiscard]] constexpr bool succeeded(Status s) noexcept
{
  return s == Status{};
}

template <class Status>
[[noreturn]] void throw_status(Status s, char const* call)
{
  std::string text = "tierstate: ";
  text.append(call).append(" failed: status ").append(std::to_string(static_cast<long long>(s)));
  text.append(" (emulated device)");
  throw cuda_error(text);
}

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

/// The emulation's launch: runs `task` in `s`'s order (at once, on the calling thread, for
/// the default stream). Not part of the declared API: CUDA launches its own way (the device
/// kernels' CUDA path hands Thrust the stream), so only emulation code calls this.
inline void enqueue(stream_view s, std::function<void()> task)
{
  if (s.native() == nullptr) {
    task();
  } else {
    s.native()->enqueue(std::move(task));
  }
}

}  // namespace detail

inline int count() noexcept { return 1; }

inline std::string describe()
{
  return "the host (emulated device: built without TIERSTATE_ENABLE_CUDA)";
}

inline void stream_view::synchronize() const
{
  if (s_ != nullptr) { s_->synchronize(); }
}

inline void stream_view::wait(event const& e) const
{
  // The point as recorded now (a later record() does not move this wait, as in CUDA).
  auto [w, position] = e.native();
  if (w == nullptr || w.get() == s_) { return; }  // nothing recorded, or already in order
  // The task holds the other stream's worker: it outlives that stream's owner if need be.
  detail::enqueue(*this, [w = std::move(w), position = position] { w->wait_for(position); });
}

inline stream::stream() : s_(std::make_shared<detail::stream_worker>()) {}
inline stream::~stream() = default;

inline detail::native_stream stream::native() const noexcept { return s_.get(); }
inline void stream::synchronize() const { s_->synchronize(); }
inline void stream::wait(event const& e) const { stream_view(s_.get()).wait(e); }

inline event::event()  = default;
inline event::~event() = default;

inline void event::record(stream_view s)
{
  e_.worker   = s.native() != nullptr ? s.native()->shared_from_this() : nullptr;
  e_.position = e_.worker != nullptr ? e_.worker->position() : 0;
}

inline void event::synchronize() const
{
  if (e_.worker != nullptr) { e_.worker->wait_for(e_.position); }
}

inline void copy_async(void* dst, void const* src, std::size_t bytes, stream_view s)
{
  if (bytes == 0) { return; }
  detail::enqueue(s, [=] { std::memcpy(dst, src, bytes); });
}

inline void copy(void* dst, void const* src, std::size_t bytes)
{
  if (bytes != 0) { std::memcpy(dst, src, bytes); }
}

inline void launch_host_func(stream_view s, void (*fn)(void*), void* arg)
{
  detail::enqueue(s, [=] { fn(arg); });
}

inline void zero_async(void* dst, std::size_t bytes, stream_view s)
{
  if (bytes == 0) { return; }
  detail::enqueue(s, [=] { std::memset(dst, 0, bytes); });
}

inline bool has_memory_pools() { return false; }

inline void* allocate_async(std::size_t bytes, stream_view)
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

}  // namespace tierstate::inline TIERSTATE_ABI::device::inline runtime
