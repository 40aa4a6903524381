// SPDX-License-Identifier: Apache-2.0
// The device gradients' keeper (a streaming step's grad_ready, for a tensor whose params rest
// in a param_source that keeps its gradient): grad_ready queues the gradient's copy down, on
// the trainer's stream after the work that made it, into a ring of pinned host memory, and
// returns. The keeper's thread waits for each copy in turn and hands the host copy on: the
// step's checks look at it and its source keeps it. So backward never waits on the host for
// the copy, the checks or the write, only, when they fall behind, for room in the ring, which
// holds two of the largest gradient.
#pragma once

#include <tierstate/core/device_runtime.hpp>
#include <tierstate/core/error.hpp>
#include <tierstate/tiers/pinned_host.hpp>

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

namespace tierstate::inline TIERSTATE_ABI::detail {

template <class Grad>
class grad_keeper {
 public:
  /// What the keeper's thread does with a copy once it is on the host: then(copy, nullptr),
  /// or then({}, failure) where the copy failed. It must not throw; the copy is valid until
  /// it returns.
  using then_type = std::function<void(std::span<Grad const>, std::exception_ptr)>;

  grad_keeper() = default;
  /// Hands on what is queued, then stops the thread.
  ~grad_keeper()
  {
    {
      std::lock_guard lock(m_);
      stopping_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) { thread_.join(); }
  }
  grad_keeper(grad_keeper const&)            = delete;
  grad_keeper& operator=(grad_keeper const&) = delete;

  /// The largest gradient it will be given, in elements: the ring holds two (made, or made
  /// again larger, at the next submit that finds nothing queued).
  void size_for(std::size_t elements)
  {
    std::lock_guard lock(m_);
    largest_ = elements;
    wanted_  = 2 * rounded(elements * sizeof(Grad));
  }
  /// The ring's bytes (0 before the first submit).
  [[nodiscard]] std::size_t ring_bytes() const
  {
    std::lock_guard lock(m_);
    return ring_ ? ring_->size() : 0;
  }

  /// Queues the copy down of the `n` elements at `from` (device memory), after the work
  /// queued on `ready` so far, and then(copy) on the keeper's thread. Waits for room in the
  /// ring first. Throws, queueing nothing, where the ring cannot be made (std::system_error,
  /// as PinnedHost's), n is more than size_for() said, or the copy cannot be queued.
  void submit(Grad const* from, std::size_t n, device::stream_view ready, then_type then)
  {
    std::size_t const bytes = rounded(n * sizeof(Grad));
    std::unique_lock lock(m_);
    if (n > largest_) {
      throw logic_error("grad_keeper: a gradient of " + std::to_string(n) + " elements, more than the " +
                        std::to_string(largest_) + " it was sized for");
    }
    cv_.wait(lock, [&] { return jobs_.empty() || (ring_->size() >= wanted_ && place(bytes).has_value()); });
    if (!ring_ || ring_->size() < wanted_) {  // (nothing queued: it may be replaced)
      ring_.reset();
      ring_ = std::make_unique<PinnedHost>(wanted_);
    }
    std::size_t const at = place(bytes).value_or(0);
    std::unique_ptr<device::event> copied;
    if (spare_.empty()) {
      copied = std::make_unique<device::event>();
    } else {
      copied = std::move(spare_.back());
      spare_.pop_back();
    }
    bool queued = false;
    try {
      if (!thread_.joinable()) { thread_ = std::thread([this] { loop(); }); }
      device::copy_async(ring_->data() + at, from, n * sizeof(Grad), ready);
      queued = true;
      copied->record(ready);
    } catch (...) {
      if (queued) {  // (a copy no event marks: done before its bytes may be given to another)
        try {
          ready.synchronize();
        } catch (...) {
        }
      }
      spare_.push_back(std::move(copied));
      throw;
    }
    jobs_.push_back({at, bytes, n, std::move(copied), std::move(then)});
    lock.unlock();
    cv_.notify_all();
  }

 private:
  struct job {
    std::size_t at = 0, bytes = 0, n = 0;  ///< in the ring; its elements
    std::unique_ptr<device::event> copied;
    then_type then;
  };
  static constexpr std::size_t alignment = 256;
  [[nodiscard]] static constexpr std::size_t rounded(std::size_t b) noexcept
  {
    return (b + alignment - 1) / alignment * alignment;
  }

  /// Under m_: where `bytes` fit in the ring after the jobs queued (the ring is used in
  /// order, as a circle: the queued jobs' bytes run from the first's start to the last's end).
  [[nodiscard]] std::optional<std::size_t> place(std::size_t bytes) const noexcept
  {
    if (jobs_.empty()) { return 0; }
    std::size_t const head = jobs_.front().at;
    std::size_t const tail = jobs_.back().at + jobs_.back().bytes;
    if (jobs_.back().at >= head) {  // [head, tail) in use: after it, or from the start
      if (tail + bytes <= ring_->size()) { return tail; }
      if (bytes <= head) { return 0; }
      return std::nullopt;
    }
    if (tail + bytes <= head) { return tail; }  // wrapped: [head, size) and [0, tail)
    return std::nullopt;
  }

  void loop()
  {
    std::unique_lock lock(m_);
    for (;;) {
      cv_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
      if (jobs_.empty()) { return; }  // (stopping: what was queued is handed on)
      job& j = jobs_.front();  // (stays in place, and its bytes in use, until then() returns)
      lock.unlock();
      std::exception_ptr failed;
      try {
        j.copied->synchronize();
      } catch (...) {
        failed = std::current_exception();
      }
      auto const* h = reinterpret_cast<Grad const*>(ring_->data() + j.at);
      j.then(failed ? std::span<Grad const>() : std::span<Grad const>(h, j.n), failed);
      lock.lock();
      spare_.push_back(std::move(j.copied));
      jobs_.pop_front();
      cv_.notify_all();
    }
  }

  mutable std::mutex m_;
  std::condition_variable cv_;
  std::size_t largest_ = 0;  ///< elements, from size_for
  std::size_t wanted_  = 0;  ///< the ring's bytes, from size_for
  std::unique_ptr<PinnedHost> ring_;
  std::deque<job> jobs_;  ///< queued, in order; the first is being handed on
  std::vector<std::unique_ptr<device::event>> spare_;  ///< events of jobs done, for reuse
  bool stopping_ = false;
  std::thread thread_;  ///< declared last
};

/// The optimizer's member: a keeper where device gradients may be kept in sources.
struct no_grad_keeper {};
template <class Grad, bool Used>
using grad_keeper_if = std::conditional_t<Used, grad_keeper<Grad>, no_grad_keeper>;

}  // namespace tierstate::detail
