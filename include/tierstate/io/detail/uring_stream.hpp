// SPDX-License-Identifier: Apache-2.0
// The io_uring backend's stream (see io/uring_engine.hpp): requests started one at a time
// finish one at a time, as their last piece completes, while one thread keeps every ring
// full (the pipelined transfer's I/O thread lives here, so the disk never idles between
// chunks).
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
#include <string>
#include <utility>
#include <vector>

namespace tierstate::inline TIERSTATE_ABI::io::detail {

class uring_stream {
  using clock = uring_clock;

 public:
  explicit uring_stream(uring_core& c) noexcept : c_(c) {}

  /// See uring_engine::start, active and progress.
  void start(request const& r, std::uint64_t tag)
  {
    c_.throw_if_broken();
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
    for (auto p : cut(one, c_.opts_.block_size)) {
      p.request = index;
      waiting_.push_back(p);
      ++s.pieces_left;
    }
    ++active_;
    if (s.pieces_left == 0) { finished_now_.push_back(index); }
  }

  [[nodiscard]] std::size_t active() const noexcept { return active_; }

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
      for (auto& h : c_.rings_) {
        f = expire(c_, h, now, false, [&](slot_state const& st) {
          requests_[st.p.request].failure.note(ETIMEDOUT, st.p, nullptr, timed_out_hint(c_.opts_.timeout));
        });
        if (f.error != 0) { break; }
      }
      // Once broken, the hung slots are the ones already given up on (held(), their requests
      // finished): nothing new is started, so there is nothing to give up on again.
      if (f.error == 0 && c_.broken_.error == 0) {
        for (auto& h : c_.rings_) {
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

  /// Moves waiting pieces into the rings (round-robin) and submits them.
  ring_failure fill()
  {
    bool placed = true;
    while (!waiting_.empty() && placed) {
      placed = false;
      for (auto& h : c_.rings_) {
        if (waiting_.empty()) { break; }
        if (h.free.empty()) { continue; }
        piece const p = waiting_.front();
        auto& sr              = requests_[p.request];
        fault_plan::decision d = fault_plan::decision::as_is(p.length);
        if (sr.failure.error == 0) {
          d = c_.decide(sr.r, p);
          if (d.error != 0) { sr.failure.note(d.error, p); }
        }
        if (sr.failure.error != 0) {
          // The request has failed: its remaining pieces are not submitted.
          waiting_.pop_front();
          if (--sr.pieces_left == 0) { finished_now_.push_back(p.request); }
          placed = true;
          continue;
        }
        if (!c_.prep_piece(h, sr.r, p, std::move(d))) { continue; }
        waiting_.pop_front();
        placed = true;
      }
    }
    for (auto& h : c_.rings_) {
      if (ring_failure const f = c_.push(h); f.error != 0) { return f; }
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
    for (auto& h : c_.rings_) {
      if (uring_core::in_kernel(h) == 0) { continue; }
      ++waiting_rings;
      until = std::min(until, uring_core::next_deadline(h));
    }
    if (waiting_rings == 0) { return {}; }
    char const* op = "";
    if (waiting_rings == 1) {
      for (auto& h : c_.rings_) {
        if (uring_core::in_kernel(h) == 0) { continue; }
        int const r = c_.wait_until(h, until, op);
        if (r < 0 && r != -EAGAIN && r != -ETIME) { return {-r, op}; }
        return {};
      }
    }
    // Several rings and one thread: wait on each in turn, briefly, until the deadline.
    for (std::size_t i = 0;; i = (i + 1) % c_.rings_.size()) {
      auto const now = clock::now();
      if (now >= until) { return {}; }
      if (uring_core::in_kernel(c_.rings_[i]) == 0) { continue; }
      int const r = c_.wait_until(c_.rings_[i], std::min(until, now + std::chrono::microseconds(100)), op);
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
    for (auto& h : c_.rings_) {
      unsigned const n = c_.reap(h, [&](slot_state const& st, int res) {
        auto& sr               = requests_[st.p.request];
        piece_result const got = outcome_of(st, res, sr.r.write);
        if (got.what == piece_outcome::failed) {
          sr.failure.note(got.error, st.p);
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

  /// Settles every ring, resets the streaming state and finishes every active request with
  /// error_for(request) (see progress()).
  template <class ErrorFor, class Done>
  void end_streaming(bool cancel_all, ErrorFor&& error_for, Done& done)
  {
    std::vector<held_piece> gave_up;
    auto describe = [&](piece const& p) { return hung_state(c_.opts_.timeout, requests_[p.request].r, p); };
    for (auto& h : c_.rings_) { settle(c_, h, c_.broken_, gave_up, cancel_all, describe); }
    c_.keep(gave_up);

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
      std::string hint = unfinished_hint(sr.r);
      if (c_.broken_.error != 0) { hint.append("; the ring could not be drained, so the engine is unusable now"); }
      return std::make_exception_ptr(
        io_error(f.error, path_of(sr.r), f.operation, sr.r.offset, sr.r.length, hint));
    }, done);
  }

  /// After the cancellation of `hung` went unconfirmed: gives up on everything in flight,
  /// breaks the engine and fails every active request.
  template <class Done>
  void give_up_streaming(slot_state const& hung, Done& done)
  {
    std::size_t const culprit = hung.p.request;
    piece const where = hung.p;
    request const r           = requests_[culprit].r;
    c_.broken_                   = hung_state(c_.opts_.timeout, r, where);
    requests_[culprit].failure = {};
    requests_[culprit].failure.note(ETIMEDOUT, where, nullptr, hung_hint(c_.opts_.timeout, r.write));
    std::string const abandoned = std::string("abandoned unfinished: another I/O of this engine got no answer within ")
                                    .append(describe_timeout(c_.opts_.timeout))
                                    .append(" and its cancellation was not confirmed; this engine is unusable");
    end_streaming(true, [&](stream_request const& sr) -> std::exception_ptr {
      if (sr.failure.error != 0) { return own_error(sr); }
      return std::make_exception_ptr(
        io_error(ETIMEDOUT, path_of(sr.r), sr.r.write ? "write" : "read", sr.r.offset, sr.r.length, abandoned));
    }, done);
  }

  uring_core& c_;
  std::vector<stream_request> requests_;
  std::vector<std::size_t> free_requests_;
  std::deque<piece> waiting_;
  std::vector<std::size_t> finished_now_;  ///< finished without a completion (empty, or failed early)
  std::size_t active_ = 0;
};

}  // namespace tierstate::io::detail
