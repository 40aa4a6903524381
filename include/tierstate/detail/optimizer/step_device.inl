// SPDX-License-Identifier: Apache-2.0
// The device compute's step bodies: the state resident on the device, staged through host
// memory, or streamed from a host or NVMe tier to the device.
#pragma once

namespace tierstate::inline TIERSTATE_ABI {

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::launch_chunk(std::size_t k,
    std::byte* chunk,
                                       std::span<grad_view<grad_type> const> grads,
                                       std::vector<typename Rule::coefficients> const& coefficients)
{
  if constexpr (on_device_) {
    using arrays_t = update_arrays<Precision, Rule::slot_count>;
    constexpr std::size_t first_rule_slot = Precision::has_master ? 1 : 0;
    for (std::size_t p = chunk_pieces_[k]; p < chunk_pieces_[k + 1]; ++p) {
      auto const& pc     = pieces_[p];
      auto const& tensor = tensors_[pc.tensor];
      if (grads[pc.tensor].data == nullptr) { continue; }  // no gradient
      arrays_t a;
      a.param = tensor.param + pc.tensor_begin;
      a.grad  = grads[pc.tensor].data + pc.tensor_begin;
      if constexpr (Precision::has_master) {
        a.master = reinterpret_cast<float*>(chunk + layout_->slot_offset(0)) + pc.chunk_begin;
      }
      for (std::size_t j = 0; j < Rule::slot_count; ++j) {
        a.state[j] = reinterpret_cast<state_type*>(chunk + layout_->slot_offset(first_rule_slot + j)) +
                     pc.chunk_begin;
      }
      Compute::template update_async<Rule, Precision>(dev_->compute, coefficients[tensor.group], a,
                                                      pc.count);
    }
  } else {
    (void)k, (void)chunk, (void)grads, (void)coefficients;
  }
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::step_device_resident(
    std::span<grad_view<grad_type> const> grads,
                                               std::vector<typename Rule::coefficients> const& coefficients,
                                               step_stats& stats, bool& changed)
{
  // Every chunk updated in place on the device, in one stream: nothing crosses PCIe.
  auto& d = *dev_;
  try {
    if constexpr (device_tier<StateTier>) {
      auto const t0 = std::chrono::steady_clock::now();
      for (std::size_t j = 0; j < layout_->chunk_count(); ++j) {
        std::size_t const k = chunk_at(j);
        await_chunk(k, stats);
        changed = true;
        launch_chunk(k, tier_->device_data() + k * layout_->chunk_bytes(), grads, coefficients);
        ++stats.chunks;
      }
      d.compute.synchronize();
      stats.compute_seconds += detail::seconds_since(t0);
      stats.tier_bytes_in_place += layout_->total_bytes();
    }
  } catch (...) {
    try {
      d.compute.synchronize();
    } catch (...) {  // the first failure is the one reported
    }
    throw;
  }
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::step_overlapped_host(
    std::span<grad_view<grad_type> const> grads,
                                               std::vector<typename Rule::coefficients> const& coefficients,
                                               step_stats& stats, bool& changed)
{
  // The j-th chunk of the step's order uses buffer j % B of each staging ring. While it is
  // computed on the host, the gradients of the next Depth chunks come device to host (d2h
  // stream), the previous chunk's params go host to device (h2d stream), and a tier that is
  // not addressable reads ahead and writes behind as with Pipelined. in[b] marks a chunk's
  // gradients landed; out[b] its params gone, after which buffer b may take the chunk B
  // positions on. In a streaming step a chunk's gradients are copied only once they are
  // final: the reads ahead are issued as usual, the copies when the chunk is ready.
  constexpr unsigned B      = Transfer::staging_buffers;
  constexpr bool staged     = !addressable_tier<StateTier>;
  auto& d                   = *dev_;
  std::size_t const n       = layout_->chunk_count();
  std::size_t const bytes   = layout_->chunk_bytes();
  std::size_t const ce      = layout_->chunk_elements();
  std::size_t const grain   = 64 * host::batch_size<arch>;
  auto* const grad_ring     = reinterpret_cast<grad_type*>(d.grad_stage.data());
  auto* const param_ring    = reinterpret_cast<param_type*>(d.param_stage.data());
  bool const streaming      = in_step();
  std::vector<std::uint64_t> read_ticket(n);
  std::vector<char> copied(n, 0);

  auto read_ahead = [&](std::size_t j) {
    if constexpr (staged) {
      unsigned const b = static_cast<unsigned>(j % B);
      read_ticket[j]   = io_->enqueue({chunk_at(j) * bytes, staging(b), bytes, false}, b);
      stats.tier_bytes_read += bytes;
    }
  };
  auto copy_down = [&](std::size_t j) {  // chunk at position j: its gradients to the host
    unsigned const b    = static_cast<unsigned>(j % B);
    std::size_t const k = chunk_at(j);
    if (j >= B) { d.out[b].synchronize(); }  // position j - B's params have left this buffer
    for (std::size_t p = chunk_pieces_[k]; p < chunk_pieces_[k + 1]; ++p) {
      auto const& pc = pieces_[p];
      auto const& g  = grads[pc.tensor];
      if (g.data == nullptr) { continue; }  // no gradient
      if (g.where == location::device) {
        device::copy_async(grad_ring + b * ce + pc.chunk_begin, g.data + pc.tensor_begin,
                           pc.count * sizeof(grad_type), d.d2h);
        stats.d2h_bytes += pc.count * sizeof(grad_type);
      }
      if constexpr (!Precision::has_master) {  // the param is its own master: it comes too
        auto const& t = tensors_[pc.tensor];
        if (update_params_on_device(pc.tensor)) {
          device::copy_async(param_ring + b * ce + pc.chunk_begin, t.param + pc.tensor_begin,
                             pc.count * sizeof(param_type), d.d2h);
          stats.d2h_bytes += pc.count * sizeof(param_type);
        }
      }
    }
    d.in[b].record(d.d2h);
    copied[j] = 1;
  };
  auto fetch = [&](std::size_t j) {
    read_ahead(j);
    if (!streaming) { copy_down(j); }
  };

  try {
    for (std::size_t j = 0; j < std::min<std::size_t>(n, Transfer::depth + 1); ++j) { fetch(j); }
    for (std::size_t j = 0; j < n; ++j) {
      unsigned const b    = static_cast<unsigned>(j % B);
      std::size_t const k = chunk_at(j);
      if (copied[j] == 0) {
        await_chunk(k, stats);
        copy_down(j);
      }
      auto t0 = std::chrono::steady_clock::now();
      if constexpr (staged) { io_->wait(read_ticket[j]); }
      d.in[b].synchronize();
      stats.wait_seconds += detail::seconds_since(t0);

      changed = true;
      std::byte* chunk;
      if constexpr (staged) {
        chunk = staging(b);
      } else {
        chunk = tier_->data() + k * bytes;
      }
      t0 = std::chrono::steady_clock::now();
      pool_.parallel_for(layout_->chunk_size(k), grain, [&](std::size_t lo, std::size_t hi) {
        update_chunk_range(k, chunk, lo, hi, grads, coefficients, grad_ring + b * ce, param_ring + b * ce);
      });
      stats.compute_seconds += detail::seconds_since(t0);

      if constexpr (staged) {
        io_->enqueue({k * bytes, chunk, bytes, true}, b);
        stats.tier_bytes_written += bytes;
      } else {
        stats.tier_bytes_in_place += bytes;
      }
      for (std::size_t p = chunk_pieces_[k]; p < chunk_pieces_[k + 1]; ++p) {
        auto const& pc = pieces_[p];
        auto const& t  = tensors_[pc.tensor];
        if (update_params_on_device(pc.tensor) && grads[pc.tensor].data != nullptr) {
          device::copy_async(t.param + pc.tensor_begin, param_ring + b * ce + pc.chunk_begin,
                             pc.count * sizeof(param_type), d.h2d);
          stats.h2d_bytes += pc.count * sizeof(param_type);
        }
      }
      d.out[b].record(d.h2d);
      ++stats.chunks;
      if (j + Transfer::depth + 1 < n) { fetch(j + Transfer::depth + 1); }
      if (streaming) {  // the gradients of the chunks ahead that are final by now start down
        for (std::size_t a = j + 1; a < std::min(n, j + Transfer::depth + 2); ++a) {
          if (copied[a] != 0) { continue; }
          if (!chunk_is_ready(chunk_at(a))) { break; }
          await_chunk(chunk_at(a), stats);
          copy_down(a);
        }
      }
    }
    auto const t0 = std::chrono::steady_clock::now();
    if constexpr (staged) { io_->wait_all(); }
    d.h2d.synchronize();
    d.d2h.synchronize();
    stats.wait_seconds += detail::seconds_since(t0);
  } catch (...) {
    if constexpr (staged) { io_->drain(); }
    try {
      d.d2h.synchronize();
      d.h2d.synchronize();
    } catch (...) {  // the first failure is the one reported
    }
    throw;
  }
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::step_streamed_to_device(
    std::span<grad_view<grad_type> const> grads,
                                                  std::vector<typename Rule::coefficients> const& coefficients,
                                                  step_stats& stats, bool& changed)
{
  // Chunk k uses buffer k % B of the device staging ring (and of the pinned ring, for a tier
  // that is not addressable). While chunk k is updated on the compute stream, chunk k+1's
  // state goes host to device (h2d) and chunk k-1's comes back (d2h); NvmeFile reads run
  // Depth chunks ahead of the h2d copies, and a chunk is written once its d2h copy landed.
  // in[b]: state arrived; computed[b]: updated; out[b]: gone back, buffer b free.
  constexpr unsigned B    = Transfer::staging_buffers;
  constexpr bool staged   = !addressable_tier<StateTier>;
  auto& d                 = *dev_;
  std::size_t const n     = layout_->chunk_count();
  std::size_t const bytes = layout_->chunk_bytes();
  std::vector<std::uint64_t> read_ticket(n);

  // (j is a position in the step's order; chunk_at(j) the chunk there.)
  auto device_chunk = [&](std::size_t j) { return d.state_stage + (j % B) * bytes; };
  auto host_chunk   = [&](std::size_t j) -> std::byte* {
    if constexpr (staged) {
      return staging(static_cast<unsigned>(j % B));
    } else {
      return tier_->data() + chunk_at(j) * bytes;
    }
  };
  auto read = [&](std::size_t j) {
    if constexpr (staged) {
      read_ticket[j] = io_->enqueue({chunk_at(j) * bytes, host_chunk(j), bytes, false}, static_cast<unsigned>(j % B));
      stats.tier_bytes_read += bytes;
    }
  };
  auto upload = [&](std::size_t j) {
    unsigned const b = static_cast<unsigned>(j % B);
    if constexpr (staged) {
      auto const t0 = std::chrono::steady_clock::now();
      io_->wait(read_ticket[j]);
      stats.wait_seconds += detail::seconds_since(t0);
    }
    d.h2d.wait(d.out[b]);  // chunk j - B has left the device buffer
    device::copy_async(device_chunk(j), host_chunk(j), bytes, d.h2d);
    d.in[b].record(d.h2d);
    stats.h2d_bytes += bytes;
  };
  auto write_back = [&](std::size_t j) {  // after chunk j's state is back on the host
    if constexpr (staged) {
      unsigned const b = static_cast<unsigned>(j % B);
      auto const t0    = std::chrono::steady_clock::now();
      d.out[b].synchronize();
      stats.wait_seconds += detail::seconds_since(t0);
      io_->enqueue({chunk_at(j) * bytes, host_chunk(j), bytes, true}, b);
      stats.tier_bytes_written += bytes;
    }
  };

  try {
    for (std::size_t j = 0; j < std::min<std::size_t>(n, Transfer::depth + 1); ++j) { read(j); }
    if (n > 0) { upload(0); }
    for (std::size_t j = 0; j < n; ++j) {
      unsigned const b = static_cast<unsigned>(j % B);
      if (j + 1 < n) { upload(j + 1); }
      await_chunk(chunk_at(j), stats);
      d.compute.wait(d.in[b]);
      changed = true;
      launch_chunk(chunk_at(j), device_chunk(j), grads, coefficients);
      d.computed[b].record(d.compute);
      d.d2h.wait(d.computed[b]);
      device::copy_async(host_chunk(j), device_chunk(j), bytes, d.d2h);
      d.out[b].record(d.d2h);
      stats.d2h_bytes += bytes;
      if constexpr (!staged) { stats.tier_bytes_in_place += bytes; }
      ++stats.chunks;
      if (j >= 1) { write_back(j - 1); }
      if (j + Transfer::depth + 1 < n) { read(j + Transfer::depth + 1); }
    }
    auto const t0 = std::chrono::steady_clock::now();
    if (n > 0) { write_back(n - 1); }
    if constexpr (staged) { io_->wait_all(); }
    d.compute.synchronize();
    d.h2d.synchronize();
    d.d2h.synchronize();
    stats.wait_seconds += detail::seconds_since(t0);
  } catch (...) {
    try {
      d.compute.synchronize();
      d.h2d.synchronize();
      d.d2h.synchronize();
    } catch (...) {  // the first failure is the one reported
    }
    if constexpr (staged) { io_->drain(); }
    throw;
  }
}

}  // namespace tierstate
