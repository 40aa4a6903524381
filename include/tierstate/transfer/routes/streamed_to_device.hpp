// SPDX-License-Identifier: Apache-2.0
// The route of device compute for state in a host tier (PinnedHost, NvmeFile, a user's):
// each chunk's state streamed to the GPU and back.
//
// Buffer b of the device staging ring (and of the pinned ring, for a tier that is not
// addressable) serves the chunks at positions b, b + B, ... fetch reads the chunk from its
// tier (a tier that is not addressable); compute sends it host to device (the h2d stream),
// and the next chunk too where its fetch has started and B allows, then updates it on the
// compute stream; retire brings it back device to host (d2h), and writes the previous
// chunk to its tier once that chunk has landed. in[b]: state arrived; computed[b]: updated;
// out[b]: gone back, buffer b free. A chunk not yet written when its buffer is fetched into
// again (a schedule that fetches right after a retire) is written then.
#pragma once

#include <tierstate/core/detail/stream_trace.hpp>
#include <tierstate/core/device_runtime.hpp>
#include <tierstate/core/stats.hpp>
#include <tierstate/core/tensor.hpp>
#include <tierstate/tiers/tier.hpp>
#include <tierstate/transfer/routes/detail/route_base.hpp>
#include <tierstate/transfer/routes/detail/tier_io.hpp>

#include <chrono>
#include <cstddef>
#include <span>
#include <vector>

namespace tierstate::inline TIERSTATE_ABI::routes {

template <class Optimizer>
class streamed_to_device : public detail::route_base<Optimizer> {
  using base = detail::route_base<Optimizer>;
  using base::o_, base::grads_, base::coefficients_, base::stats_, base::changed_;
  static constexpr unsigned B  = Optimizer::placement::buffers;
  static constexpr bool staged = Optimizer::placement::host_staging_chunks > 0;

 public:
  streamed_to_device(Optimizer& o, typename base::grads_type grads, typename base::coefficients const& c,
                     step_stats& stats, bool& changed)
    : base(o, grads, c, stats, changed), d_(o.store_.device()), io_(o, stats), n_(o.store_.layout().chunk_count()),
      bytes_(o.store_.layout().chunk_bytes()), fetched_(n_, 0), uploaded_(n_, 0), unwritten_(n_, 0)
  {
  }

  void fetch(std::size_t j, unsigned b)
  {
    if constexpr (staged) {
      if (j >= B && unwritten_[j - B] != 0) { write_back(j - B); }  // the buffer's last chunk
      io_.read(j, host_chunk(j), b);
    }
    fetched_[j] = 1;
  }

  void compute(std::size_t j, unsigned b)
  {
    if (uploaded_[j] == 0) { upload(j); }
    // The next chunk comes up while this one is updated, where it has a buffer of its own.
    if constexpr (B >= 2) {
      if (j + 1 < n_ && fetched_[j + 1] != 0 && uploaded_[j + 1] == 0) { upload(j + 1); }
    }
    o_.await_chunk(o_.chunk_at(j), stats_);
    d_.compute.wait(d_.in[b]);
    changed_ = true;
    tierstate::detail::stream_span run(o_.tracer_, d_.compute, trace_phase::device_compute,
                                       static_cast<std::int64_t>(o_.chunk_at(j)), tracer::device_stream::compute);
    run.open();
    o_.launch_chunk(o_.chunk_at(j), device_chunk(j), grads_, coefficients_);
    run.close(bytes_);
    d_.computed[b].record(d_.compute);
  }

  void retire(std::size_t j, unsigned b)
  {
    d_.d2h.wait(d_.computed[b]);
    tierstate::detail::stream_span down(o_.tracer_, d_.d2h, trace_phase::from_device,
                                        static_cast<std::int64_t>(o_.chunk_at(j)), tracer::device_stream::from_device);
    down.open();
    device::copy_async(host_chunk(j), device_chunk(j), bytes_, d_.d2h);
    down.close(bytes_);
    d_.out[b].record(d_.d2h);
    stats_.d2h_bytes += bytes_;
    if constexpr (staged) {
      unwritten_[j] = 1;
      if (j >= 1 && unwritten_[j - 1] != 0) { write_back(j - 1); }
    } else {
      stats_.tier_bytes_in_place += bytes_;
    }
    ++stats_.chunks;
  }

  void finish()
  {
    if constexpr (staged) {  // (write_back counts its own waiting)
      for (std::size_t j = 0; j < n_; ++j) {
        if (unwritten_[j] != 0) { write_back(j); }
      }
    }
    auto const t0 = std::chrono::steady_clock::now();
    io_.wait_all();
    d_.compute.synchronize();
    d_.h2d.synchronize();
    d_.d2h.synchronize();
    stats_.wait_seconds += tierstate::detail::seconds_since(t0);
  }

  /// After a leg threw: nothing of the step is left in flight.
  void abandon()
  {
    for (auto* s : {&d_.compute, &d_.h2d, &d_.d2h}) {  // each, whatever the others say
      try {
        s->synchronize();
      } catch (...) {  // the first failure is the one reported
      }
    }
    io_.drain();
  }

 private:
  // (j is a position in the step's order; chunk_at(j) the chunk there.)
  std::byte* device_chunk(std::size_t j) const { return d_.state_stage + (j % B) * bytes_; }
  std::byte* host_chunk(std::size_t j) const
  {
    if constexpr (staged) {
      return o_.store_.staging(static_cast<unsigned>(j % B));
    } else {
      return o_.store_.tier().data() + o_.chunk_at(j) * bytes_;
    }
  }

  void upload(std::size_t j)
  {
    unsigned const b = static_cast<unsigned>(j % B);
    io_.wait_read(j);
    d_.h2d.wait(d_.out[b]);  // chunk j - B has left the device buffer
    tierstate::detail::stream_span up(o_.tracer_, d_.h2d, trace_phase::to_device,
                                      static_cast<std::int64_t>(o_.chunk_at(j)), tracer::device_stream::to_device);
    up.open();
    device::copy_async(device_chunk(j), host_chunk(j), bytes_, d_.h2d);
    up.close(bytes_);
    d_.in[b].record(d_.h2d);
    stats_.h2d_bytes += bytes_;
    uploaded_[j] = 1;
  }

  /// After the j-th chunk's state is back on the host: to its tier.
  void write_back(std::size_t j)
  {
    unsigned const b = static_cast<unsigned>(j % B);
    auto const t0    = std::chrono::steady_clock::now();
    d_.out[b].synchronize();
    stats_.wait_seconds += tierstate::detail::seconds_since(t0);
    io_.write(j, host_chunk(j), b);
    unwritten_[j] = 0;
  }

  typename Optimizer::device_resources& d_;
  detail::tier_io<Optimizer> io_;
  std::size_t n_, bytes_;
  std::vector<char> fetched_, uploaded_, unwritten_;
};

}  // namespace tierstate::routes
