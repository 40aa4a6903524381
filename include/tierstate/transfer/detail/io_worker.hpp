// SPDX-License-Identifier: Apache-2.0
// The pipelined transfer's I/O thread: runs a tier's reads and writes in the order they are
// queued; a job never starts while an earlier job on the same staging buffer is unfinished.
//   - a streaming tier (NvmeFile) gets every job as soon as its buffer is free, and reports
//     each as it finishes: the disk stays busy across chunk boundaries;
//   - a batched tier gets the longest run of queued jobs on distinct buffers, as one batch;
//   - any other tier gets them one at a time.
// A streaming tier reports failures through stream_progress's callback. Should
// stream_progress itself throw, every job started and not yet reported fails with what it
// threw; if the tier then still has requests active (stream_active() > 0), it cannot say
// what became of them, and it is never driven again: every later job fails at once with the
// same exception, instead of calling into a tier that throws (a busy loop) or waiting for
// requests it will never report (a hang). What such a tier still holds is its own affair.
#pragma once

#include <tierstate/core/trace.hpp>
#include <tierstate/tiers/tier.hpp>

#include <algorithm>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <mutex>
#include <set>
#include <utility>
#include <thread>
#include <vector>

namespace tierstate::inline TIERSTATE_ABI::detail {

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
  /// that reuses a buffer starts only after every job queued before it has finished. With a
  /// tracer, the job's time from its start in the tier to its end is recorded as chunk
  /// `chunk`'s read or write, on the buffer's I/O track.
  std::uint64_t enqueue(tier_io const& io, unsigned buffer, tracer* trace = nullptr, std::int64_t chunk = -1)
  {
    std::uint64_t ticket;
    {
      std::scoped_lock lock(mutex_);
      queue_.push_back({io, buffer, detail::traced(trace), chunk});
      ticket = ++queued_;
    }
    work_.notify_one();
    return ticket;
  }

  /// Blocks until job `ticket` is done; rethrows the first failure of any job (once a job
  /// fails, the jobs queued after it are dropped, not run).
  void wait(std::uint64_t ticket)
  {
    std::unique_lock lock(mutex_);
    done_cv_.wait(lock, [&] { return is_done(ticket) || error_ != nullptr; });
    if (error_) { std::rethrow_exception(error_); }
  }

  /// Blocks until every queued job is done (jobs finish out of order: waiting for the last
  /// ticket is not enough); rethrows the first failure.
  void wait_all()
  {
    std::unique_lock lock(mutex_);
    done_cv_.wait(lock, [&] { return done_ >= queued_ || error_ != nullptr; });
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
    tracer* trace      = nullptr;
    std::int64_t chunk = -1;
  };

  /// A job the tier has started (streaming): its ticket, and what its trace event needs.
  struct started_job {
    std::uint64_t ticket;
    job j;
    tracer::clock::time_point begin{};
  };

  static void record(job const& j, tracer::clock::time_point begin, tracer::clock::time_point end) noexcept
  {
    if (j.trace != nullptr) [[unlikely]] {
      j.trace->record(j.io.write ? trace_phase::write : trace_phase::read, j.chunk, j.io.length, begin, end,
                      tracer::io_track(j.buffer));
    }
  }

  [[nodiscard]] bool is_done(std::uint64_t ticket) const { return ticket <= done_ || finished_.count(ticket) > 0; }

  /// Marks `ticket` finished (under the lock) and moves the watermark.
  void mark_done(std::uint64_t ticket)
  {
    finished_.insert(ticket);
    while (finished_.count(done_ + 1) > 0) { finished_.erase(++done_); }
  }

  void run()
  {
    if constexpr (streaming_tier<Tier>) {
      run_streaming();
    } else {
      run_batched();
    }
  }

