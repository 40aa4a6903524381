// SPDX-License-Identifier: Apache-2.0
// The io_uring backend (see io/engine.hpp for the contract). Each of `rings` rings keeps
// up to queue_depth pieces in flight. Two ways in:
//   submit()    a batch, run to completion; with several rings each is driven by its own
//               thread, the pieces dealt out round-robin;
//   start() / progress() / active()
//               streaming: requests are started one at a time and finish one at a time, as
//               their last piece completes, while the rings stay full (the pipelined
//               transfer's I/O thread lives here, so the disk never idles between chunks).
// Inside the rings results are -errno values; a failure leaves as an io_error, from submit()
// after every ring has drained, or handed to progress()'s callback for its request.
// Streaming and submit() are not mixed: submit() needs active() == 0.
//
// When a ring itself fails while streaming (io_uring_submit, or the wait for a completion,
// returns an error other than EINTR, EAGAIN or EBUSY), progress() drains every ring (pieces
// already prepared are submitted, every piece in the kernel's hands is waited for and its
// result dropped), fails every active request through its callback with an io_error naming
// that call and its errno, and resets the streaming state: active() is 0 and the engine goes
// on. A ring that cannot even be drained leaves the engine broken: from then on start() and
// submit() throw an io_error saying so, instead of waiting for what will never come.
#pragma once

#include <tierstate/core/thread_pool.hpp>
#include <tierstate/io/detail/pieces.hpp>
#include <tierstate/io/request.hpp>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <liburing.h>
#include <sys/uio.h>

namespace tierstate::io {

class uring_engine {
 public:
  /// Throws tierstate::invalid_option for bad options, and io_error (operation
  /// "io_uring_queue_init") where io_uring is unavailable.
  explicit uring_engine(engine_options const& o = {})
    : opts_((o.validate(), o)), rings_(o.rings), pool_(o.rings)
  {
    for (unsigned i = 0; i < o.rings; ++i) {
      int const r = io_uring_queue_init(o.queue_depth, &rings_[i].ring, 0);
      if (r < 0) {
        for (unsigned j = 0; j < i; ++j) { io_uring_queue_exit(&rings_[j].ring); }
        throw io_error(-r, "an io_uring of " + std::to_string(o.queue_depth) + " entries",
                       "io_uring_queue_init", 0, 0,
                       std::string(r == -ENOSYS  ? "io_uring is not in this kernel"
                                   : r == -EPERM ? "io_uring is forbidden here, by a seccomp filter "
                                                   "or kernel.io_uring_disabled"
                                                 : "io_uring is unavailable") +
                         "; engine_options::backend = psync uses pread/pwrite instead");
      }
    }
  }
  ~uring_engine()
  {
    for (auto& r : rings_) { io_uring_queue_exit(&r.ring); }
  }
  uring_engine(uring_engine const&)            = delete;
  uring_engine& operator=(uring_engine const&) = delete;

  [[nodiscard]] engine_options const& options() const noexcept { return opts_; }

  /// Registers one region as fixed buffer 0 of every ring (replacing any earlier one).
  /// Returns 0 or the refusing errno (ENOMEM: over RLIMIT_MEMLOCK); on refusal nothing
  /// stays registered and transfers go on unregistered.
  int register_buffer(std::span<std::byte> region)
  {
    unregister();
    if (region.empty()) { return 0; }
    iovec const v{region.data(), region.size()};
    for (std::size_t i = 0; i < rings_.size(); ++i) {
      int const r = io_uring_register_buffers(&rings_[i].ring, &v, 1);
      if (r < 0) {
        for (std::size_t j = 0; j < i; ++j) { io_uring_unregister_buffers(&rings_[j].ring); }
        return -r;
      }
    }
    registered_ = region;
    return 0;
  }
  [[nodiscard]] std::span<std::byte> registered() const noexcept { return registered_; }

