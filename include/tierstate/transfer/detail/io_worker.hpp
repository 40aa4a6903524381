// SPDX-License-Identifier: Apache-2.0
// The pipelined transfer's I/O thread: runs a tier's reads and writes in the order they are
// queued, batching those that use different staging buffers.
#pragma once

#include <tierstate/tiers/tier.hpp>

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace tierstate::detail {

template <tier Tier>
class io_worker {
 public:
  explicit io_worker(Tier& t) : tier_(t), thread_([this] { run(); }) {}
  ~io_worker()
  {
    {
      std::scoped_lock lock(mutex_);
      stop_ = true;
    }
    work_.notify_one();
    thread_.join();
  }
  io_worker(io_worker const&)            = delete;
  io_worker& operator=(io_worker const&) = delete;

  /// Queues one read or write through staging buffer `buffer`; returns its ticket. A job
  /// that reuses a buffer starts only after every job queued before it has finished.
  std::uint64_t enqueue(tier_io const& io, unsigned buffer)
  {
    std::uint64_t ticket;
    {
      std::scoped_lock lock(mutex_);
      queue_.push_back({io, buffer});
      ticket = ++queued_;
    }
    work_.notify_one();
    return ticket;
  }

  /// Blocks until job `ticket` and all before it are done; rethrows the first failure of any
  /// job (once a job fails, the jobs after it are dropped, not run).
  void wait(std::uint64_t ticket)
  {
    std::unique_lock lock(mutex_);
    done_cv_.wait(lock, [&] { return done_ >= ticket || error_ != nullptr; });
    if (error_) { std::rethrow_exception(error_); }
  }

  /// Waits until every queued job has finished or been dropped, then forgets any failure:
  /// after it, no staging buffer is in use.
  void drain() noexcept
  {
    std::unique_lock lock(mutex_);
    done_cv_.wait(lock, [&] { return done_ >= queued_; });
    error_ = nullptr;
  }

 private:
  struct job {
    tier_io io;
    unsigned buffer;
  };

  void run()
  {
    std::vector<job> batch;
    std::vector<tier_io> ops;
    std::unique_lock lock(mutex_);
    for (;;) {
      work_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) { return; }  // stop_, with nothing left to do
      if (error_) {
        // A job failed: the rest of this step's jobs are dropped.
        done_ += queue_.size();
        queue_.clear();
        done_cv_.notify_all();
        continue;
      }
      // The longest prefix whose jobs use different buffers.
      batch.clear();
      while (!queue_.empty()) {
        bool clash = false;
        for (auto const& j : batch) { clash = clash || j.buffer == queue_.front().buffer; }
        if (clash) { break; }
        batch.push_back(queue_.front());
        queue_.pop_front();
      }
      lock.unlock();
      std::exception_ptr failure;
      try {
        if constexpr (batched_tier<Tier>) {
          ops.clear();
          for (auto const& j : batch) { ops.push_back(j.io); }
          tier_.transfer(ops);
        } else {
          for (auto const& j : batch) {
            if (j.io.write) {
              tier_.write(j.io.offset, {j.io.data, j.io.length});
            } else {
              tier_.read(j.io.offset, {j.io.data, j.io.length});
            }
          }
        }
      } catch (...) {
        failure = std::current_exception();
      }
      lock.lock();
      if (failure && !error_) { error_ = failure; }
      done_ += batch.size();
      done_cv_.notify_all();
    }
  }

  Tier& tier_;
  std::mutex mutex_;
  std::condition_variable work_, done_cv_;
  std::deque<job> queue_;
  std::uint64_t queued_ = 0, done_ = 0;
  std::exception_ptr error_;
  bool stop_ = false;
  std::thread thread_;  // last: started after everything it uses
};

}  // namespace tierstate::detail
