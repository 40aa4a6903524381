// SPDX-License-Identifier: Apache-2.0
// The psync backend: pread and pwrite on queue_depth threads of its own, for machines where
// io_uring is forbidden. Chosen by the user (engine_options::backend), never silently.
//
// Timeouts (engine_options::timeout, see io/engine.hpp): a pread or pwrite cannot be
// cancelled, so a piece that has not returned within the timeout leaves its thread stuck
// in the kernel with the piece's buffer. submit() then waits cancel_grace() for the other
// pieces in flight, gives up on those still out (their threads are left to finish on their
// own: the engine's destructor does not wait for them), throws an io_error with ETIMEDOUT
// naming the hung piece, and the engine is broken: every later submit() throws an io_error
// saying so, and held() lists the buffers the stuck threads may still write into (reads) or
// read from (writes). Their owners must neither free nor reuse them (leak them). A stuck
// thread keeps what the engine shared with it (its bookkeeping, the fault plan) alive until
// its call returns, and touches nothing of the engine's, or the file, after that.
#pragma once

#include <tierstate/core/error.hpp>
#include <tierstate/io/detail/pieces.hpp>
#include <tierstate/io/request.hpp>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

namespace tierstate::inline TIERSTATE_ABI::io {

class psync_engine {
 public:
  explicit psync_engine(engine_options const& o = {}) : opts_((o.validate(), o)), shared_(std::make_shared<state>())
  {
    shared_->faults  = o.faults;
    shared_->timeout = o.timeout;
    for (unsigned i = 0; i < o.queue_depth; ++i) { shared_->workers.push_back(std::make_unique<worker>()); }
    try {
      for (unsigned i = 0; i < o.queue_depth; ++i) {
        threads_.emplace_back([s = shared_, i] { run(*s, *s->workers[i]); });
      }
    } catch (...) {
      stop();
      throw;
    }
  }
  /// Stops the threads; a thread stuck in a call the engine gave up on is left to finish on
  /// its own (see the file comment).
  ~psync_engine() { stop(); }
  psync_engine(psync_engine const&)            = delete;
  psync_engine& operator=(psync_engine const&) = delete;

  [[nodiscard]] engine_options const& options() const noexcept { return opts_; }

  /// Whether the engine can still transfer (see the file comment).
  [[nodiscard]] bool usable() const noexcept { return broken_.empty(); }
  /// The buffers stuck threads may still use; empty while the engine is usable.
  [[nodiscard]] std::vector<std::span<std::byte>> held() const { return held_; }

  /// Throws the io_error that broke the engine, if it is broken.
  void throw_if_broken() const
  {
    if (broken_.empty()) { return; }
    throw io_error(ETIMEDOUT, broken_path_, broken_op_, broken_at_.offset, broken_at_.length, broken_);
  }

  void submit(std::span<request const> requests)
  {
    throw_if_broken();
    std::vector<detail::piece> pieces = detail::cut(requests, opts_.block_size);
    if (pieces.empty()) { return; }
    auto& s = *shared_;
    std::unique_lock lock(s.m);
    s.requests.assign(requests.begin(), requests.end());
    s.pieces  = std::move(pieces);
    s.next    = 0;
    s.running = 0;
    s.failed  = false;
    s.failure = {};
    s.work.notify_all();
    worker* hung = nullptr;
    for (;;) {
      bool const out_of_work = s.failed || s.next >= s.pieces.size();
      if (out_of_work && s.running == 0) { break; }
      auto deadline = clock::time_point::max();
      for (auto const& w : s.workers) {
        if (w->busy) { deadline = std::min(deadline, w->deadline); }
      }
      if (deadline == clock::time_point::max()) {
        // No piece taken yet (a worker tells only when it finishes one): look again within
        // a timeout, by when any piece taken meanwhile has not yet timed out.
        if (opts_.timeout.count() == 0) {
          s.done.wait(lock);
        } else {
          s.done.wait_for(lock, opts_.timeout);
        }
        continue;
      }
      s.done.wait_until(lock, deadline);
      auto const now = clock::now();
      for (auto const& w : s.workers) {
        if (w->busy && w->deadline <= now) { hung = w.get(); }
      }
      if (hung != nullptr) { break; }
    }
    if (hung == nullptr) {
      detail::first_failure const f = s.failure;
      s.requests.clear();
      lock.unlock();
      f.rethrow(requests);
      return;
    }

    // A piece that will not return: no new work; the others get a grace, then are given up on.
    s.failed = true;
    s.done.wait_until(lock, clock::now() + cancel_grace(opts_), [&] {
      return std::none_of(s.workers.begin(), s.workers.end(),
                          [&](auto const& w) { return w->busy && w.get() != hung; });
    });
    auto const& r = requests[hung->piece.request];
    broken_at_    = hung->piece;
    broken_path_  = detail::path_of(r);
    broken_op_    = r.write ? "write" : "read";
    broken_       = std::string("this engine is unusable: this ")
                .append(broken_op_)
                .append(" got no answer within ")
                .append(detail::describe_timeout(opts_.timeout))
                .append(" (engine_options::timeout), and a pread or pwrite cannot be cancelled: its thread may "
                        "still use the buffer (held()); make a new engine");
    for (std::size_t i = 0; i < s.workers.size(); ++i) {
      auto& w = *s.workers[i];
      if (!w.busy) { continue; }
      // Dekker with the worker's in_call: either it sees `abandoned` before its next call and
      // makes none, or this sees it inside one and keeps the buffer.
      w.abandoned.store(true);
      if (w.in_call.load()) { held_.emplace_back(w.piece.data, w.piece.length); }
      threads_[i].detach();
    }
    lock.unlock();
    throw io_error(ETIMEDOUT, broken_path_, broken_op_, broken_at_.offset, broken_at_.length,
                   std::string("no answer within ")
                     .append(detail::describe_timeout(opts_.timeout))
                     .append(" (engine_options::timeout), and a pread or pwrite cannot be cancelled: its thread "
                             "may still ")
                     .append(r.write ? "read this write's" : "write into this read's")
                     .append(" buffer, so this engine keeps it (held()) and is unusable; make a new one"));
  }