  void submit(std::span<request const> requests)
  {
    TIERSTATE_EXPECTS(active_ == 0, "uring_engine::submit: streamed requests are still active");
    throw_if_broken();
    std::vector<detail::piece> const pieces = detail::cut(requests, opts_.block_size);
    if (pieces.empty()) { return; }
    std::mutex m;
    detail::first_failure failure;
    ring_failure stuck;
    std::size_t const used = std::min<std::size_t>(rings_.size(), pieces.size());
    pool_.parallel_for(used, 1, [&](std::size_t b, std::size_t e) {
      for (std::size_t i = b; i < e; ++i) {
        std::deque<detail::piece> todo;
        for (std::size_t p = i; p < pieces.size(); p += used) { todo.push_back(pieces[p]); }
        ring_failure s;
        detail::first_failure f = drive(rings_[i], requests, std::move(todo), s);
        if (f.error != 0 || s.error != 0) {
          std::scoped_lock lock(m);
          if (f.error != 0) { failure.note(f.error, f.where); }
          if (s.error != 0 && stuck.error == 0) { stuck = s; }
        }
      }
    });
    if (stuck.error != 0) { broken_ = stuck; }
    failure.rethrow(requests);
  }

  // --- streaming ----------------------------------------------------------------------

  /// Queues `r` under `tag`; it is submitted by the next progress(). Throws io_error once a
  /// ring failure has left the engine broken (see the file comment).
  void start(request const& r, std::uint64_t tag)
  {
    throw_if_broken();
    std::size_t index;
    if (free_requests_.empty()) {
      index = requests_.size();
      requests_.emplace_back();
    } else {
      index = free_requests_.back();
      free_requests_.pop_back();
    }
    auto& s      = requests_[index];
    s            = {r, tag, 0, {}};
    request const one[] = {r};
    for (auto p : detail::cut(one, opts_.block_size)) {
      p.request = index;
      waiting_.push_back(p);
      ++s.pieces_left;
    }
    ++active_;
    if (s.pieces_left == 0) { finished_now_.push_back(index); }
  }

  /// Started requests that have not finished.
  [[nodiscard]] std::size_t active() const noexcept { return active_; }

  /// Fills the rings, then handles every completion there is, waiting for at least one when
  /// `wait` is set and a piece is in the kernel's hands. Calls done(tag, error) once per
  /// request as it finishes: error is null, or an io_error (its first failed piece) as an
  /// exception_ptr. When a ring itself fails, every active request finishes, with an io_error
  /// naming the ring call that failed (unless it had failed on its own before), and the
  /// streaming state is reset (see the file comment). Throws only what `done` throws.
  template <class Done>
  void progress(bool wait, Done&& done)
  {
    ring_failure f = fill();
    if (f.error == 0) {
      bool const any = reap_all(done, f);
      if (f.error == 0 && !any && wait) {
        f = wait_for_completion();
        if (f.error == 0) { reap_all(done, f); }
      }
    }
    if (f.error != 0) {
      fail_streaming(f, done);
      return;
    }
    for (std::size_t const index : finished_now_) { finish(index, done); }
    finished_now_.clear();
  }

  // --- a test hook ----------------------------------------------------------------------

  /// The ring calls fail_ring() can make fail: io_uring_submit, and the wait for a completion.
  enum class ring_call : std::uint8_t { submit, wait };
  /// fail_ring's `times` for a ring that has died: every call from then on fails.
  static constexpr unsigned forever = ~0u;

  /// For tests, the ring-level counterpart of io::fault_plan (which fails pieces): the next
  /// `times` calls of `call` (streamed or batched), on any ring, return -`error` without entering the
  /// kernel, as the calls of a failing ring do (what they would have submitted stays queued
  /// in the ring). fail_ring(call, 0, 0) plants nothing. May be called from any thread.
  void fail_ring(ring_call call, int error, unsigned times = 1) noexcept
  {
    auto& p = planted_[static_cast<std::size_t>(call)];
    p.error.store(error, std::memory_order_relaxed);
    p.times.store(error != 0 ? times : 0, std::memory_order_release);
  }

