// SPDX-License-Identifier: Apache-2.0
// The io_uring backend's rings (see io/uring_engine.hpp): opening them, filling a ring's
// slots, submitting, waiting with a deadline and reaping completions. Cancelling at a
// piece's timeout, withdrawing what the kernel has not taken and settling a ring after a
// failure are in uring_cancel.hpp. The stream (uring_stream.hpp) drives them; the engine
// owns them, what broke it, and what it holds.
#pragma once

#include <tierstate/core/error.hpp>
#include <tierstate/io/detail/pieces.hpp>
#include <tierstate/io/detail/uring_state.hpp>
#include <tierstate/io/fault.hpp>
#include <tierstate/io/request.hpp>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <liburing.h>
#include <poll.h>
#include <sys/uio.h>

namespace tierstate::inline TIERSTATE_ABI::io::detail {

class uring_core {
  using clock = uring_clock;

 public:
  /// Throws tierstate::invalid_option for bad options, and io_error (operation
  /// "io_uring_queue_init") where io_uring is unavailable.
  explicit uring_core(engine_options const& o)
    : opts_((o.validate(), o)), grace_(cancel_grace(o)), rings_(o.rings)
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
  ~uring_core()
  {
    for (auto& r : rings_) { io_uring_queue_exit(&r.ring); }
  }
  uring_core(uring_core const&)            = delete;
  uring_core& operator=(uring_core const&) = delete;

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
  [[nodiscard]] bool usable() const noexcept { return damage_.broken.error == 0; }
  /// The buffers of the I/O a broken engine gave up on: the kernel may still use them, now
  /// or after the engine is gone. Empty while the engine is usable.
  [[nodiscard]] std::vector<std::span<std::byte>> held() const
  {
    std::vector<std::span<std::byte>> out;
    for (auto const& h : damage_.held) { out.push_back(h.bytes); }
    return out;
  }

  void throw_if_broken() const { damage_.throw_if_broken(); }

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
  /// the grace of a cancelled piece the kernel still holds; with `cancellations`, also the
  /// end of the grace of a cancellation whose piece has already answered (settle() stops
  /// waiting for it then; a stream has nothing to do at that moment, and waiting on a
  /// deadline already past would only spin). `never` when nothing is timed.
  [[nodiscard]] static clock::time_point next_deadline(ring_holder const& h, bool cancellations = false) noexcept
  {
    clock::time_point t = never;
    for (auto const& st : h.slots) {
      if (st.cancelled && (st.busy || (cancellations && st.cancel_out))) {
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

  /// Whether `h` has a free slot and a free submission entry: room for prep_piece().
  [[nodiscard]] static bool has_room(ring_holder& h) noexcept
  {
    return !h.free.empty() && io_uring_sq_space_left(&h.ring) > 0;
  }

  /// Prepares piece `p` of request `r` in a free slot, as the fault plan's decision `d` says
  /// (a hang reads from the plan's pipe instead). Needs has_room(h).
  void prep_piece(ring_holder& h, request const& r, piece const& p, fault_plan::decision&& d)
  {
    TIERSTATE_EXPECTS(has_room(h), "uring_core::prep_piece: no free slot or entry (has_room first)");
    io_uring_sqe* sqe = io_uring_get_sqe(&h.ring);
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
  }

  void prep(io_uring_sqe* sqe, request const& r, piece const& p, std::size_t n) const noexcept
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
  fault_plan::decision decide(request const& r, piece const& p)
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

  /// Slot `s`'s piece has left the ring (completed or withdrawn): its state, the slot freed
  /// unless its cancellation is still to come.
  static slot_state piece_left(ring_holder& h, unsigned s)
  {
    slot_state st         = std::move(h.slots[s]);
    h.slots[s].busy       = false;
    h.slots[s].cancel_out = st.cancel_out;
    --h.in_flight;
    release_slot(h, s);
    return st;
  }

  /// The cancellation of slot `s`'s piece has left the ring (completed or withdrawn).
  static void cancel_left(ring_holder& h, unsigned s)
  {
    --h.cancels;
    h.slots[s].cancel_out = false;
    release_slot(h, s);
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
        cancel_left(h, static_cast<unsigned>(ud & ~cancel_tag));
        continue;
      }
      on_piece(piece_left(h, static_cast<unsigned>(ud)), res);
    }
    return n;
  }

  void unregister() noexcept
  {
    if (registered_.empty()) { return; }
    for (auto& r : rings_) { io_uring_unregister_buffers(&r.ring); }
    registered_ = {};
  }

  [[nodiscard]] bool is_fixed(piece const& p) const noexcept
  {
    return !registered_.empty() && p.data >= registered_.data() &&
           p.data + p.length <= registered_.data() + registered_.size();
  }

  engine_options opts_;
  std::chrono::milliseconds grace_;
  std::vector<ring_holder> rings_;
  std::span<std::byte> registered_;
  ring_damage damage_;  ///< what made the engine unusable, if anything, and what it holds (held())
};

}  // namespace tierstate::io::detail
