// SPDX-License-Identifier: Apache-2.0
// The io_uring backend's batches (see io/uring_engine.hpp): the pieces dealt out round-robin
// to the rings, each ring driven to completion by a thread of its own, and the first failure
// thrown once every ring has drained.
#pragma once

#include <tierstate/core/thread_pool.hpp>
#include <tierstate/io/detail/pieces.hpp>
#include <tierstate/io/detail/uring_cancel.hpp>
#include <tierstate/io/detail/uring_core.hpp>
#include <tierstate/io/detail/uring_state.hpp>
#include <tierstate/io/request.hpp>

#include <algorithm>
#include <cstddef>
#include <deque>
#include <mutex>
#include <span>
#include <utility>
#include <vector>

namespace tierstate::inline TIERSTATE_ABI::io::detail {

/// What one ring's part of a batch ended with.
struct ring_outcome {
  first_failure failure;
  broken_state broken;  ///< error != 0: the engine is broken
  std::vector<held_piece> held;
};

/// Runs `todo` through ring `h`; returns its first failure, with every piece the kernel
/// took completed, cancelled or given up on (see io/uring_engine.hpp).
inline ring_outcome drive(uring_core& c, ring_holder& h, std::span<request const> requests, std::deque<piece> todo)
{
  ring_outcome out;
  auto& failure  = out.failure;
  auto const timeout = c.opts_.timeout;
  auto describe  = [&](piece const& p) { return hung_state(timeout, requests[p.request], p); };
  // A ring call failed: name the first piece it leaves unfinished, then settle.
  auto ring_failed = [&](int error, char const* op) {
    piece first{};
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
    failure.note(error, first, op, unfinished_hint(requests[first.request]));
    settle(c, h, out.broken, out.held, false, describe);
    return std::move(out);
  };

  for (;;) {
    // Fill the ring (no new work once something failed).
    while (failure.error == 0 && !todo.empty() && !h.free.empty()) {
      piece const p          = todo.front();
      auto const& r          = requests[p.request];
      fault_plan::decision d = c.decide(r, p);
      if (d.error != 0) {
        todo.pop_front();
        failure.note(d.error, p);
        break;
      }
      if (!c.prep_piece(h, r, p, std::move(d))) { break; }
      todo.pop_front();
    }
    if (h.in_flight == 0 && h.cancels == 0) { break; }

    // Wait no longer than the soonest timeout, counting what this call submits.
    uring_clock::time_point until = uring_core::next_deadline(h);
    if (timeout.count() > 0 && !h.untaken.empty()) { until = std::min(until, uring_clock::now() + timeout); }
    char const* op = "";
    int const w    = c.submit_and_wait(h, until, op);
    if (w < 0 && w != -ETIME && w != -EINTR && w != -EAGAIN && w != -EBUSY) { return ring_failed(-w, op); }
    ring_failure rf;
    c.reap(h, [&](slot_state const& st, int res) {
      piece_result const got = outcome_of(st, res, requests[st.p.request].write);
      if (got.what == piece_outcome::failed) {
        failure.note(got.error, st.p);
      } else if (got.what == piece_outcome::partial) {
        todo.push_front(got.rest);  // the remainder, first
      }
    }, rf);
    if (rf.error != 0) { return ring_failed(rf.error, rf.operation); }

    auto const now = uring_clock::now();
    rf = expire(c, h, now, false, [&](slot_state const& st) {
      failure.note(ETIMEDOUT, st.p, nullptr, timed_out_hint(timeout));
    });
    if (rf.error != 0) { return ring_failed(rf.error, rf.operation); }
    if (slot_state const* st = uring_core::first_hung(h, now)) {
      // Its cancellation went unconfirmed: give up on everything in flight.
      auto const& r = requests[st->p.request];
      out.broken    = hung_state(timeout, r, st->p);
      failure       = {};
      failure.note(ETIMEDOUT, st->p, nullptr, hung_hint(timeout, r.write));
      settle(c, h, out.broken, out.held, true, describe);
      return out;
    }
  }
  return out;
}

/// Runs `requests` to completion over every ring of `c` (see io/uring_engine.hpp); throws
/// the first failure, once every ring has drained.
inline void run_batch(uring_core& c, thread_pool& pool, std::span<request const> requests)
{
  c.throw_if_broken();
  std::vector<piece> const pieces = cut(requests, c.opts_.block_size);
  if (pieces.empty()) { return; }
  std::mutex m;
  first_failure failure;
  broken_state broke;
  std::vector<held_piece> gave_up;
  std::size_t const used = std::min<std::size_t>(c.rings_.size(), pieces.size());
  pool.parallel_for(used, 1, [&](std::size_t b, std::size_t e) {
    for (std::size_t i = b; i < e; ++i) {
      std::deque<piece> todo;
      for (std::size_t p = i; p < pieces.size(); p += used) { todo.push_back(pieces[p]); }
      ring_outcome out = drive(c, c.rings_[i], requests, std::move(todo));
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
  if (broke.error != 0) { c.broken_ = broke; }
  c.keep(gave_up);
  failure.rethrow(requests);
}

}  // namespace tierstate::io::detail