 private:
  /// A ring call that failed: its errno and name, or error 0.
  struct ring_failure {
    int error             = 0;
    char const* operation = "";
  };
  struct planted_failure {
    std::atomic<int> error{0};
    std::atomic<unsigned> times{0};
  };

  struct ring_holder {
    io_uring ring{};
    std::vector<detail::piece> slots;  ///< streaming: the piece in each slot
    std::vector<unsigned> free;        ///< streaming: free slots
    unsigned in_flight = 0;
  };
  struct stream_request {
    request r;
    std::uint64_t tag       = 0;
    std::size_t pieces_left = 0;
    detail::first_failure failure;
  };

  /// Pieces of `h` the kernel has taken (the rest are prepared but not yet submitted).
  [[nodiscard]] static unsigned in_kernel(ring_holder& h) noexcept
  {
    return h.in_flight - io_uring_sq_ready(&h.ring);
  }

  /// The errno fail_ring() planted for this call, or 0.
  int planted(ring_call call) noexcept
  {
    auto& p    = planted_[static_cast<std::size_t>(call)];
    unsigned t = p.times.load(std::memory_order_acquire);
    while (t != 0) {
      if (t == forever || p.times.compare_exchange_weak(t, t - 1, std::memory_order_acq_rel)) {
        return p.error.load(std::memory_order_relaxed);
      }
    }
    return 0;
  }

  /// io_uring_submit, retried on EINTR.
  int submit_ring(io_uring& ring) noexcept
  {
    if (int const e = planted(ring_call::submit)) { return -e; }
    int r;
    do { r = io_uring_submit(&ring); } while (r == -EINTR);
    return r;
  }

  /// Waits for a completion of `ring` (for at most `ts`, when given), retried on EINTR.
  int wait_ring(io_uring& ring, __kernel_timespec* ts) noexcept
  {
    if (int const e = planted(ring_call::wait)) { return -e; }
    io_uring_cqe* cqe = nullptr;
    int r;
    do {
      r = ts != nullptr ? io_uring_wait_cqe_timeout(&ring, &cqe, ts) : io_uring_wait_cqe(&ring, &cqe);
    } while (r == -EINTR);
    return r;
  }

