// SPDX-License-Identifier: Apache-2.0
// The in-place route: state in an addressable host tier (PinnedHost, a user's), compute on
// the host, params and gradients in host memory. Nothing moves: fetch and retire have nothing
// to do, and compute updates the tier's memory where it is.
//
// A plain step is one unit of work for the schedule (chunks() is 1): one parallel pass over
// every element of the tier, whose threads' ranges cross chunk boundaries, so that a model of
// many small chunks costs no barrier per chunk. A streaming step visits the chunks in the
// step's order, each once its gradients are in, and every run of chunks that may go at once
// in one such pass.
#pragma once

#include <tierstate/core/stats.hpp>
#include <tierstate/core/tensor.hpp>
#include <tierstate/core/trace.hpp>
#include <tierstate/kernels/host/update.hpp>
#include <tierstate/transfer/routes/detail/route_base.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <vector>

namespace tierstate::inline TIERSTATE_ABI::routes {

template <class Optimizer>
class host_in_place : public detail::route_base<Optimizer> {
  using base = detail::route_base<Optimizer>;
  using base::o_, base::grads_, base::coefficients_, base::stats_, base::changed_;
  static constexpr std::size_t grain = detail::host_grain<Optimizer>;

 public:
  using base::base;

  [[nodiscard]] std::size_t chunks() const noexcept { return streaming() ? o_.store_.layout().chunk_count() : 1; }

  void fetch(std::size_t, unsigned) noexcept {}

  void compute(std::size_t j, unsigned)
  {
    auto const& lay = o_.store_.layout();
    if (!streaming()) {
      std::size_t const ce = lay.chunk_elements();
      changed_             = true;
      tracer* const trace  = tierstate::detail::traced(o_.tracer_);
      std::size_t const bpe = lay.chunk_bytes() / ce;
      tierstate::detail::trace_scope const whole(trace, trace_phase::compute, -1, lay.total_bytes());
      auto const t0        = std::chrono::steady_clock::now();
      o_.pool_.parallel_for(lay.total_elements(), grain, [&](std::size_t b, std::size_t e) {
        tierstate::detail::trace_scope const part(trace, trace_phase::kernel, -1, (e - b) * bpe);
        for (std::size_t k = b / ce; k * ce < e; ++k) {
          o_.update_chunk_range(k, chunk(k), std::max(b, k * ce) - k * ce, std::min(e, (k + 1) * ce) - k * ce,
                                grads_, coefficients_);
        }
      });
      stats_.compute_seconds += tierstate::detail::seconds_since(t0);
      stats_.chunks += lay.chunk_count();
      return;
    }
    if (j < done_until_) { return; }  // updated with an earlier position's run
    o_.await_chunk(o_.chunk_at(j), stats_);
    // The run of positions from j whose chunks may go now (after the last gradient of a
    // checked step: all of them) is one parallel pass, as a plain step is: a pass per chunk
    // cost a barrier each, 20-30% of a checked streaming step's update on two threads.
    std::size_t end = j + 1;
    while (end < lay.chunk_count() && o_.chunk_is_ready(o_.chunk_at(end))) { ++end; }
    run_.clear();
    std::size_t total = 0;
    for (std::size_t p = j; p < end; ++p) {
      std::size_t const k = o_.chunk_at(p);
      if (p > j) { o_.await_chunk(k, stats_); }  // ready: returns at once (after any device event)
      run_.push_back({k, total});
      total += (lay.chunk_size(k) + grain - 1) / grain * grain;  // each chunk's part boundaries stay aligned
    }
    changed_      = true;
    tracer* const trace = tierstate::detail::traced(o_.tracer_);
    std::size_t const bpe = lay.chunk_bytes() / lay.chunk_elements();
    tierstate::detail::trace_scope const whole(trace, trace_phase::compute, static_cast<std::int64_t>(o_.chunk_at(j)),
                                               total * bpe);
    auto const t0 = std::chrono::steady_clock::now();
    o_.pool_.parallel_for(total, grain, [&](std::size_t b, std::size_t e) {
      tierstate::detail::trace_scope const part(trace, trace_phase::kernel, static_cast<std::int64_t>(o_.chunk_at(j)),
                                                (e - b) * bpe);
      auto at = std::upper_bound(run_.begin(), run_.end(), b, [](std::size_t x, run_entry const& r) { return x < r.at; });
      for (--at; at != run_.end() && at->at < e; ++at) {
        std::size_t const size = lay.chunk_size(at->chunk);
        std::size_t const lo   = std::max(b, at->at) - at->at;
        std::size_t const hi   = std::min({e - at->at, size});
        if (lo < hi) { o_.update_chunk_range(at->chunk, chunk(at->chunk), lo, hi, grads_, coefficients_); }
      }
    });
    stats_.compute_seconds += tierstate::detail::seconds_since(t0);
    stats_.chunks += end - j;
    done_until_ = end;
  }

  void retire(std::size_t, unsigned) noexcept {}

  void finish() noexcept { stats_.tier_bytes_in_place = o_.store_.layout().total_bytes(); }

  /// After a leg threw: nothing is in flight.
  void abandon() noexcept {}

 private:
  struct run_entry {
    std::size_t chunk = 0;  ///< the chunk
    std::size_t at    = 0;  ///< where its elements start in the run's index space
  };
  std::vector<run_entry> run_;
  std::size_t done_until_ = 0;  ///< positions before this are updated

  [[nodiscard]] bool streaming() const noexcept { return o_.in_step(); }
  [[nodiscard]] std::byte* chunk(std::size_t k) const noexcept
  {
    return o_.store_.tier().data() + k * o_.store_.layout().chunk_bytes();
  }
};

}  // namespace tierstate::routes
