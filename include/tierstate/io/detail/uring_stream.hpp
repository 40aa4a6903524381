// SPDX-License-Identifier: Apache-2.0
// The io_uring backend's one state machine (see io/uring_engine.hpp): requests started one
// at a time finish one at a time, as their last piece completes, while one thread keeps its
// rings full. The engine streams through one over every ring (the pipelined transfer's I/O
// thread lives here, so the disk never idles between chunks); a batch (uring_batch.hpp) runs
// one per ring to completion, each on a thread of its own, under batch_policy. Filling,
// reaping, timeouts, ring failures and giving up are written here once, for both.
#pragma once

#include <tierstate/io/detail/pieces.hpp>
#include <tierstate/io/detail/uring_cancel.hpp>
#include <tierstate/io/detail/uring_core.hpp>
#include <tierstate/io/detail/uring_state.hpp>
#include <tierstate/io/request.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace tierstate::inline TIERSTATE_ABI::io::detail {

/// How a stream runs. The engine's stream takes the defaults; a batch's ring thread runs its
/// share of the batch under batch_policy.
struct stream_policy {
  /// Once a piece fails, start no further piece of any request (a batch fails as a whole, so
  /// what it has not started is not wanted), and keep that failure (stop_error()).
  bool stop_at_first_failure = false;
  /// With one ring, submit and wait for a completion in one call (io_uring_submit_and_wait):
  /// a thread that drives only this ring has nothing else to do in between.
  bool submit_and_wait = false;
};
inline constexpr stream_policy batch_policy{true, true};

class uring_stream {
  using clock = uring_clock;

 public:
  /// A stream over `rings` of `c`; what giving up on I/O leaves behind goes to `damage`.
  uring_stream(uring_core& c, std::span<ring_holder> rings, ring_damage& damage, stream_policy policy = {}) noexcept
    : c_(c), rings_(rings), damage_(damage), policy_(policy)
  {
  }
  /// The engine's stream: over every ring, and what it gives up on is the engine's.
  explicit uring_stream(uring_core& c) noexcept : uring_stream(c, c.rings_, c.damage_) {}

  /// See uring_engine::start, active and progress.
  void start(request const& r, std::uint64_t tag)
  {
    damage_.throw_if_broken();
    std::size_t index;
    if (free_requests_.empty()) {
      index = requests_.size();
      requests_.emplace_back();
    } else {
      index = free_requests_.back();
      free_requests_.pop_back();
    }
    auto& s = requests_[index];
    s       = {r, tag, 0, {}};
    for_each_piece(r, index, c_.opts_.block_size, [&](piece const& p) {
      waiting_.push_back(p);
      ++s.pieces_left;
    });
    ++active_;
    if (s.pieces_left == 0) { finished_now_.push_back(index); }
  }

  [[nodiscard]] std::size_t active() const noexcept { return active_; }

  /// Under stop_at_first_failure: whether a failure has stopped the stream, and that failure
  /// as an io_error (null while none has). Requests it left unfinished finish without an
  /// error of their own.
  [[nodiscard]] bool stopped() const noexcept { return stop_.failure.error != 0; }
  [[nodiscard]] std::exception_ptr stop_error() const { return stopped() ? own_error(stop_) : nullptr; }

