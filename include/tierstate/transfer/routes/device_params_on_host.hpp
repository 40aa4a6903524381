// SPDX-License-Identifier: Apache-2.0
// The route of host compute for params and gradients on the device (ZeRO-Offload; with
// NvmeFile, ZeRO-Infinity's optimizer offload): the PCIe legs around the host's update.
//
// Staging buffer b of each pinned ring (gradients, params) serves the chunks at positions
// b, b + B, ... (B = the transfer's staging_buffers). fetch starts the tier's read (a tier
// that is not addressable) and the chunk's gradients device to host (the d2h stream); compute
// waits for both and updates the chunk on the host; retire writes the state back and sends
// the updated params host to device (the h2d stream). in[b] marks a chunk's gradients landed,
// out[b] its params gone: a later chunk's gradients come into buffer b only after that. In a
// streaming step a chunk's gradients are copied once they are final: at its compute, or
// earlier, when a retire finds the chunks ahead ready; those that grad_ready kept in the
// params' sources (offloaded params) are read back into the ring then.
#pragma once

#include <tierstate/core/detail/stream_trace.hpp>
#include <tierstate/core/device_runtime.hpp>
#include <tierstate/core/stats.hpp>
#include <tierstate/core/tensor.hpp>
#include <tierstate/kernels/host/update.hpp>
#include <tierstate/tiers/tier.hpp>
#include <tierstate/transfer/routes/detail/route_base.hpp>
#include <tierstate/transfer/routes/detail/tier_io.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <span>
#include <vector>

namespace tierstate::inline TIERSTATE_ABI::routes {

template <class Optimizer>
class device_params_on_host : public detail::route_base<Optimizer> {
  using base = detail::route_base<Optimizer>;
  using base::o_, base::grads_, base::coefficients_, base::stats_, base::changed_;
  using grad_type                  = typename base::grad_type;
  using param_type                 = typename Optimizer::param_type;
  static constexpr unsigned B      = Optimizer::placement::buffers;
  static constexpr unsigned depth  = Optimizer::placement::depth;
  static constexpr bool staged     = Optimizer::placement::host_staging_chunks > 0;
  static constexpr bool has_master = Optimizer::precision_type::has_master;

 public:
  device_params_on_host(Optimizer& o, typename base::grads_type grads, typename base::coefficients const& c,
                        step_stats& stats, bool& changed)
    : base(o, grads, c, stats, changed), d_(o.store_.device()), io_(o, stats), n_(o.store_.layout().chunk_count()),
      bytes_(o.store_.layout().chunk_bytes()), ce_(o.store_.layout().chunk_elements()),
      grad_ring_(reinterpret_cast<grad_type*>(d_.grad_stage.data())),
      param_ring_(reinterpret_cast<param_type*>(d_.param_stage.data())), streaming_(o.in_step()), copied_(n_, 0)
  {
  }

  void fetch(std::size_t j, unsigned b)
  {
    if constexpr (staged) { io_.read(j, o_.store_.staging(b), b); }
    if (!streaming_) { copy_down(j, b); }
  }

  void compute(std::size_t j, unsigned b)
  {
    std::size_t const k = o_.chunk_at(j);
    if (copied_[j] == 0) {
      o_.await_chunk(k, stats_);
      copy_down(j, b);
    }
    io_.wait_read(j);
    tracer* const trace = tierstate::detail::traced(o_.tracer_);
    auto const ck       = static_cast<std::int64_t>(k);
    auto t0             = std::chrono::steady_clock::now();
    d_.in[b].synchronize();  // the chunk's gradients have landed
    auto t1 = std::chrono::steady_clock::now();
    stats_.wait_seconds += std::chrono::duration<double>(t1 - t0).count();
    if (trace != nullptr) [[unlikely]] { trace->record(trace_phase::grads, ck, 0, t0, t1); }

    changed_               = true;
    std::byte* const chunk = state_of(j, b);
    std::size_t const bpe  = bytes_ / ce_;
    t0                     = std::chrono::steady_clock::now();
    o_.pool_.parallel_for(o_.store_.layout().chunk_size(k), detail::host_grain<Optimizer>,
                          [&](std::size_t lo, std::size_t hi) {
                            tierstate::detail::trace_scope const part(trace, trace_phase::kernel, ck, (hi - lo) * bpe);
                            o_.update_chunk_range(k, chunk, lo, hi, grads_, coefficients_, grad_ring_ + b * ce_,
                                                  param_ring_ + b * ce_);
                          });
    t1 = std::chrono::steady_clock::now();
    stats_.compute_seconds += std::chrono::duration<double>(t1 - t0).count();
    if (trace != nullptr) [[unlikely]] { trace->record(trace_phase::compute, ck, bytes_, t0, t1); }
  }

