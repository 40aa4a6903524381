// SPDX-License-Identifier: Apache-2.0
// The device-resident route: state in the Device tier, updated where it lives. Nothing
// crosses PCIe: fetch and retire have nothing to move, compute launches the chunk's update
// on the compute stream, and finish waits for the stream.
#pragma once

#include <tierstate/core/detail/stream_trace.hpp>
#include <tierstate/core/stats.hpp>
#include <tierstate/core/tensor.hpp>
#include <tierstate/transfer/routes/detail/route_base.hpp>

#include <chrono>
#include <cstddef>
#include <span>
#include <vector>

namespace tierstate::inline TIERSTATE_ABI::routes {

template <class Optimizer>
class device_resident : public detail::route_base<Optimizer> {
  using base = detail::route_base<Optimizer>;
  using base::o_, base::grads_, base::coefficients_, base::stats_, base::changed_;

 public:
  device_resident(Optimizer& o, typename base::grads_type grads, typename base::coefficients const& c,
                  step_stats& stats, bool& changed)
    : base(o, grads, c, stats, changed), start_(std::chrono::steady_clock::now())
  {
  }

  void fetch(std::size_t, unsigned) {}

  void compute(std::size_t j, unsigned)
  {
    std::size_t const k = o_.chunk_at(j);
    o_.await_chunk(k, stats_);
    changed_ = true;
    tierstate::detail::stream_span run(o_.tracer_, o_.store_.device().compute, trace_phase::device_compute,
                                       static_cast<std::int64_t>(k), tracer::device_stream::compute);
    run.open();
    o_.launch_chunk(k, o_.store_.tier().device_data() + k * o_.store_.layout().chunk_bytes(), grads_, coefficients_);
    run.close(o_.store_.layout().chunk_bytes());
  }

  void retire(std::size_t, unsigned) { ++stats_.chunks; }

  void finish()
  {
    o_.store_.device().compute.synchronize();
    stats_.compute_seconds += tierstate::detail::seconds_since(start_);
    stats_.tier_bytes_in_place += o_.store_.layout().total_bytes();
  }

  /// After a leg threw: nothing of the step is left in flight.
  void abandon()
  {
    try {
      o_.store_.device().compute.synchronize();
    } catch (...) {  // the first failure is the one reported
    }
  }

 private:
  std::chrono::steady_clock::time_point start_;
};

}  // namespace tierstate::routes
