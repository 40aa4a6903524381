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
// When a ring itself fails (io_uring_submit, io_uring_submit_and_wait, or the wait for a
// completion, returns an error other than EINTR, EAGAIN or EBUSY), the pieces the kernel has
// not taken are withdrawn from the ring, never to be submitted (their requests are reported
// failed, so they must not run behind the caller's back), and every piece the kernel has
// taken is waited out and its result dropped. submit() then throws an io_error naming that
// call, its errno and the first unfinished piece; while streaming, every active request
// finishes through its callback with such an error, and the streaming state is reset. The
// engine goes on. A ring that cannot even be waited on leaves the engine broken (below).
//
// Timeouts (engine_options::timeout, see io/engine.hpp): a piece the kernel has held longer
// than the timeout is cancelled (IORING_OP_ASYNC_CANCEL). Its completion then arrives
// (-ECANCELED, or its result if it finished meanwhile) and its request fails with
// ETIMEDOUT; the engine goes on. If no completion arrives within cancel_grace() of the
// cancellation, the kernel may still write into the piece's buffer (or read from it) at any
// later time: the engine gives up on every piece in flight (cancelled too, and waited for as
// long), fails every request, and is broken.
//
// A broken engine never touches a ring again, except to close it when destroyed: start(),
// submit() and register_buffer() throw an io_error that names what broke it. held() lists
// the buffers of the pieces it gave up on: the kernel may use them until it answers, which
// may be never, and even after the engine is destroyed. Their owners must neither free nor
// reuse them (leak them); the engine keeps what it owns of them (a planted hang's pipe).
#pragma once

#include <tierstate/core/thread_pool.hpp>
#include <tierstate/io/detail/pieces.hpp>
#include <tierstate/io/request.hpp>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <liburing.h>
#include <poll.h>
#include <sys/uio.h>

namespace tierstate::inline TIERSTATE_ABI::io {

class uring_engine {
 public:
  /// Throws tierstate::invalid_option for bad options, and io_error (operation
  /// "io_uring_queue_init") where io_uring is unavailable.
  explicit uring_engine(engine_options const& o = {})
    : opts_((o.validate(), o)), grace_(cancel_grace(o)), rings_(o.rings), pool_(o.rings)
  {
    for (unsigned i = 0; i < o.rings; ++i) {
      // Twice the depth: room for a cancellation beside every piece in flight.
      int const r = io_uring_queue_init(2 * o.queue_depth, &rings_[i].ring, 0);
      if (r < 0) {
        for (unsigned j = 0; j < i; ++j) { io_uring_queue_exit(&rings_[j].ring); }
        throw io_error(-r, "an io_uring of " + std::to_string(2 * o.queue_depth) + " entries",
                       "io_uring_queue_init", 0, 0,
                       std::string(r == -ENOSYS  ? "io_uring is not in this kernel"
                                   : r == -EPERM ? "io_uring is forbidden here, by a seccomp filter "
                                                   "or kernel.io_uring_disabled"
                                                 : "io_uring is unavailable") +
                         "; engine_options::backend = psync uses pread/pwrite instead");
      }
      auto& h = rings_[i];
      h.slots.resize(o.queue_depth);
      for (unsigned s = o.queue_depth; s-- > 0;) { h.free.push_back(s); }
    }
  }
  /// Closes the rings. Whatever the kernel still holds (see held()) it cancels or finishes on
  /// its own, with its own references to the files and pages.
  ~uring_engine()
  {
    for (auto& r : rings_) { io_uring_queue_exit(&r.ring); }
  }
  uring_engine(uring_engine const&)            = delete;
  uring_engine& operator=(uring_engine const&) = delete;

  [[nodiscard]] engine_options const& options() const noexcept { return opts_; }