 private:
  using clock = std::chrono::steady_clock;

  /// One thread's piece. Guarded by state::m, but for the two flags.
  struct worker {
    bool busy = false;
    detail::piece piece{};  ///< its piece; on failure, the part that failed
    clock::time_point deadline = clock::time_point::max();
    std::atomic<bool> in_call{false};    ///< inside pread, pwrite or a planted hang's read
    std::atomic<bool> abandoned{false};  ///< the engine gave up on it: make no further call
  };
  /// Shared with the threads, which keep it alive: a stuck one may outlive the engine.
  struct state {
    std::mutex m;
    std::condition_variable work, done;
    bool stop = false;
    std::vector<request> requests;  ///< the batch's (their paths are not read by the threads)
    std::vector<detail::piece> pieces;
    std::size_t next    = 0;
    std::size_t running = 0;
    bool failed         = false;
    detail::first_failure failure;
    std::vector<std::unique_ptr<worker>> workers;
    std::shared_ptr<fault_plan> faults;
    std::chrono::milliseconds timeout{0};
  };

  void stop() noexcept
  {
    {
      std::scoped_lock lock(shared_->m);
      shared_->stop = true;
    }
    shared_->work.notify_all();
    for (auto& t : threads_) {
      if (t.joinable()) { t.join(); }
    }
  }

  static void run(state& s, worker& me)
  {
    std::unique_lock lock(s.m);
    for (;;) {
      s.work.wait(lock, [&] { return s.stop || (!s.failed && s.next < s.pieces.size()); });
      if (s.stop) { return; }
      detail::piece p     = s.pieces[s.next++];
      request const r     = s.requests[p.request];
      auto const timeout  = s.timeout;
      me.busy     = true;
      me.piece    = p;
      me.deadline = timeout.count() > 0 ? clock::now() + timeout : clock::time_point::max();
      ++s.running;
      lock.unlock();
      int const err = transfer(s, me, r, p);
      lock.lock();
      if (me.abandoned.load()) { return; }  // given up on: the engine has moved on without it
      me.busy = false;
      --s.running;
      if (err != 0) {
        s.failure.note(err, p);
        s.failed = true;
      }
      s.done.notify_all();
    }
  }

  /// One piece, short transfers continued; 0, or an errno with `p` left as the part that failed.
  static int transfer(state& s, worker& me, request const& r, detail::piece& p)
  {
    while (p.length > 0) {
      if (me.abandoned.load()) { return ECANCELED; }
      fault_plan::decision d = fault_plan::decision::as_is(p.length);
      if (s.faults) {
        d = s.faults->next(r.write ? op::write : op::read, p.length);
        if (d.error != 0) { return d.error; }
      }
      me.in_call.store(true);
      if (me.abandoned.load()) {
        me.in_call.store(false);
        return ECANCELED;
      }
      ssize_t const got = d.hang_fd >= 0 ? ::read(d.hang_fd, p.data, d.length)
                          : r.write      ? ::pwrite(r.fd, p.data, d.length, static_cast<off_t>(p.offset))
                                         : ::pread(r.fd, p.data, d.length, static_cast<off_t>(p.offset));
      int const err = got < 0 ? errno : 0;
      me.in_call.store(false);
      if (got < 0) {
        if (err == EINTR || err == EAGAIN) { continue; }
        return err;
      }
      if (got == 0) { return detail::no_progress_error(r.write); }
      auto const k = static_cast<std::size_t>(got);
      p.offset += k;
      p.data += k;
      p.length -= k;
    }
    return 0;
  }

  engine_options opts_;
  std::shared_ptr<state> shared_;
  std::vector<std::thread> threads_;
  std::string broken_;  ///< why the engine is unusable, or empty
  std::string broken_path_;
  char const* broken_op_ = "";
  detail::piece broken_at_{};
  std::vector<std::span<std::byte>> held_;
};

}  // namespace tierstate::io
