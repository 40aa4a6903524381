// SPDX-License-Identifier: Apache-2.0
// The io_uring backend's cancellations (see io/uring_engine.hpp): cancelling a piece at its
// timeout, withdrawing what the kernel has not taken, and settling a ring after a failure.
#pragma once

#include <tierstate/io/detail/uring_core.hpp>
#include <tierstate/io/detail/uring_state.hpp>

#include <cerrno>
#include <cstdint>

#include <liburing.h>

namespace tierstate::inline TIERSTATE_ABI::io::detail {

/// Cancels every piece of `h` past its timeout (every piece the kernel holds, with
/// `everything`), calling on_timeout(state) for each, and submits the cancellations.
template <class OnTimeout>
ring_failure expire(uring_core& c, ring_holder& h, uring_clock::time_point now, bool everything, OnTimeout&& on_timeout)
{
  if (c.opts_.timeout.count() == 0 && !everything) { return {}; }
  bool any = false;
  for (unsigned s = 0; s < h.slots.size(); ++s) {
    auto& st = h.slots[s];
    if (!st.busy || !st.taken || st.cancelled || (!everything && st.deadline > now)) { continue; }
    st.cancelled = true;
    st.give_up   = now + c.grace_;
    on_timeout(st);
    io_uring_sqe* sqe = io_uring_get_sqe(&h.ring);
    if (sqe == nullptr) {
      if (ring_failure const f = c.push(h); f.error != 0) { return f; }
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
  return any ? c.push(h) : ring_failure{};
}

/// Withdraws from `h` every entry the kernel has not taken (after a ring failure: their
/// requests are reported failed, so they must never run), calling on_dropped(state) for
/// each piece. The ring is not SQPOLL, so the kernel reads its submission queue only inside
/// io_uring_enter, on this thread: moving the queue's tail back to its head (liburing's
/// sqe_head and sqe_tail with it) takes back exactly what it has not read.
template <class OnDropped>
void retract(ring_holder& h, OnDropped&& on_dropped)
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
      auto const s       = static_cast<unsigned>(ud & ~cancel_tag);
      h.slots[s].give_up = uring_clock::now();  // never asked: its piece is not confirmed
      uring_core::cancel_left(h, s);
      continue;
    }
    on_dropped(uring_core::piece_left(h, static_cast<unsigned>(ud)));
  }
}

/// Settles `h` after a failure: withdraws what the kernel has not taken, then waits out
/// what it has (cancelling each piece at its timeout, or at once with `cancel_all`), and
/// dropping every result. Whatever does not come back, because its cancellation went
/// unconfirmed or because the ring cannot be waited on, goes to `damage.held`, and the engine
/// is broken (`damage.broken`, unless already set; describe(piece) names a piece given up on,
/// as hung_state does).
template <class Describe>
void settle(uring_core& c, ring_holder& h, ring_damage& damage, bool cancel_all, Describe&& describe)
{
  auto ignore = [](slot_state const&, int = 0) {};
  retract(h, ignore);
  ring_failure stuck;
  for (;;) {
    stuck = c.push(h);  // cancellations left prepared by an EAGAIN
    if (stuck.error == 0) { c.reap(h, ignore, stuck); }
    if (stuck.error != 0 || (h.in_flight == 0 && h.cancels == 0)) { break; }
    auto const now = uring_clock::now();
    stuck          = expire(c, h, now, cancel_all, ignore);
    if (stuck.error != 0) { break; }
    bool waiting = false;  // for something not yet given up on
    for (auto const& st : h.slots) {
      bool const in_ring = st.busy || st.cancel_out;
      waiting = waiting || (in_ring && !(st.cancelled && st.give_up <= now));
    }
    if (!waiting) { break; }
    char const* op = "";
    int const w    = c.wait_until(h, uring_core::next_deadline(h, true), op);
    if (w < 0 && w != -ETIME && w != -EAGAIN && w != -EBUSY) {
      stuck = {-w, op};
      break;
    }
  }
  slot_state const* first = nullptr;
  for (auto& st : h.slots) {
    if (!st.busy) { continue; }
    if (first == nullptr) { first = &st; }
    damage.held.push_back({{st.p.data, st.p.length}, st.hold});
  }
  auto& broken = damage.broken;
  if (broken.error == 0) {
    if (stuck.error != 0) {
      broken = stuck_state(stuck);
    } else if (first != nullptr) {
      broken = describe(first->p);
    } else if (h.cancels != 0) {
      broken = stuck_state({ETIMEDOUT, "IORING_OP_ASYNC_CANCEL"});  // a cancellation that never answered
    }
  }
}

}  // namespace tierstate::io::detail