  /// Registers one region as fixed buffer 0 of every ring (replacing any earlier one).
  /// Returns 0 or the refusing errno (ENOMEM: over RLIMIT_MEMLOCK); on refusal nothing
  /// stays registered and transfers go on unregistered. Throws io_error on a broken engine
  /// (unregistering would wait for the I/O it gave up on).
  int register_buffer(std::span<std::byte> region)
  {
    throw_if_broken();
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

  /// Whether the engine can still transfer (see the file comment).
  [[nodiscard]] bool usable() const noexcept { return broken_.error == 0; }
  /// The buffers of the I/O a broken engine gave up on: the kernel may still use them, now
  /// or after the engine is gone. Empty while the engine is usable.
  [[nodiscard]] std::vector<std::span<std::byte>> held() const
  {
    std::vector<std::span<std::byte>> out;
    for (auto const& h : held_) { out.push_back(h.bytes); }
    return out;
  }

  void submit(std::span<request const> requests)
  {
    TIERSTATE_EXPECTS(active_ == 0, "uring_engine::submit: streamed requests are still active");
    throw_if_broken();
    std::vector<detail::piece> const pieces = detail::cut(requests, opts_.block_size);
    if (pieces.empty()) { return; }
    std::mutex m;
    detail::first_failure failure;
    broken_state broke;
    std::vector<held_piece> gave_up;
    std::size_t const used = std::min<std::size_t>(rings_.size(), pieces.size());
    pool_.parallel_for(used, 1, [&](std::size_t b, std::size_t e) {
      for (std::size_t i = b; i < e; ++i) {
        std::deque<detail::piece> todo;
        for (std::size_t p = i; p < pieces.size(); p += used) { todo.push_back(pieces[p]); }
        ring_outcome out = drive(rings_[i], requests, std::move(todo));
        std::scoped_lock lock(m);
        if (out.broken.error != 0 && broke.error == 0) {
          broke = out.broken;
          // A broken engine says why, whatever else failed first.
          failure = out.failure;
        } else if (out.failure.error != 0) {
          failure.note(out.failure.error, out.failure.where, out.failure.operation, out.failure.hint);
        }
        for (auto& h : out.held) { gave_up.push_back(std::move(h)); }
      }
    });
    if (broke.error != 0) { broken_ = broke; }
    for (auto& h : gave_up) { held_.push_back(std::move(h)); }
    failure.rethrow(requests);
  }

  // --- streaming ----------------------------------------------------------------------

  /// Queues `r` under `tag`; it is submitted by the next progress(). Throws io_error once
  /// the engine is broken (see the file comment).
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
  /// `wait` is set and a piece is in the kernel's hands (never past the moment the next
  /// piece would time out). Calls done(tag, error) once per request as it finishes: error is
  /// null, or an io_error (its first failed piece) as an exception_ptr. When a ring itself
  /// fails, or the engine gives up on an I/O that will not answer, every active request
  /// finishes with an io_error saying so and the streaming state is reset (see the file
  /// comment). Throws only what `done` throws.
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
    if (f.error == 0) {
      auto const now = clock::now();
      for (auto& h : rings_) {
        f = expire(h, now, false, [&](slot_state const& st) {
          requests_[st.p.request].failure.note(ETIMEDOUT, st.p, nullptr, timed_out_hint());
        });
        if (f.error != 0) { break; }
      }
      // Once broken, the hung slots are the ones already given up on (held(), their requests
      // finished): nothing new is started, so there is nothing to give up on again.
      if (f.error == 0 && broken_.error == 0) {
        for (auto& h : rings_) {
          if (slot_state const* st = first_hung(h, now)) {
            give_up_streaming(*st, done);
            return;
          }
        }
      }
    }
    if (f.error != 0) {
      fail_streaming(f, done);
      return;
    }
    for (std::size_t const index : finished_now_) { finish(index, done); }
    finished_now_.clear();
  }

 private:
  using clock = std::chrono::steady_clock;
  static constexpr clock::time_point never = clock::time_point::max();
  /// user_data of a cancellation: this bit, and the slot of the piece it cancels.
  static constexpr std::uint64_t cancel_tag = std::uint64_t{1} << 63;
  /// A cancellation's target that matches no request (a planted uncancellable hang's).
  static constexpr std::uint64_t no_request = cancel_tag - 1;

  /// A ring call that failed: its errno and name, or error 0.
  struct ring_failure {
    int error             = 0;
    char const* operation = "";
  };
  /// What made the engine unusable, as later calls report it.
  struct broken_state {
    int error             = 0;
    std::string path;
    char const* operation = "";
    std::uint64_t offset  = 0;
    std::uint64_t length  = 0;
    std::string hint;
  };
  /// A buffer the kernel may still use, and what the engine keeps alive for it.
  struct held_piece {
    std::span<std::byte> bytes;
    std::shared_ptr<void const> hold;
  };