  void run_streaming()
  {
    std::vector<started_job> started;
    std::vector<std::pair<std::uint64_t, std::exception_ptr>> finished;
    std::uint64_t next_ticket = 1;
    std::exception_ptr given_up;  // what the tier threw with requests active: never driven again
    std::unique_lock lock(mutex_);
    for (;;) {
      // Start every queued job whose buffer is free, in order, stopping at the first that waits.
      while (!queue_.empty()) {
        if (error_ || given_up) {
          if (!error_) { error_ = given_up; }
          for (std::size_t i = 0; i < queue_.size(); ++i) { mark_done(next_ticket++); }
          queue_.clear();
          done_cv_.notify_all();
          break;
        }
        job const j = queue_.front();
        bool clash  = false;
        for (auto const& st : started) { clash = clash || st.j.buffer == j.buffer; }
        if (clash) { break; }
        queue_.pop_front();
        std::uint64_t const ticket = next_ticket++;
        started.push_back({ticket, j, j.trace != nullptr ? tracer::clock::now() : tracer::clock::time_point{}});
        lock.unlock();
        try {
          tier_.stream_start(j.io, ticket);
        } catch (...) {
          finished.push_back({ticket, std::current_exception()});
        }
        lock.lock();
      }
      if ((given_up || tier_.stream_active() == 0) && finished.empty()) {
        // Nothing in flight (or nothing that will ever be reported): sleep until there is
        // work (or it is time to stop).
        if (queue_.empty()) {
          if (stop_) { return; }
          work_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        }
        continue;
      }
      lock.unlock();
      try {
        tier_.stream_progress(true, [&](std::uint64_t ticket, std::exception_ptr e) {
          finished.push_back({ticket, std::move(e)});
        });
      } catch (...) {
        // Every started job not reported fails with it (each once).
        auto const e = std::current_exception();
        for (auto const& st : started) {
          bool const reported = std::any_of(finished.begin(), finished.end(),
                                            [&](auto const& f) { return f.first == st.ticket; });
          if (!reported) { finished.push_back({st.ticket, e}); }
        }
        if (tier_.stream_active() != 0) { given_up = e; }
      }
      if (!finished.empty()) {
        // Traced before they are marked done: a waiter's return orders the event before it.
        tracer::clock::time_point const end = tracer::clock::now();
        for (auto const& [ticket, e] : finished) {
          for (auto const& st : started) {
            if (st.ticket == ticket && !e) { record(st.j, st.begin, end); }
          }
        }
      }
      lock.lock();
      for (auto& [ticket, e] : finished) {
        if (e && !error_) { error_ = e; }
        std::erase_if(started, [t = ticket](auto const& st) { return st.ticket == t; });
        mark_done(ticket);
      }
      if (!finished.empty()) { done_cv_.notify_all(); }
      finished.clear();
    }
  }

  void run_batched()
  {
    std::vector<job> batch;
    std::vector<tier_io> ops;
    std::unique_lock lock(mutex_);
    for (;;) {
      work_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) { return; }  // stop_, with nothing left to do
      if (error_) {
        // A job failed: the rest of this step's jobs are dropped.
        for (std::size_t i = 0; i < queue_.size(); ++i) { mark_done(done_ + 1); }
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
      bool const traced = std::any_of(batch.begin(), batch.end(), [](job const& j) { return j.trace != nullptr; });
      auto const begin  = traced ? tracer::clock::now() : tracer::clock::time_point{};
      try {
        if constexpr (batched_tier<Tier>) {
          ops.clear();
          for (auto const& j : batch) { ops.push_back(j.io); }
          tier_.transfer(ops);
        } else {
          for (auto const& j : batch) {
            auto const t0 = j.trace != nullptr ? tracer::clock::now() : tracer::clock::time_point{};
            if (j.io.write) {
              tier_.write(j.io.offset, {j.io.data, j.io.length});
            } else {
              tier_.read(j.io.offset, {j.io.data, j.io.length});
            }
            if (j.trace != nullptr) { record(j, t0, tracer::clock::now()); }
          }
        }
      } catch (...) {
        failure = std::current_exception();
      }
      if (batched_tier<Tier> && traced && !failure) {  // (the batch's jobs ran together)
        auto const end = tracer::clock::now();
        for (auto const& j : batch) { record(j, begin, end); }
      }
      lock.lock();
      if (failure && !error_) { error_ = failure; }
      for (std::size_t i = 0; i < batch.size(); ++i) { mark_done(done_ + 1); }
      done_cv_.notify_all();
    }
  }

  Tier& tier_;
  std::mutex mutex_;
  std::condition_variable work_, done_cv_;
  std::deque<job> queue_;
  std::uint64_t queued_ = 0;
  std::uint64_t done_   = 0;        ///< every ticket up to this one is finished
  std::set<std::uint64_t> finished_;  ///< finished tickets above done_
  std::exception_ptr error_;
  bool stop_ = false;
  std::thread thread_;  // last: started after everything it uses
};

}  // namespace tierstate::detail