  void retire(std::size_t j, unsigned b)
  {
    std::size_t const k = o_.chunk_at(j);
    if constexpr (staged) {
      io_.write(j, o_.store_.staging(b), b);
    } else {
      stats_.tier_bytes_in_place += bytes_;
    }
    tierstate::detail::stream_span up(o_.tracer_, d_.h2d, trace_phase::to_device, static_cast<std::int64_t>(k),
                                      tracer::device_stream::to_device);
    std::uint64_t sent = 0;
    for (auto const& pc : o_.store_.pieces(k)) {
      auto const& t  = o_.tensors_[pc.tensor];
      if (o_.update_params_on_device(pc.tensor) && grads_[pc.tensor].data != nullptr) {
        up.open();
        device::copy_async(t.param + pc.tensor_begin, param_ring_ + b * ce_ + pc.chunk_begin,
                           pc.count * sizeof(param_type), d_.h2d);
        sent += pc.count * sizeof(param_type);
      }
    }
    up.close(sent);
    stats_.h2d_bytes += sent;
    d_.out[b].record(d_.h2d);
    ++stats_.chunks;
    if (streaming_) {  // the gradients of the chunks ahead that are final by now start down
      for (std::size_t a = j + 1; a < std::min<std::size_t>(n_, j + depth + 2); ++a) {
        if (copied_[a] != 0) { continue; }
        if (!o_.chunk_is_ready(o_.chunk_at(a))) { break; }
        o_.await_chunk(o_.chunk_at(a), stats_);
        copy_down(a, static_cast<unsigned>(a % B));
      }
    }
  }

  void finish()
  {
    auto const t0 = std::chrono::steady_clock::now();
    io_.wait_all();
    d_.h2d.synchronize();
    d_.d2h.synchronize();
    stats_.wait_seconds += tierstate::detail::seconds_since(t0);
  }

  /// After a leg threw: nothing of the step is left in flight.
  void abandon()
  {
    io_.drain();
    for (auto* s : {&d_.d2h, &d_.h2d}) {  // each, whatever the other says
      try {
        s->synchronize();
      } catch (...) {  // the first failure is the one reported
      }
    }
  }

 private:
  /// The state of the chunk at position j: its staging buffer, or the tier's own memory.
  std::byte* state_of(std::size_t j, unsigned b)
  {
    if constexpr (staged) {
      (void)j;
      return o_.store_.staging(b);
    } else {
      (void)b;
      return o_.store_.tier().data() + o_.chunk_at(j) * bytes_;
    }
  }

  /// The chunk at position j: its gradients (and a param that is its own master) to buffer b.
  void copy_down(std::size_t j, unsigned b)
  {
    std::size_t const k = o_.chunk_at(j);
    if (j >= B) { d_.out[b].synchronize(); }  // position j - B's params have left this buffer
    tierstate::detail::stream_span down(o_.tracer_, d_.d2h, trace_phase::from_device, static_cast<std::int64_t>(k),
                                        tracer::device_stream::from_device);
    std::uint64_t const before = stats_.d2h_bytes;
    for (auto const& pc : o_.store_.pieces(k)) {
      auto const& g  = grads_[pc.tensor];
      if constexpr (Optimizer::keeps_grads_in_sources) {
        if (o_.streaming_.stashed(pc.tensor)) {  // kept in its source by grad_ready: read back
          auto const& e  = o_.tensors_[pc.tensor];
          auto const t0 = std::chrono::steady_clock::now();
          e.source->read_grad(e.source_tensor, pc.tensor_begin,
                              std::span<grad_type>(grad_ring_ + b * ce_ + pc.chunk_begin, pc.count));
          stats_.wait_seconds += tierstate::detail::seconds_since(t0);
          continue;
        }
      }
      if (g.data == nullptr) { continue; }  // no gradient
      if (g.where == location::device) {
        down.open();  // (here: a gradient read back from a source above is no device work)
        device::copy_async(grad_ring_ + b * ce_ + pc.chunk_begin, g.data + pc.tensor_begin,
                           pc.count * sizeof(grad_type), d_.d2h);
        stats_.d2h_bytes += pc.count * sizeof(grad_type);
      }
      if constexpr (!has_master) {  // the param is its own master: it comes too
        auto const& t = o_.tensors_[pc.tensor];
        if (o_.update_params_on_device(pc.tensor)) {
          down.open();
          device::copy_async(param_ring_ + b * ce_ + pc.chunk_begin, t.param + pc.tensor_begin,
                             pc.count * sizeof(param_type), d_.d2h);
          stats_.d2h_bytes += pc.count * sizeof(param_type);
        }
      }
    }
    down.close(stats_.d2h_bytes - before);
    d_.in[b].record(d_.d2h);
    copied_[j] = 1;
  }

  typename Optimizer::device_resources& d_;
  detail::tier_io<Optimizer> io_;
  std::size_t n_, bytes_, ce_;
  grad_type* grad_ring_;
  param_type* param_ring_;
  bool streaming_;
  std::vector<char> copied_;  ///< whether the j-th chunk's gradients have started down
};

}  // namespace tierstate::routes