  struct slot_state {
    detail::piece p{};
    clock::time_point deadline = never;  ///< once taken: when it times out
    clock::time_point give_up  = never;  ///< once cancelled: when to stop waiting for it
    bool busy        = false;  ///< its piece is in the ring (prepared; taken or not)
    bool taken       = false;  ///< the kernel has taken it
    bool cancelled   = false;  ///< a cancellation was sent for it
    bool cancel_out  = false;  ///< that cancellation's own completion is still to come
    bool cancellable = true;   ///< false: a planted hang no cancellation reaches
    std::shared_ptr<void const> hold;  ///< a planted hang's pipe, kept while the kernel may read it
  };
  struct ring_holder {
    io_uring ring{};
    std::vector<slot_state> slots;      ///< queue_depth of them
    std::vector<unsigned> free;         ///< slots with no piece and no cancellation
    std::deque<std::uint64_t> untaken;  ///< user_data prepared and not yet taken, in ring order
    unsigned in_flight = 0;             ///< busy slots
    unsigned cancels   = 0;             ///< cancellations prepared and not completed
  };
  struct stream_request {
    request r;
    std::uint64_t tag       = 0;
    std::size_t pieces_left = 0;
    detail::first_failure failure;
  };
  /// What one ring's part of a batch ended with.
  struct ring_outcome {
    detail::first_failure failure;
    broken_state broken;             ///< error != 0: the engine is broken
    std::vector<held_piece> held;
  };

  // --- messages ---------------------------------------------------------------------------

  // Built by appending: GCC 12 warns falsely (-Wrestrict) on "literal" + string.
  [[nodiscard]] std::string timed_out_hint() const
  {
    return std::string("no answer within ")
      .append(detail::describe_timeout(opts_.timeout))
      .append(" (engine_options::timeout); cancelled");
  }
  [[nodiscard]] std::string hung_hint(bool write) const
  {
    return std::string("no answer within ")
      .append(detail::describe_timeout(opts_.timeout))
      .append(" (engine_options::timeout), and its cancellation was not confirmed: the kernel may still ")
      .append(write ? "read this write's" : "write into this read's")
      .append(" buffer, so this engine keeps it (held()) and is unusable; make a new one");
  }
  [[nodiscard]] broken_state hung_state(request const& r, detail::piece const& p) const
  {
    return {ETIMEDOUT, detail::path_of(r), r.write ? "write" : "read", p.offset, p.length,
            std::string("this engine is unusable: this ")
              .append(r.write ? "write" : "read")
              .append(" got no answer within ")
              .append(detail::describe_timeout(opts_.timeout))
              .append(" (engine_options::timeout) and its cancellation was not confirmed, so the kernel may "
                      "still use its buffer (held()); make a new engine")};
  }
  [[nodiscard]] static broken_state stuck_state(ring_failure const& f)
  {
    return {f.error, "the io_uring", f.operation, 0, 0,
            "a ring failed and could not be drained: the kernel may still use the buffers of its unfinished "
            "I/O (held()); this engine can no longer transfer; make a new one"};
  }

  void throw_if_broken() const
  {
    if (broken_.error == 0) { return; }
    throw io_error(broken_.error, broken_.path, broken_.operation, broken_.offset, broken_.length, broken_.hint);
  }

  // --- one ring -------------------------------------------------------------------------

  /// The errno the fault plan planted for this ring call (fault_plan::fail_ring), or 0.
  int planted(ring_call call) noexcept { return opts_.faults ? opts_.faults->ring_failure(call) : 0; }

  /// What of `h` the kernel has taken: pieces and cancellations.
  [[nodiscard]] static unsigned in_kernel(ring_holder& h) noexcept
  {
    return h.in_flight + h.cancels - io_uring_sq_ready(&h.ring);
  }

  /// After a call into the kernel: the entries it took are taken, and their clocks start.
  void mark_taken(ring_holder& h)
  {
    std::size_t const left = io_uring_sq_ready(&h.ring);
    auto const now         = clock::now();
    while (h.untaken.size() > left) {
      std::uint64_t const ud = h.untaken.front();
      h.untaken.pop_front();
      if ((ud & cancel_tag) != 0) { continue; }
      auto& st = h.slots[ud];
      st.taken = true;
      if (opts_.timeout.count() > 0) { st.deadline = now + opts_.timeout; }
    }
  }

  /// The soonest moment something in `h` must be looked at: a piece's timeout, or the end of
  /// a cancellation's grace. `never` when nothing is timed.
  [[nodiscard]] static clock::time_point next_deadline(ring_holder const& h) noexcept
  {
    clock::time_point t = never;
    for (auto const& st : h.slots) {
      if (st.cancelled && (st.busy || st.cancel_out)) {
        t = std::min(t, st.give_up);
      } else if (st.busy && st.taken) {
        t = std::min(t, st.deadline);
      }
    }
    return t;
  }

  /// A piece of `h` whose cancellation went unconfirmed past its grace, or null.
  [[nodiscard]] static slot_state const* first_hung(ring_holder const& h, clock::time_point now) noexcept
  {
    for (auto const& st : h.slots) {
      if (st.busy && st.cancelled && st.give_up <= now) { return &st; }
    }
    return nullptr;
  }

