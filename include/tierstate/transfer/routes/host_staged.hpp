// SPDX-License-Identifier: Apache-2.0
// The host-staged route: state in a tier that is not addressable (NvmeFile, a user's),
// compute on the host, params and gradients in host memory. A chunk's state is read from the
// tier into a staging buffer, updated there by the thread pool, and written back.
//
// The legs are those of transfer/concept.hpp (chunks() is route_base's). The optimizer makes
// one route per step and hands it to Transfer::schedule.
#pragma once

#include <tierstate/core/stats.hpp>
#include <tierstate/core/tensor.hpp>
#include <tierstate/core/trace.hpp>
#include <tierstate/kernels/host/update.hpp>
#include <tierstate/transfer/routes/detail/route_base.hpp>
#include <tierstate/transfer/routes/detail/tier_io.hpp>

#include <chrono>
#include <cstddef>
#include <span>
#include <vector>

namespace tierstate::inline TIERSTATE_ABI::routes {

template <class Optimizer>
class host_staged : public detail::route_base<Optimizer> {
  using base = detail::route_base<Optimizer>;
  using base::o_, base::grads_, base::coefficients_, base::stats_, base::changed_;

 public:
  host_staged(Optimizer& o, typename base::grads_type grads, typename base::coefficients const& c,
              step_stats& stats, bool& changed)
    : base(o, grads, c, stats, changed), io_(o, stats)
  {
  }

  void fetch(std::size_t j, unsigned b) { io_.read(j, o_.store_.staging(b), b); }

  void compute(std::size_t j, unsigned b)
  {
    std::size_t const k = o_.chunk_at(j);
    io_.wait_read(j);
    o_.await_chunk(k, stats_);
    changed_ = true;
    std::byte* const chunk = o_.store_.staging(b);
    tracer* const trace    = tierstate::detail::traced(o_.tracer_);
    auto const t_kept      = std::chrono::steady_clock::now();
    auto const* kept       = read_kept_grads(k);  // (I/O: counted as waiting)
    auto const t0          = std::chrono::steady_clock::now();
    stats_.wait_seconds += std::chrono::duration<double>(t0 - t_kept).count();
    auto const ck = static_cast<std::int64_t>(k);
    if (trace != nullptr && kept != nullptr) [[unlikely]] { trace->record(trace_phase::grads, ck, 0, t_kept, t0); }
    o_.pool_.parallel_for(o_.store_.layout().chunk_size(k), detail::host_grain<Optimizer>,
                          [&](std::size_t begin, std::size_t end) {
                            tierstate::detail::trace_scope const part(trace, trace_phase::kernel, ck,
                                                                      (end - begin) * bytes_per_element());
                            o_.update_chunk_range(k, chunk, begin, end, grads_, coefficients_, kept);
                          });
    auto const t1 = std::chrono::steady_clock::now();
    stats_.compute_seconds += std::chrono::duration<double>(t1 - t0).count();
    if (trace != nullptr) [[unlikely]] {
      trace->record(trace_phase::compute, ck, o_.store_.layout().chunk_bytes(), t0, t1);
    }
  }

  void retire(std::size_t j, unsigned b)
  {
    io_.write(j, o_.store_.staging(b), b);
    ++stats_.chunks;
  }

  void finish()
  {
    tierstate::detail::trace_scope const waiting(o_.tracer_, trace_phase::write_wait);
    auto const t0 = std::chrono::steady_clock::now();
    io_.wait_all();
    stats_.wait_seconds += tierstate::detail::seconds_since(t0);
  }

  /// After a leg threw: nothing of the step is left in flight.
  void abandon() { io_.drain(); }

 private:
  /// A chunk's state bytes per element (its slots and master), for the kernel events.
  [[nodiscard]] std::size_t bytes_per_element() const noexcept
  {
    auto const& lay = o_.store_.layout();
    return lay.chunk_bytes() / lay.chunk_elements();
  }

  /// The gradients of chunk k kept in the tensors' sources (a streaming step's, offloaded
  /// params'), read once a piece, at their place in the chunk; null when it has none.
  typename Optimizer::grad_type const* read_kept_grads(std::size_t k)
  {
    if constexpr (Optimizer::keeps_grads_in_sources) {
      bool any = false;
      for (auto const& pc : o_.store_.pieces(k)) {
        if (!o_.streaming_.stashed(pc.tensor)) { continue; }
        if (!any) { kept_.resize(o_.store_.layout().chunk_elements()); }
        any           = true;
        auto const& e = o_.tensors_[pc.tensor];
        e.source->read_grad(e.source_tensor, pc.tensor_begin,
                            std::span<typename Optimizer::grad_type>(kept_.data() + pc.chunk_begin, pc.count));
      }
      return any ? kept_.data() : nullptr;
    } else {
      (void)k;
      return nullptr;
    }
  }

  std::vector<typename Optimizer::grad_type> kept_;  ///< read_kept_grads' chunk
  detail::tier_io<Optimizer> io_;
};

}  // namespace tierstate::routes