  /// Waits until some ring has a completion; does nothing when no piece is in the kernel's
  /// hands (pieces only prepared are submitted by the next fill()).
  ring_failure wait_for_completion() noexcept
  {
    std::size_t waiting_rings = 0;
    for (auto& h : rings_) { waiting_rings += in_kernel(h) > 0 ? 1 : 0; }
    if (waiting_rings == 0) { return {}; }
    if (waiting_rings == 1) {
      for (auto& h : rings_) {
        if (in_kernel(h) == 0) { continue; }
        int const r = wait_ring(h.ring, nullptr);
        if (r < 0 && r != -EAGAIN) { return {-r, "io_uring_wait_cqe"}; }
        return {};
      }
    }
    // Several rings and one thread: wait on each in turn, briefly.
    __kernel_timespec ts{0, 100'000};
    for (std::size_t i = 0;; i = (i + 1) % rings_.size()) {
      if (in_kernel(rings_[i]) == 0) { continue; }
      int const r = wait_ring(rings_[i].ring, &ts);
      if (r == 0) { return {}; }
      if (r != -ETIME && r != -EAGAIN) { return {-r, "io_uring_wait_cqe_timeout"}; }
    }
  }

  /// Moves waiting pieces into the rings (round-robin) and submits them.
  ring_failure fill()
  {
    for (auto& h : rings_) {
      if (h.slots.empty()) {
        h.slots.resize(opts_.queue_depth);
        for (unsigned s = opts_.queue_depth; s-- > 0;) { h.free.push_back(s); }
      }
    }
    bool placed = true;
    while (!waiting_.empty() && placed) {
      placed = false;
      for (auto& h : rings_) {
        if (waiting_.empty()) { break; }
        if (h.free.empty()) { continue; }
        detail::piece p = waiting_.front();
        auto& sr        = requests_[p.request];
        std::size_t n   = p.length;
        if (sr.failure.error == 0 && opts_.faults) {
          auto const d = opts_.faults->next(sr.r.write ? op::write : op::read, n);
          if (d.error != 0) { sr.failure.note(d.error, p); }
          n = d.length;
        }
        if (sr.failure.error != 0) {
          // The request has failed: its remaining pieces are not submitted.
          waiting_.pop_front();
          if (--sr.pieces_left == 0) { finished_now_.push_back(p.request); }
          placed = true;
          continue;
        }
        io_uring_sqe* sqe = io_uring_get_sqe(&h.ring);
        if (sqe == nullptr) { continue; }
        waiting_.pop_front();
        unsigned const s = h.free.back();
        h.free.pop_back();
        h.slots[s] = p;
        prep(sqe, sr.r, p, n);
        io_uring_sqe_set_data64(sqe, s);
        ++h.in_flight;
        placed = true;
      }
    }
    for (auto& h : rings_) {
      if (io_uring_sq_ready(&h.ring) == 0) { continue; }
      int const r = submit_ring(h.ring);
      if (r < 0 && r != -EAGAIN && r != -EBUSY) { return {-r, "io_uring_submit"}; }
    }
    return {};
  }

  /// Waits out every piece of `h`, submitting those only prepared and dropping every result,
  /// so that the kernel holds no buffer of the ring. Returns {} or, where the ring will not
  /// be drained, the call that failed.
  ring_failure drain(ring_holder& h) noexcept
  {
    unsigned soft = 0;  // EAGAIN and EBUSY in a row
    while (h.in_flight > 0) {
      io_uring_cqe* cqe = nullptr;
      for (;;) {
        int const p = io_uring_peek_cqe(&h.ring, &cqe);
        if (p == -ETIME) { continue; }  // liburing's own timeout, on kernels without EXT_ARG
        if (p != 0 || cqe == nullptr) { break; }
        io_uring_cqe_seen(&h.ring, cqe);
        --h.in_flight;
      }
      if (h.in_flight == 0) { break; }
      ring_failure f;
      int r = 0;
      if (io_uring_sq_ready(&h.ring) > 0) {
        f.operation = "io_uring_submit";
        r           = submit_ring(h.ring);
      }
      if (r >= 0 && in_kernel(h) > 0) {
        f.operation = "io_uring_wait_cqe";
        r           = wait_ring(h.ring, nullptr);
      }
      if (r >= 0) {
        soft = 0;
        continue;
      }
      if ((r == -EAGAIN || r == -EBUSY) && ++soft < 10'000) {
        std::this_thread::yield();
        continue;
      }
      f.error = -r;
      return f;
    }
    return {};
  }

  /// After the ring failure `f`: drains every ring, resets the streaming state and finishes
  /// every active request (see progress()).
  template <class Done>
  void fail_streaming(ring_failure const& f, Done& done)
  {
    ring_failure stuck;
    for (auto& h : rings_) {
      ring_failure const d = drain(h);
      if (d.error != 0 && stuck.error == 0) { stuck = d; }
    }
    std::vector<bool> idle(requests_.size(), false);
    for (std::size_t const index : free_requests_) { idle[index] = true; }
    std::vector<stream_request> failed;
    for (std::size_t i = 0; i < requests_.size(); ++i) {
      if (!idle[i]) { failed.push_back(std::move(requests_[i])); }
    }
    requests_.clear();
    free_requests_.clear();
    waiting_.clear();
    finished_now_.clear();
    active_ = 0;
    for (auto& h : rings_) {
      h.slots.clear();
      h.free.clear();
      h.in_flight = 0;
    }
    if (stuck.error != 0) { broken_ = stuck; }

    std::exception_ptr thrown;  // by `done`: rethrown once every request has been told
    for (auto& sr : failed) {
      std::exception_ptr error;
      try {
        if (sr.failure.error != 0) {
          request const one[] = {sr.r};
          detail::first_failure own = sr.failure;
          own.where.request         = 0;
          own.rethrow(one);
        } else if (sr.pieces_left != 0) {
          std::string hint("the io_uring failed with this ");
          hint.append(sr.r.write ? "write" : "read").append(" unfinished");
          if (stuck.error != 0) { hint.append("; the ring could not be drained, so the engine is unusable now"); }
          throw io_error(f.error, path_of(sr.r), f.operation, sr.r.offset, sr.r.length, hint);
        }
      } catch (...) {
        error = std::current_exception();
      }
      try {
        done(sr.tag, error);
      } catch (...) {
        if (!thrown) { thrown = std::current_exception(); }
      }
    }
    if (thrown) { std::rethrow_exception(thrown); }
  }

  [[nodiscard]] static std::string path_of(request const& r)
  {
    if (r.path != nullptr) { return *r.path; }
    return std::string("(fd ").append(std::to_string(r.fd)).append(")");
  }

  void throw_if_broken() const
  {
    if (broken_.error == 0) { return; }
    throw io_error(broken_.error, "the io_uring", broken_.operation, 0, 0,
                   "a ring failed while streaming and could not be drained: this engine can no "
                   "longer transfer; make a new one");
  }

  void prep(io_uring_sqe* sqe, request const& r, detail::piece const& p, std::size_t n) const noexcept
  {
    auto const len = static_cast<unsigned>(n);
    if (is_fixed(p)) {
      if (r.write) {
        io_uring_prep_write_fixed(sqe, r.fd, p.data, len, p.offset, 0);
      } else {
        io_uring_prep_read_fixed(sqe, r.fd, p.data, len, p.offset, 0);
      }
    } else if (r.write) {
      io_uring_prep_write(sqe, r.fd, p.data, len, p.offset);
    } else {
      io_uring_prep_read(sqe, r.fd, p.data, len, p.offset);
    }
  }

  /// Handles every completion waiting in every ring; returns whether there was one. A ring
  /// that fails sets `failure` and stops it.
  template <class Done>
  bool reap_all(Done& done, ring_failure& failure)
  {
    bool any = false;
    for (auto& h : rings_) {
      io_uring_cqe* cqe = nullptr;
      for (;;) {
        int const peeked = io_uring_peek_cqe(&h.ring, &cqe);
        if (peeked == -ETIME) { continue; }  // liburing's own timeout, on kernels without EXT_ARG
        if (peeked == -EAGAIN || peeked == -EINTR) { break; }
        if (peeked < 0) {
          failure = {-peeked, "io_uring_peek_cqe"};
          return any;
        }
        if (cqe == nullptr) { break; }
        any           = true;
        auto const s  = static_cast<unsigned>(io_uring_cqe_get_data64(cqe));
        int const res = cqe->res;
        io_uring_cqe_seen(&h.ring, cqe);
        --h.in_flight;
        detail::piece const p = h.slots[s];
        h.free.push_back(s);
        auto& sr = requests_[p.request];
        if (res < 0) {
          sr.failure.note(-res, p);
        } else if (res == 0) {
          sr.failure.note(detail::no_progress_error(sr.r.write), p);
        } else if (static_cast<std::size_t>(res) < p.length && sr.failure.error == 0) {
          auto const n = static_cast<std::size_t>(res);
          waiting_.push_front({p.request, p.offset + n, p.data + n, p.length - n});
          continue;  // the remainder stands in for this piece
        }
        if (--sr.pieces_left == 0) { finish(p.request, done); }
      }
    }
    return any;
  }

  template <class Done>
  void finish(std::size_t index, Done& done)
  {
    auto& sr = requests_[index];
    std::exception_ptr error;
    if (sr.failure.error != 0) {
      try {
        request const one[] = {sr.r};
        detail::first_failure f = sr.failure;
        f.where.request         = 0;
        f.rethrow(one);
      } catch (...) {
        error = std::current_exception();
      }
    }
    free_requests_.push_back(index);
    --active_;
    done(sr.tag, error);
  }

  void unregister() noexcept
  {
    if (registered_.empty()) { return; }
    for (auto& r : rings_) { io_uring_unregister_buffers(&r.ring); }
    registered_ = {};
  }

  [[nodiscard]] bool is_fixed(detail::piece const& p) const noexcept
  {
    return !registered_.empty() && p.data >= registered_.data() &&
           p.data + p.length <= registered_.data() + registered_.size();
  }

  /// Runs `todo` through one ring; returns its first failure (after draining). When the
  /// ring itself fails, the pieces prepared but not submitted are submitted and every piece
  /// waited out before returning (a later call must not submit them against buffers the
  /// caller has freed); `stuck` is the ring call that would not drain, if any.
  detail::first_failure drive(ring_holder& h, std::span<request const> requests,
                              std::deque<detail::piece> todo, ring_failure& stuck) noexcept
  {
    io_uring& ring = h.ring;
    std::vector<detail::piece> slots(opts_.queue_depth);
    std::vector<unsigned> free_slots;
    for (unsigned s = opts_.queue_depth; s-- > 0;) { free_slots.push_back(s); }
    unsigned& in_flight = h.in_flight;
    in_flight           = 0;
    detail::first_failure failure;

    while ((!todo.empty() && failure.error == 0) || in_flight > 0) {
      // Fill the ring (no new work once something failed).
      while (failure.error == 0 && !todo.empty() && !free_slots.empty()) {
        detail::piece p = todo.front();
        auto const& r   = requests[p.request];
        std::size_t n   = p.length;
        if (opts_.faults) {
          auto const d = opts_.faults->next(r.write ? op::write : op::read, n);
          if (d.error != 0) {
            todo.pop_front();
            failure.note(d.error, p);
            break;
          }
          n = d.length;
        }
        io_uring_sqe* sqe = io_uring_get_sqe(&ring);
        if (sqe == nullptr) { break; }
        todo.pop_front();
        unsigned const s = free_slots.back();
        free_slots.pop_back();
        slots[s] = p;
        prep(sqe, r, p, n);
        io_uring_sqe_set_data64(sqe, s);
        ++in_flight;
      }
      if (in_flight == 0) { continue; }
      int const planted_error = planted(ring_call::submit);
      int const w             = planted_error != 0 ? -planted_error : io_uring_submit_and_wait(&ring, 1);
      if (w < 0 && w != -EINTR && w != -EAGAIN && w != -EBUSY) {
        // The ring itself failed. Pieces may be in the kernel's hands and others only
        // prepared: drain submits those and waits for all (dropping their results), so no
        // buffer is left in the kernel's hands and nothing stale stays queued in the ring.
        failure.note(-w, slots[0]);
        stuck = drain(h);
        in_flight = 0;
        return failure;
      }
      io_uring_cqe* cqe = nullptr;
      while (io_uring_peek_cqe(&ring, &cqe) == 0 && cqe != nullptr) {
        auto const s  = static_cast<unsigned>(io_uring_cqe_get_data64(cqe));
        int const res = cqe->res;
        io_uring_cqe_seen(&ring, cqe);
        --in_flight;
        detail::piece const p = slots[s];
        free_slots.push_back(s);
        bool const write = requests[p.request].write;
        if (res < 0) {
          failure.note(-res, p);
        } else if (res == 0) {
          failure.note(detail::no_progress_error(write), p);
        } else if (static_cast<std::size_t>(res) < p.length) {
          // Short transfer: requeue the remainder, first.
          auto const n = static_cast<std::size_t>(res);
          todo.push_front({p.request, p.offset + n, p.data + n, p.length - n});
        }
      }
    }
    return failure;
  }

  engine_options opts_;
  std::vector<ring_holder> rings_;
  thread_pool pool_;
  std::span<std::byte> registered_;
  // Streaming.
  std::vector<stream_request> requests_;
  std::vector<std::size_t> free_requests_;
  std::deque<detail::piece> waiting_;
  std::vector<std::size_t> finished_now_;  ///< finished without a completion (empty, or failed early)
  std::size_t active_ = 0;
  ring_failure broken_;                    ///< the ring call that could not be drained, if any
  planted_failure planted_[2];             ///< fail_ring(), by ring_call
};

}  // namespace tierstate::io