  template <class Done>
  void progress(bool wait, Done&& done)
  {
    // One call submits and waits, with no look at the completions first: a ring whose
    // completions keep coming would otherwise not be submitted to until it ran dry.
    bool const one_call = policy_.submit_and_wait && wait && rings_.size() == 1;
    ring_failure f      = fill(!one_call);
    if (f.error == 0) {
      bool const any = !one_call && reap_all(done, f);
      if (f.error == 0 && !any && wait) {
        f = wait_for_completion(one_call);
        if (f.error == 0) { reap_all(done, f); }
      }
    }
    if (f.error == 0) {
      auto const now = clock::now();
      for (auto& h : rings_) {
        f = expire(c_, h, now, false, [&](slot_state const& st) {
          note(requests_[st.p.request], ETIMEDOUT, st.p, nullptr, timed_out_hint(c_.opts_.timeout));
        });
        if (f.error != 0) { break; }
      }
      // Once broken, the hung slots are the ones already given up on (held(), their requests
      // finished): nothing new is started, so there is nothing to give up on again.
      if (f.error == 0 && damage_.broken.error == 0) {
        for (auto& h : rings_) {
          if (slot_state const* st = uring_core::first_hung(h, now)) {
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
  struct stream_request {
    request r;
    std::uint64_t tag       = 0;
    std::size_t pieces_left = 0;
    first_failure failure;
  };

  /// Moves waiting pieces into the rings (round-robin), and submits them if `submit`.
  ring_failure fill(bool submit)
  {
    bool placed = true;
    while (!waiting_.empty() && placed) {
      placed = false;
      for (auto& h : rings_) {
        if (waiting_.empty()) { break; }
        piece const p = waiting_.front();
        auto& sr      = requests_[p.request];
        // A piece whose request has failed (or, under stop_at_first_failure, any piece once
        // another has failed) is not submitted: it leaves at once, with no slot needed. Any
        // other waits for a free slot and entry, and only then asks the fault plan, so that
        // every decision taken is a piece submitted (the plan counts pieces).
        bool drop = sr.failure.error != 0 || stopped();
        if (!drop) {
          if (!uring_core::has_room(h)) { continue; }
          fault_plan::decision d = c_.decide(sr.r, p);
          if (d.error != 0) {
            note(sr, d.error, p);
            drop = true;
          } else {
            c_.prep_piece(h, sr.r, p, std::move(d));
          }
        }
        waiting_.pop_front();
        if (drop && --sr.pieces_left == 0) { finished_now_.push_back(p.request); }
        placed = true;
      }
    }
    if (!submit) { return {}; }
    for (auto& h : rings_) {
      if (ring_failure const f = c_.push(h); f.error != 0) { return f; }
    }
    return {};
  }

  /// Waits until some ring has a completion, or the next piece's timeout (or grace) is
  /// due; does nothing when the kernel holds nothing (pieces only prepared are submitted by
  /// the next fill()). With `one_call`, the one ring's prepared pieces are submitted by the
  /// call that waits.
  ring_failure wait_for_completion(bool one_call)
  {
    std::size_t waiting_rings = 0;
    ring_holder* first        = nullptr;
    clock::time_point until   = never;
    for (auto& h : rings_) {
      if ((one_call ? h.in_flight + h.cancels : uring_core::in_kernel(h)) == 0) { continue; }
      if (waiting_rings++ == 0) { first = &h; }
      until = std::min(until, uring_core::next_deadline(h));
      // What this call submits times out a timeout from now, at the soonest.
      if (one_call && c_.opts_.timeout.count() > 0 && !h.untaken.empty()) {
        until = std::min(until, clock::now() + c_.opts_.timeout);
      }
    }
    if (waiting_rings == 0) { return {}; }
    char const* op = "";
    if (waiting_rings == 1) {
      int const r = one_call ? c_.submit_and_wait(*first, until, op) : c_.wait_until(*first, until, op);
      // EINTR, EAGAIN and EBUSY from a submission leave it to the next call, as push() does.
      bool const again = r == -ETIME || r == -EAGAIN || (one_call && (r == -EINTR || r == -EBUSY));
      if (r < 0 && !again) { return {-r, op}; }
      return {};
    }
    // Several rings and one thread: wait on each in turn, briefly, until the deadline.
    for (std::size_t i = 0;; i = (i + 1) % rings_.size()) {
      auto const now = clock::now();
      if (now >= until) { return {}; }
      if (uring_core::in_kernel(rings_[i]) == 0) { continue; }
      int const r = c_.wait_until(rings_[i], std::min(until, now + std::chrono::microseconds(100)), op);
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
      unsigned const n = c_.reap(h, [&](slot_state const& st, int res) {
        auto& sr               = requests_[st.p.request];
        piece_result const got = outcome_of(st, res, sr.r.write);
        if (got.what == piece_outcome::failed) {
          note(sr, got.error, st.p);
        } else if (got.what == piece_outcome::partial && sr.failure.error == 0) {
          waiting_.push_front(got.rest);
          return;  // the remainder stands in for this piece
        }
        if (--sr.pieces_left == 0) { finish(st.p.request, done); }
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
    first_failure f = sr.failure;
    f.where.request         = 0;
    return std::make_exception_ptr(f.to_error(one));
  }

  /// Notes a failure of `sr` (its first is kept); under stop_at_first_failure the stream's
  /// first failure stops it.
  void note(stream_request& sr, int error, piece const& p, char const* op = nullptr, std::string hint = {})
  {
    sr.failure.note(error, p, op, std::move(hint));
    if (policy_.stop_at_first_failure && !stopped()) { stop_ = sr; }
  }

  /// Settles every ring, resets the streaming state and finishes every active request: with
  /// its own failure, or else with failure_for(request) (see progress()).
  template <class FailureFor, class Done>
  void end_streaming(bool cancel_all, FailureFor&& failure_for, Done& done)
  {
    auto describe = [&](piece const& p) { return hung_state(c_.opts_.timeout, requests_[p.request].r, p); };
    for (auto& h : rings_) { settle(c_, h, damage_, cancel_all, describe); }

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
        if (sr.failure.error == 0) {
          first_failure f = failure_for(sr.r);
          note(sr, f.error, f.where, f.operation, std::move(f.hint));
        }
        error = own_error(sr);
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

  /// All of request `r`, as the piece an error names.
  [[nodiscard]] static piece whole(request const& r) noexcept { return {0, r.offset, r.data, r.length}; }

  /// After the ring failure `f`: see the file comment.
  template <class Done>
  void fail_streaming(ring_failure const& f, Done& done)
  {
    end_streaming(false, [&](request const& r) {
      std::string hint = unfinished_hint(r);
      if (damage_.broken.error != 0) { hint.append("; the ring could not be drained, so the engine is unusable now"); }
      return first_failure{f.error, whole(r), f.operation, std::move(hint)};
    }, done);
  }

  /// After the cancellation of `hung` went unconfirmed: gives up on everything in flight,
  /// breaks the engine and fails every active request.
  template <class Done>
  void give_up_streaming(slot_state const& hung, Done& done)
  {
    auto& culprit     = requests_[hung.p.request];
    piece const where = hung.p;
    damage_.broken    = hung_state(c_.opts_.timeout, culprit.r, where);
    culprit.failure   = {};
    note(culprit, ETIMEDOUT, where, nullptr, hung_hint(c_.opts_.timeout, culprit.r.write));
    if (policy_.stop_at_first_failure) { stop_ = culprit; }  // a broken engine says why, whatever failed first
    std::string const abandoned = std::string("abandoned unfinished: another I/O of this engine got no answer within ")
                                    .append(describe_timeout(c_.opts_.timeout))
                                    .append(" and its cancellation was not confirmed; this engine is unusable");
    end_streaming(true, [&](request const& r) { return first_failure{ETIMEDOUT, whole(r), nullptr, abandoned}; },
                  done);
  }

  uring_core& c_;
  std::span<ring_holder> rings_;
  ring_damage& damage_;
  stream_policy policy_;
  std::vector<stream_request> requests_;
  std::vector<std::size_t> free_requests_;
  std::deque<piece> waiting_;
  std::vector<std::size_t> finished_now_;  ///< finished without a completion (empty, or failed early)
  std::size_t active_ = 0;
  stream_request stop_;  ///< under stop_at_first_failure: the failure that stopped the stream, and its request
};

}  // namespace tierstate::io::detail