  /// Prepares piece `p` of request `r` in a free slot, as the fault plan's decision `d` says
  /// (a hang reads from the plan's pipe instead). Returns false when no slot or entry is free.
  bool prep_piece(ring_holder& h, request const& r, detail::piece const& p, fault_plan::decision&& d)
  {
    if (h.free.empty()) { return false; }
    io_uring_sqe* sqe = io_uring_get_sqe(&h.ring);
    if (sqe == nullptr) { return false; }
    unsigned const s = h.free.back();
    h.free.pop_back();
    auto& st       = h.slots[s];
    st             = {};
    st.p           = p;
    st.busy        = true;
    st.cancellable = d.cancellable;
    st.hold        = std::move(d.hold);
    if (d.hang_fd >= 0) {
      io_uring_prep_read(sqe, d.hang_fd, p.data, static_cast<unsigned>(d.length), 0);
    } else {
      prep(sqe, r, p, d.length);
    }
    io_uring_sqe_set_data64(sqe, s);
    ++h.in_flight;
    h.untaken.push_back(s);
    return true;
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

  /// The fault plan's word on the next piece of `r` (nothing planted: its own length).
  fault_plan::decision decide(request const& r, detail::piece const& p)
  {
    if (!opts_.faults) { return fault_plan::decision::as_is(p.length); }
    return opts_.faults->next(r.write ? op::write : op::read, p.length);
  }

  /// Submits what `h` has prepared; EAGAIN and EBUSY leave it for the next call.
  ring_failure push(ring_holder& h)
  {
    if (io_uring_sq_ready(&h.ring) == 0) { return {}; }
    int r;
    if (int const e = planted(ring_call::submit)) {
      r = -e;
    } else {
      do { r = io_uring_submit(&h.ring); } while (r == -EINTR);
    }
    mark_taken(h);
    if (r < 0 && r != -EAGAIN && r != -EBUSY) { return {-r, "io_uring_submit"}; }
    return {};
  }

  /// Waits for a completion of `h` until `until` (`never`: as long as it takes). Returns 0
  /// (a completion may be there), -ETIME, or another -errno; `op` names the call.
  int wait_until(ring_holder& h, clock::time_point until, char const*& op)
  {
    op = until == never ? "io_uring_wait_cqe" : "io_uring_wait_cqe_timeout";
    if (int const e = planted(ring_call::wait)) { return -e; }
    io_uring_cqe* cqe = nullptr;
    int r;
    do {
      if (until == never) {
        r = io_uring_wait_cqe(&h.ring, &cqe);
        continue;
      }
      auto const left = until - clock::now();
      if (left <= clock::duration::zero()) { return -ETIME; }
      if ((h.ring.features & IORING_FEAT_EXT_ARG) == 0) {
        // Without EXT_ARG liburing would wait through a timeout entry of its own in the
        // ring; wait on the ring's descriptor instead, so the ring holds only ours.
        op          = "poll";
        pollfd pfd{h.ring.ring_fd, POLLIN, 0};
        auto const ms = std::chrono::ceil<std::chrono::milliseconds>(left).count();
        int const n   = ::poll(&pfd, 1, static_cast<int>(std::min<long long>(ms, 1'000'000)));
        r             = n > 0 ? 0 : n == 0 ? -ETIME : -errno;
        continue;
      }
      __kernel_timespec ts = to_timespec(left);
      r                    = io_uring_wait_cqe_timeout(&h.ring, &cqe, &ts);
    } while (r == -EINTR);
    mark_taken(h);
    return r;
  }

  /// Submits what `h` has prepared and waits for one completion, until `until`. Returns
  /// >= 0 (a completion may be there), -ETIME, or another -errno; `op` names the call.
  int submit_and_wait(ring_holder& h, clock::time_point until, char const*& op)
  {
    bool const timed = until != never && (h.ring.features & IORING_FEAT_EXT_ARG) != 0;
    op = timed ? "io_uring_submit_and_wait_timeout" : "io_uring_submit_and_wait";
    if (int const e = planted(ring_call::submit)) { return -e; }
    if (until != never && !timed) {
      // No EXT_ARG: submit, then wait on the descriptor (see wait_until).
      ring_failure const f = push(h);
      if (f.error != 0) {
        op = f.operation;
        return -f.error;
      }
      return wait_until(h, until, op);
    }
    int r;
    if (timed) {
      auto const left = until - clock::now();
      __kernel_timespec ts = to_timespec(std::max(left, clock::duration::zero()));
      io_uring_cqe* cqe    = nullptr;
      r                    = io_uring_submit_and_wait_timeout(&h.ring, &cqe, 1, &ts, nullptr);
    } else {
      r = io_uring_submit_and_wait(&h.ring, 1);
    }
    mark_taken(h);
    return r;
  }

  [[nodiscard]] static __kernel_timespec to_timespec(clock::duration d) noexcept
  {
    auto const ns = std::chrono::duration_cast<std::chrono::nanoseconds>(d).count();
    return {static_cast<long long>(ns / 1'000'000'000), static_cast<long long>(ns % 1'000'000'000)};
  }

  /// Frees slot `s` once neither its piece nor its cancellation is in the ring.
  static void release_slot(ring_holder& h, unsigned s)
  {
    auto& st = h.slots[s];
    if (st.busy || st.cancel_out) { return; }
    st = {};
    h.free.push_back(s);
  }

  /// Handles every completion waiting in `h`: on_piece(state, res) for each piece (its slot
  /// already freed); cancellations are counted off. Returns how many there were; a failing
  /// ring sets `failure`.
  template <class OnPiece>
  unsigned reap(ring_holder& h, OnPiece&& on_piece, ring_failure& failure)
  {
    unsigned n = 0;
    for (;;) {
      io_uring_cqe* cqe = nullptr;
      int const peeked  = io_uring_peek_cqe(&h.ring, &cqe);
      if (peeked == -ETIME) { continue; }  // liburing's own timeout, on kernels without EXT_ARG
      if (peeked == -EAGAIN || peeked == -EINTR) { break; }
      if (peeked < 0) {
        failure = {-peeked, "io_uring_peek_cqe"};
        break;
      }
      if (cqe == nullptr) { break; }
      ++n;
      std::uint64_t const ud = io_uring_cqe_get_data64(cqe);
      int const res          = cqe->res;
      io_uring_cqe_seen(&h.ring, cqe);
      if ((ud & cancel_tag) != 0) {
        auto const s = static_cast<unsigned>(ud & ~cancel_tag);
        --h.cancels;
        h.slots[s].cancel_out = false;
        release_slot(h, s);
        continue;
      }
      auto const s = static_cast<unsigned>(ud);
      slot_state st = std::move(h.slots[s]);
      h.slots[s].busy       = false;
      h.slots[s].cancel_out = st.cancel_out;
      --h.in_flight;
      release_slot(h, s);
      on_piece(st, res);
    }
    return n;
  }

  /// Cancels every piece of `h` past its timeout (every piece the kernel holds, with
  /// `everything`), calling on_timeout(state) for each, and submits the cancellations.
  template <class OnTimeout>
  ring_failure expire(ring_holder& h, clock::time_point now, bool everything, OnTimeout&& on_timeout)
  {
    if (opts_.timeout.count() == 0 && !everything) { return {}; }
    bool any = false;
    for (unsigned s = 0; s < h.slots.size(); ++s) {
      auto& st = h.slots[s];
      if (!st.busy || !st.taken || st.cancelled || (!everything && st.deadline > now)) { continue; }
      st.cancelled = true;
      st.give_up   = now + grace_;
      on_timeout(st);
      io_uring_sqe* sqe = io_uring_get_sqe(&h.ring);
      if (sqe == nullptr) {
        if (ring_failure const f = push(h); f.error != 0) { return f; }
        sqe = io_uring_get_sqe(&h.ring);
      }
      if (sqe == nullptr) {
        st.give_up = now;  // not even asked: not confirmed
        continue;
      }
      io_uring_prep_cancel64(sqe, st.cancellable ? s : no_request, 0);
      io_uring_sqe_set_data64(sqe, cancel_tag | s);
      st.cancel_out = true;
      ++h.cancels;
      h.untaken.push_back(cancel_tag | s);
      any = true;
    }
    return any ? push(h) : ring_failure{};
  }

  /// Withdraws from `h` every entry the kernel has not taken (after a ring failure: their
  /// requests are reported failed, so they must never run), calling on_dropped(state) for
  /// each piece. The ring is not SQPOLL, so the kernel reads its submission queue only inside
  /// io_uring_enter, on this thread: moving the queue's tail back to its head (liburing's
  /// sqe_head and sqe_tail with it) takes back exactly what it has not read.
  template <class OnDropped>
  static void retract(ring_holder& h, OnDropped&& on_dropped)
  {
    unsigned const left = io_uring_sq_ready(&h.ring);
    if (left == 0) { return; }
    unsigned const head = *h.ring.sq.khead;
    h.ring.sq.sqe_tail  = head;
    h.ring.sq.sqe_head  = head;
    __atomic_store_n(h.ring.sq.ktail, head, __ATOMIC_RELEASE);
    for (unsigned i = 0; i < left && !h.untaken.empty(); ++i) {
      std::uint64_t const ud = h.untaken.back();
      h.untaken.pop_back();
      if ((ud & cancel_tag) != 0) {
        auto const s = static_cast<unsigned>(ud & ~cancel_tag);
        --h.cancels;
        h.slots[s].cancel_out = false;
        h.slots[s].give_up    = clock::now();  // never asked: its piece is not confirmed
        release_slot(h, s);
        continue;
      }
      auto const s = static_cast<unsigned>(ud);
      slot_state st = std::move(h.slots[s]);
      h.slots[s].busy       = false;
      h.slots[s].cancel_out = st.cancel_out;
      --h.in_flight;
      release_slot(h, s);
      on_dropped(st);
    }
  }

  /// Settles `h` after a failure: withdraws what the kernel has not taken, then waits out
  /// what it has (cancelling each piece at its timeout, or at once with `cancel_all`), and
  /// dropping every result. Whatever does not come back, because its cancellation went
  /// unconfirmed or because the ring cannot be waited on, goes to `out.held`, and the
  /// engine is broken (`out.broken`, unless already set; describe(piece) names a piece
  /// given up on, as hung_state does).
  template <class Describe>
  void settle(ring_holder& h, ring_outcome& out, bool cancel_all, Describe&& describe)
  {
    auto ignore = [](slot_state const&, int = 0) {};
    retract(h, ignore);
    ring_failure stuck;
    for (;;) {
      stuck = push(h);  // cancellations left prepared by an EAGAIN
      if (stuck.error == 0) { reap(h, ignore, stuck); }
      if (stuck.error != 0 || (h.in_flight == 0 && h.cancels == 0)) { break; }
      auto const now = clock::now();
      stuck          = expire(h, now, cancel_all, ignore);
      if (stuck.error != 0) { break; }
      bool waiting = false;  // for something not yet given up on
      for (auto const& st : h.slots) {
        bool const in_ring = st.busy || st.cancel_out;
        waiting = waiting || (in_ring && !(st.cancelled && st.give_up <= now));
      }
      if (!waiting) { break; }
      char const* op = "";
      int const w    = wait_until(h, next_deadline(h), op);
      if (w < 0 && w != -ETIME && w != -EAGAIN && w != -EBUSY) {
        stuck = {-w, op};
        break;
      }
    }
    slot_state const* first = nullptr;
    for (auto& st : h.slots) {
      if (!st.busy) { continue; }
      if (first == nullptr) { first = &st; }
      out.held.push_back({{st.p.data, st.p.length}, st.hold});
    }
    if (out.broken.error == 0) {
      if (stuck.error != 0) {
        out.broken = stuck_state(stuck);
      } else if (first != nullptr) {
        out.broken = describe(first->p);
      } else if (h.cancels != 0) {
        out.broken = stuck_state({ETIMEDOUT, "IORING_OP_ASYNC_CANCEL"});  // a cancellation that never answered
      }
    }
  }

  // --- batches --------------------------------------------------------------------------

  /// Runs `todo` through one ring; returns its first failure, with every piece the kernel
  /// took completed, cancelled or given up on (see the file comment).
  ring_outcome drive(ring_holder& h, std::span<request const> requests, std::deque<detail::piece> todo)
  {
    ring_outcome out;
    auto& failure = out.failure;
    auto describe = [&](detail::piece const& p) { return hung_state(requests[p.request], p); };
    auto unfinished = [](request const& r) {
      return std::string("the io_uring failed with this ").append(r.write ? "write" : "read").append(" unfinished");
    };
    // A ring call failed: name the first piece it leaves unfinished, then settle.
    auto ring_failed = [&](int error, char const* op) {
      detail::piece first{};
      bool named = false;
      retract(h, [&](slot_state const& st) {
        first = st.p;  // withdrawn last to first: the last one seen is the first
        named = true;
      });
      for (auto const& st : h.slots) {
        if (!named && st.busy) {
          first = st.p;
          named = true;
        }
      }
      if (!named && !todo.empty()) { first = todo.front(); }
      failure.note(error, first, op, unfinished(requests[first.request]));
      settle(h, out, false, describe);
      return std::move(out);
    };

    for (;;) {
      // Fill the ring (no new work once something failed).
      while (failure.error == 0 && !todo.empty() && !h.free.empty()) {
        detail::piece const p = todo.front();
        auto const& r         = requests[p.request];
        fault_plan::decision d = decide(r, p);
        if (d.error != 0) {
          todo.pop_front();
          failure.note(d.error, p);
          break;
        }
        if (!prep_piece(h, r, p, std::move(d))) { break; }
        todo.pop_front();
      }
      if (h.in_flight == 0 && h.cancels == 0) { break; }

      // Wait no longer than the soonest timeout, counting what this call submits.
      clock::time_point until = next_deadline(h);
      if (opts_.timeout.count() > 0 && !h.untaken.empty()) { until = std::min(until, clock::now() + opts_.timeout); }
      char const* op = "";
      int const w    = submit_and_wait(h, until, op);
      if (w < 0 && w != -ETIME && w != -EINTR && w != -EAGAIN && w != -EBUSY) { return ring_failed(-w, op); }
      ring_failure rf;
      reap(h, [&](slot_state const& st, int res) {
        bool const write = requests[st.p.request].write;
        if (res < 0) {
          failure.note(-res, st.p);  // -ECANCELED after a timeout: its ETIMEDOUT came first
        } else if (res == 0) {
          failure.note(detail::no_progress_error(write), st.p);
        } else if (static_cast<std::size_t>(res) < st.p.length) {
          // Short transfer: requeue the remainder, first.
          auto const n = static_cast<std::size_t>(res);
          todo.push_front({st.p.request, st.p.offset + n, st.p.data + n, st.p.length - n});
        }
      }, rf);
      if (rf.error != 0) { return ring_failed(rf.error, rf.operation); }

      auto const now = clock::now();
      rf = expire(h, now, false, [&](slot_state const& st) {
        failure.note(ETIMEDOUT, st.p, nullptr, timed_out_hint());
      });
      if (rf.error != 0) { return ring_failed(rf.error, rf.operation); }
      if (slot_state const* st = first_hung(h, now)) {
        // Its cancellation went unconfirmed: give up on everything in flight.
        auto const& r = requests[st->p.request];
        out.broken    = hung_state(r, st->p);
        failure       = {};
        failure.note(ETIMEDOUT, st->p, nullptr, hung_hint(r.write));
        settle(h, out, true, describe);
        return out;
      }
    }
    return out;
  }

  // --- streaming ----------------------------------------------------------------------

  /// Moves waiting pieces into the rings (round-robin) and submits them.
  ring_failure fill()
  {
    bool placed = true;
    while (!waiting_.empty() && placed) {
      placed = false;
      for (auto& h : rings_) {
        if (waiting_.empty()) { break; }
        if (h.free.empty()) { continue; }
        detail::piece const p = waiting_.front();
        auto& sr              = requests_[p.request];
        fault_plan::decision d = fault_plan::decision::as_is(p.length);
        if (sr.failure.error == 0) {
          d = decide(sr.r, p);
          if (d.error != 0) { sr.failure.note(d.error, p); }
        }
        if (sr.failure.error != 0) {
          // The request has failed: its remaining pieces are not submitted.
          waiting_.pop_front();
          if (--sr.pieces_left == 0) { finished_now_.push_back(p.request); }
          placed = true;
          continue;
        }
        if (!prep_piece(h, sr.r, p, std::move(d))) { continue; }
        waiting_.pop_front();
        placed = true;
      }
    }
    for (auto& h : rings_) {
      if (ring_failure const f = push(h); f.error != 0) { return f; }
    }
    return {};
  }

  /// Waits until some ring has a completion, or the next piece's timeout (or grace) is
  /// due; does nothing when the kernel holds nothing (pieces only prepared are submitted by
  /// the next fill()).
  ring_failure wait_for_completion()
  {
    std::size_t waiting_rings = 0;
    clock::time_point until   = never;
    for (auto& h : rings_) {
      if (in_kernel(h) == 0) { continue; }
      ++waiting_rings;
      until = std::min(until, next_deadline(h));
    }
    if (waiting_rings == 0) { return {}; }
    char const* op = "";
    if (waiting_rings == 1) {
      for (auto& h : rings_) {
        if (in_kernel(h) == 0) { continue; }
        int const r = wait_until(h, until, op);
        if (r < 0 && r != -EAGAIN && r != -ETIME) { return {-r, op}; }
        return {};
      }
    }
    // Several rings and one thread: wait on each in turn, briefly, until the deadline.
    for (std::size_t i = 0;; i = (i + 1) % rings_.size()) {
      auto const now = clock::now();
      if (now >= until) { return {}; }
      if (in_kernel(rings_[i]) == 0) { continue; }
      int const r = wait_until(rings_[i], std::min(until, now + std::chrono::microseconds(100)), op);
      if (r >= 0) { return {}; }
      if (r != -ETIME && r != -EAGAIN) { return {-r, op}; }
    }
  }

  /// Handles every completion waiting in every ring; returns whether there was one. A ring
  /// that fails sets `failure` and stops it.
  template <class Done>
  bool reap_all(Done& done, ring_failure& failure)
  {
    bool any = false;
    for (auto& h : rings_) {
      unsigned const n = reap(h, [&](slot_state const& st, int res) {
        detail::piece const& p = st.p;
        auto& sr               = requests_[p.request];
        if (res < 0) {
          sr.failure.note(-res, p);  // -ECANCELED after a timeout: its ETIMEDOUT came first
        } else if (res == 0) {
          sr.failure.note(detail::no_progress_error(sr.r.write), p);
        } else if (static_cast<std::size_t>(res) < p.length && sr.failure.error == 0) {
          auto const k = static_cast<std::size_t>(res);
          waiting_.push_front({p.request, p.offset + k, p.data + k, p.length - k});
          return;  // the remainder stands in for this piece
        }
        if (--sr.pieces_left == 0) { finish(p.request, done); }
      }, failure);
      any = any || n > 0;
      if (failure.error != 0) { return any; }
    }
    return any;
  }

  template <class Done>
  void finish(std::size_t index, Done& done)
  {
    auto& sr = requests_[index];
    std::exception_ptr error;
    if (sr.failure.error != 0) { error = own_error(sr); }
    free_requests_.push_back(index);
    --active_;
    done(sr.tag, error);
  }

  /// A request's own first failure, as an io_error in an exception_ptr.
  [[nodiscard]] static std::exception_ptr own_error(stream_request const& sr)
  {
    request const one[] = {sr.r};
    detail::first_failure f = sr.failure;
    f.where.request         = 0;
    return std::make_exception_ptr(f.to_error(one));
  }

  /// Settles every ring, resets the streaming state and finishes every active request with
  /// error_for(request) (see progress()).
  template <class ErrorFor, class Done>
  void end_streaming(bool cancel_all, ErrorFor&& error_for, Done& done)
  {
    ring_outcome out;
    out.broken    = broken_;
    auto describe = [&](detail::piece const& p) { return hung_state(requests_[p.request].r, p); };
    for (auto& h : rings_) { settle(h, out, cancel_all, describe); }
    broken_ = out.broken;
    for (auto& h : out.held) { held_.push_back(std::move(h)); }

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

    std::exception_ptr thrown;  // by `done`: rethrown once every request has been told
    for (auto& sr : failed) {
      std::exception_ptr error;
      try {
        error = error_for(sr);
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

  /// After the ring failure `f`: see the file comment.
  template <class Done>
  void fail_streaming(ring_failure const& f, Done& done)
  {
    end_streaming(false, [&](stream_request const& sr) -> std::exception_ptr {
      if (sr.failure.error != 0) { return own_error(sr); }
      std::string hint("the io_uring failed with this ");
      hint.append(sr.r.write ? "write" : "read").append(" unfinished");
      if (broken_.error != 0) { hint.append("; the ring could not be drained, so the engine is unusable now"); }
      return std::make_exception_ptr(
        io_error(f.error, detail::path_of(sr.r), f.operation, sr.r.offset, sr.r.length, hint));
    }, done);
  }

  /// After the cancellation of `hung` went unconfirmed: gives up on everything in flight,
  /// breaks the engine and fails every active request.
  template <class Done>
  void give_up_streaming(slot_state const& hung, Done& done)
  {
    std::size_t const culprit = hung.p.request;
    detail::piece const where = hung.p;
    request const r           = requests_[culprit].r;
    broken_                   = hung_state(r, where);
    requests_[culprit].failure = {};
    requests_[culprit].failure.note(ETIMEDOUT, where, nullptr, hung_hint(r.write));
    std::string const abandoned = std::string("abandoned unfinished: another I/O of this engine got no answer within ")
                                    .append(detail::describe_timeout(opts_.timeout))
                                    .append(" and its cancellation was not confirmed; this engine is unusable");
    end_streaming(true, [&](stream_request const& sr) -> std::exception_ptr {
      if (sr.failure.error != 0) { return own_error(sr); }
      return std::make_exception_ptr(
        io_error(ETIMEDOUT, detail::path_of(sr.r), sr.r.write ? "write" : "read", sr.r.offset, sr.r.length, abandoned));
    }, done);
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

  engine_options opts_;
  std::chrono::milliseconds grace_;
  std::vector<ring_holder> rings_;
  thread_pool pool_;
  std::span<std::byte> registered_;
  // Streaming.
  std::vector<stream_request> requests_;
  std::vector<std::size_t> free_requests_;
  std::deque<detail::piece> waiting_;
  std::vector<std::size_t> finished_now_;  ///< finished without a completion (empty, or failed early)
  std::size_t active_ = 0;
  broken_state broken_;                    ///< what made the engine unusable, if anything
  std::vector<held_piece> held_;           ///< see held()
};

}  // namespace tierstate::io
