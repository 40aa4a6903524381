// SPDX-License-Identifier: Apache-2.0
// A step's checks: the gradients' arguments, non-finite values (host and device) and the
// gradient norm with its clipping.
#pragma once

namespace tierstate::inline TIERSTATE_ABI {

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::check_grads(
    std::span<grad_view<grad_type> const> grads) const
{
  if (tensors_.empty()) { throw logic_error("step: no tensor is registered: add_tensor first"); }
  if (grads.size() != tensors_.size()) {
    throw logic_error("step: " + std::to_string(grads.size()) + " gradient views for " +
                      std::to_string(tensors_.size()) +
                      " registered tensors (one per tensor, in registration order)");
  }
  for (std::size_t t = 0; t < grads.size(); ++t) {
    auto const& g = grads[t];
    auto const& e = tensors_[t];
    auto const who = "step: the gradient of tensor " + std::to_string(t) + " ('" + e.name + "')";
    if (g.data == nullptr && g.size == 0) { continue; }  // no gradient: the tensor is left as it is
    if (g.size != e.count) {
      throw logic_error(who + " has " + std::to_string(g.size) + " elements; the tensor has " +
                        std::to_string(e.count));
    }
    if constexpr (on_device_) {
      if (g.where != location::device) {
        throw logic_error(who + " is on the host; OnDevice compute reads gradients on the device");
      }
    } else if constexpr (!device_params_) {
      if (g.where != location::host) {
        throw logic_error(who + " is on the device; this composition reads gradients on the host "
                                "(use the CudaOverlapped transfer, or OnDevice compute)");
      }
    }
    if (g.data == nullptr && g.size > 0) { throw logic_error(who + " is a null pointer"); }
  }
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
bool OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::check_and_clip(
    std::span<grad_view<grad_type> const> grads, double grad_scale,
                                         std::vector<typename Rule::coefficients>& coefficients,
                                         step_result& result)
{
  auto const t0 = std::chrono::steady_clock::now();
  if (opts_.on_nonfinite != nonfinite_policy::ignore) {
    result.found_nonfinite = find_nonfinite(grads);
    if (result.found_nonfinite && opts_.on_nonfinite == nonfinite_policy::skip_step) {
      result.stats.check_seconds = detail::seconds_since(t0);
      return false;
    }
  }
  if (opts_.max_grad_norm > 0.0) {
    // torch.nn.utils.clip_grad_norm_: the norm of the unscaled gradients, and a factor
    // max_norm / (norm + 1e-6) when that is below 1, folded into the gradient's multiplier.
    result.grad_norm   = gradient_norm(grads) / grad_scale;
    double const clip  = opts_.max_grad_norm / (result.grad_norm + 1e-6);
    if (clip < 1.0) { coefficients = coefficients_for(grad_scale / clip); }
  }
  result.stats.check_seconds = detail::seconds_since(t0);
  return true;
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
bool OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::find_nonfinite(
    std::span<grad_view<grad_type> const> grads)
{
  // Host gradients: one parallel pass over all of them, as laid out.
  auto const& ext = layout_->tensors();
  std::atomic<bool> found{false};
  pool_.parallel_for(layout_->total_elements(), 16384, [&](std::size_t b, std::size_t e) {
    auto t = static_cast<std::size_t>(
      std::upper_bound(ext.begin(), ext.end(), b,
                       [](std::size_t x, tensor_extent const& te) { return x < te.offset + te.count; }) -
      ext.begin());
    for (; t < ext.size() && ext[t].offset < e && !found.load(std::memory_order_relaxed); ++t) {
      if (grads[t].where != location::host || grads[t].data == nullptr) { continue; }
      std::size_t const lo = std::max(b, ext[t].offset);
      std::size_t const hi = std::min(e, ext[t].offset + ext[t].count);
      if (lo < hi && host::any_nonfinite(grads[t].data + (lo - ext[t].offset), hi - lo)) {
        found.store(true, std::memory_order_relaxed);
      }
    }
  });
  if constexpr (device_params_) {
    // Device gradients: on the device for OnDevice, every tensor marking one flag, then one
    // wait for it; else copied, a chunk's worth at a time, into the PCIe staging and looked
    // at there.
    if constexpr (on_device_) {
      if (found.load()) { return true; }
      device::stream_view const s(dev_->compute);
      device::zero_async(dev_->nonfinite_flag, sizeof(std::uint32_t), s);
      for (auto const& g : grads) {
        if (g.where == location::device && g.data != nullptr) {
          Compute::mark_nonfinite_async(s, g.data, g.size, dev_->nonfinite_flag);
        }
      }
      std::uint32_t flag = 0;
      device::copy_async(&flag, dev_->nonfinite_flag, sizeof flag, s);
      s.synchronize();
      return flag != 0;
    } else {
      std::size_t const ce = layout_->chunk_elements();
      auto* stage          = reinterpret_cast<grad_type*>(dev_->grad_stage.data());
      for (std::size_t t = 0; t < grads.size() && !found.load(); ++t) {
        auto const& g = grads[t];
        if (g.where != location::device || g.data == nullptr) { continue; }
        for (std::size_t i = 0; i < g.size && !found.load(); i += ce) {
          std::size_t const m = std::min(ce, g.size - i);
          device::copy_async(stage, g.data + i, m * sizeof(grad_type), dev_->d2h);
          dev_->d2h.synchronize();
          if (host::any_nonfinite(pool_, stage, m)) { found = true; }
        }
      }
    }
  }
  return found.load();
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
double OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::gradient_norm(
    std::span<grad_view<grad_type> const> grads)
{
  // Sums of squares over blocks of 4096 elements of each tensor (in double, in element
  // order), then all blocks combined pairwise in (tensor, block) order: nothing depends on
  // the chunking, the threads or the order the gradients came in.
  constexpr std::size_t block = 4096;
  std::vector<std::size_t> first(grads.size() + 1, 0);
  for (std::size_t t = 0; t < grads.size(); ++t) {
    std::size_t const n = grads[t].data == nullptr ? 0 : grads[t].size;
    first[t + 1]        = first[t] + (n + block - 1) / block;
  }
  std::vector<double> sums(first.back(), 0.0);
  auto sum_block = [](grad_type const* g, std::size_t n) {
    double s = 0.0;
    for (std::size_t i = 0; i < n; ++i) {
      double const x = static_cast<double>(convert<float>(g[i]));
      s += x * x;
    }
    return s;
  };
  for (std::size_t t = 0; t < grads.size(); ++t) {
    auto const& g = grads[t];
    if (g.data == nullptr || g.size == 0) { continue; }
    std::size_t const blocks = first[t + 1] - first[t];
    if (g.where == location::host) {
      pool_.parallel_for(blocks, 1, [&](std::size_t b, std::size_t e) {
        for (std::size_t i = b; i < e; ++i) {
          sums[first[t] + i] = sum_block(g.data + i * block, std::min(block, g.size - i * block));
        }
      });
    } else if constexpr (device_params_ && !on_device_) {
      // Copied a ring's worth of whole blocks at a time into the PCIe staging.
      std::size_t const per = std::max<std::size_t>(1, dev_->grad_stage.size() / sizeof(grad_type) / block);
      auto* stage           = reinterpret_cast<grad_type*>(dev_->grad_stage.data());
      for (std::size_t i = 0; i < blocks; i += per) {
        std::size_t const m = std::min(per, blocks - i);
        std::size_t const elements = std::min(m * block, g.size - i * block);
        device::copy_async(stage, g.data + i * block, elements * sizeof(grad_type), dev_->d2h);
        dev_->d2h.synchronize();
        pool_.parallel_for(m, 1, [&](std::size_t b, std::size_t e) {
          for (std::size_t j = b; j < e; ++j) {
            sums[first[t] + i + j] = sum_block(stage + j * block, std::min(block, elements - j * block));
          }
        });
      }
    } else {
      throw logic_error("max_grad_norm: the norm of device gradients needs OnHost compute");
    }
  }
  return std::sqrt(detail::pairwise_sum(sums.data(), sums.size()));
}

}  // namespace tierstate
