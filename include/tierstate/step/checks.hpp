// SPDX-License-Identifier: Apache-2.0
// A step's checks: the gradients' views against the registered tensors, non-finite values
// and the gradients' 2-norm. Where the gradients may be, and how device gradients are looked
// at (on the device with device compute, through the PCIe ring with host compute), is the
// composition's placement (transfer/routes/route.hpp): these name no compute or transfer trait.
#pragma once

#include <tierstate/core/error.hpp>
#include <tierstate/core/device_runtime.hpp>
#include <tierstate/core/layout.hpp>
#include <tierstate/core/numeric.hpp>
#include <tierstate/core/tensor.hpp>
#include <tierstate/core/thread_pool.hpp>
#include <tierstate/detail/optimizer/registry_parts.hpp>
#include <tierstate/kernels/host/finite.hpp>
#include <tierstate/transfer/routes/route.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace tierstate::inline TIERSTATE_ABI::detail {

/// Sum of v in a fixed pairwise order (the halves of each range, recursively).
inline double pairwise_sum(double const* v, std::size_t n) noexcept
{
  if (n == 0) { return 0.0; }
  if (n == 1) { return v[0]; }
  std::size_t const h = n / 2;
  return pairwise_sum(v, h) + pairwise_sum(v + h, n - h);
}

template <class Grad, class Compute, class Placement>
struct step_checks {
  using grads_type = std::span<grad_view<Grad> const>;

  /// Refuses gradient view `g` of tensor `e`: a size that is not the tensor's, memory where
  /// this composition does not read gradients, a null pointer. `who` names it.
  template <class Entry>
  static void check_view(std::string const& who, grad_view<Grad> const& g, Entry const& e)
  {
    if (g.size != e.count) {
      throw logic_error(who + " has " + std::to_string(g.size) + " elements; the tensor has " +
                        std::to_string(e.count));
    }
    if constexpr (Placement::grads == routes::grad_home::device) {
      if (g.where != location::device) {
        throw logic_error(who + " is on the host; OnDevice compute reads gradients on the device");
      }
    } else if constexpr (Placement::grads == routes::grad_home::host) {
      if (g.where != location::host) {
        throw logic_error(who + " is on the device; this composition reads gradients on the host "
                                "(use the CudaOverlapped transfer, or OnDevice compute)");
      }
    }
    if (g.data == nullptr && g.size > 0) { throw logic_error(who + " is a null pointer"); }
  }

  /// step()'s gradients: one view per registered tensor, {nullptr, 0} for none.
  template <class Entry>
  static void check_grads(grads_type grads, std::span<Entry const> tensors)
  {
    if (tensors.empty()) { throw logic_error("step: no tensor is registered: add_tensor first"); }
    if (grads.size() != tensors.size()) {
      throw logic_error("step: " + std::to_string(grads.size()) + " gradient views for " +
                        std::to_string(tensors.size()) +
                        " registered tensors (one per tensor, in registration order)");
    }
    for (std::size_t t = 0; t < grads.size(); ++t) {
      if (grads[t].data == nullptr && grads[t].size == 0) { continue; }  // no gradient: left as it is
      check_view("step: the gradient of tensor " + std::to_string(t) + " ('" + tensors[t].name + "')", grads[t],
                 tensors[t]);
    }
  }

  /// Whether gradient `g` holds an inf or a NaN, where it is host memory (false where it
  /// is not): a streaming step looks at each as it is handed over.
  [[nodiscard]] static bool host_nonfinite(grad_view<Grad> const& g, thread_pool& pool)
  {
    return g.where == location::host && g.data != nullptr && host::any_nonfinite(pool, g.data, g.size);
  }

  /// Whether any gradient holds an inf or a NaN; `host_looked`: the host gradients were
  /// looked at already (host_nonfinite), only the device gradients are left.
  template <class Device>
  [[nodiscard]] static bool find_nonfinite(grads_type grads, layout const& lay, thread_pool& pool, Device* dev,
                                           bool host_looked = false)
  {
    // Host gradients: one parallel pass over all of them, as laid out.
    auto const& ext = lay.tensors();
    std::atomic<bool> found{false};
    pool.parallel_for(host_looked ? 0 : lay.total_elements(), 16384, [&](std::size_t b, std::size_t e) {
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
    // Device gradients: on the device for device compute, every tensor marking one flag,
    // then one wait for it; else copied, a chunk's worth at a time, into the PCIe ring and
    // looked at there.
    if constexpr (Placement::on_device) {
      if (found.load()) { return true; }
      device::stream_view const s(dev->compute);
      device::zero_async(dev->nonfinite_flag, sizeof(std::uint32_t), s);
      for (auto const& g : grads) {
        if (g.where == location::device && g.data != nullptr) {
          Compute::mark_nonfinite_async(s, g.data, g.size, dev->nonfinite_flag);
        }
      }
      std::uint32_t flag = 0;
      device::copy_async(&flag, dev->nonfinite_flag, sizeof flag, s);
      s.synchronize();
      return flag != 0;
    } else if constexpr (Placement::device_params) {
      std::size_t const ce = lay.chunk_elements();
      auto* stage          = reinterpret_cast<Grad*>(dev->grad_stage.data());
      for (std::size_t t = 0; t < grads.size() && !found.load(); ++t) {
        auto const& g = grads[t];
        if (g.where != location::device || g.data == nullptr) { continue; }
        for (std::size_t i = 0; i < g.size && !found.load(); i += ce) {
          std::size_t const m = std::min(ce, g.size - i);
          device::copy_async(stage, g.data + i, m * sizeof(Grad), dev->d2h);
          dev->d2h.synchronize();
          if (host::any_nonfinite(pool, stage, m)) { found = true; }
        }
      }
    } else {
      (void)dev;
    }
    return found.load();
  }

  /// The elements of one block of the norm's sums.
  static constexpr std::size_t norm_block = 4096;
  /// The sum of squares of g[0, n), in double, in element order.
  [[nodiscard]] static double sum_block(Grad const* g, std::size_t n) noexcept
  {
    double s = 0.0;
    for (std::size_t i = 0; i < n; ++i) {
      double const x = static_cast<double>(convert<float>(g[i]));
      s += x * x;
    }
    return s;
  }
  /// A host gradient's block sums, as gradient_norm takes them (for a gradient kept elsewhere).
  [[nodiscard]] static std::vector<double> block_sums(Grad const* g, std::size_t n)
  {
    std::vector<double> sums((n + norm_block - 1) / norm_block);
    for (std::size_t i = 0; i < sums.size(); ++i) {
      sums[i] = sum_block(g + i * norm_block, std::min(norm_block, n - i * norm_block));
    }
    return sums;
  }

  /// The gradients' 2-norm (scaled as given): sums of squares over blocks of 4096 elements
  /// of each tensor (in double, in element order), then all blocks combined pairwise in
  /// (tensor, block) order: nothing depends on the chunking, the threads or the order the
  /// gradients came in.
  /// A gradient kept elsewhere during a streaming step (param_source::write_grad) enters
  /// through `kept`: per tensor, its block_sums() (empty for the others).
  template <class Device>
  [[nodiscard]] static double gradient_norm(grads_type grads, thread_pool& pool, Device* dev,
                                            std::span<std::vector<double> const> kept = {})
  {
    auto const sums = gradient_block_sums(grads, pool, dev, kept);
    return std::sqrt(pairwise_sum(sums.data(), sums.size()));
  }

  /// gradient_norm's block sums, in (tensor, block) order (for ranks that combine theirs).
  template <class Device>
  [[nodiscard]] static std::vector<double> gradient_block_sums(grads_type grads, thread_pool& pool, Device* dev,
                                                              std::span<std::vector<double> const> kept = {})
  {
    constexpr std::size_t block = norm_block;
    auto const kept_of = [&](std::size_t t) -> std::vector<double> const* {
      return t < kept.size() && !kept[t].empty() ? &kept[t] : nullptr;
    };
    std::vector<std::size_t> first(grads.size() + 1, 0);
    for (std::size_t t = 0; t < grads.size(); ++t) {
      std::size_t const n = grads[t].data == nullptr ? 0 : grads[t].size;
      first[t + 1]        = first[t] + (kept_of(t) != nullptr ? kept_of(t)->size() : (n + block - 1) / block);
    }
    std::vector<double> sums(first.back(), 0.0);
    for (std::size_t t = 0; t < grads.size(); ++t) {
      auto const& g = grads[t];
      if (auto const* k = kept_of(t)) {
        std::copy(k->begin(), k->end(), sums.begin() + static_cast<std::ptrdiff_t>(first[t]));
        continue;
      }
      if (g.data == nullptr || g.size == 0) { continue; }
      std::size_t const blocks = first[t + 1] - first[t];
      if (g.where == location::host) {
        pool.parallel_for(blocks, 1, [&](std::size_t b, std::size_t e) {
          for (std::size_t i = b; i < e; ++i) {
            sums[first[t] + i] = sum_block(g.data + i * block, std::min(block, g.size - i * block));
          }
        });
      } else if constexpr (Placement::device == routes::device_staging::pcie_rings) {
        // Copied a ring's worth of whole blocks at a time into the PCIe ring.
        std::size_t const per = std::max<std::size_t>(1, dev->grad_stage.size() / sizeof(Grad) / block);
        auto* stage           = reinterpret_cast<Grad*>(dev->grad_stage.data());
        for (std::size_t i = 0; i < blocks; i += per) {
          std::size_t const m        = std::min(per, blocks - i);
          std::size_t const elements = std::min(m * block, g.size - i * block);
          device::copy_async(stage, g.data + i * block, elements * sizeof(Grad), dev->d2h);
          dev->d2h.synchronize();
          pool.parallel_for(m, 1, [&](std::size_t b, std::size_t e) {
            for (std::size_t j = b; j < e; ++j) {
              sums[first[t] + i + j] = sum_block(stage + j * block, std::min(block, elements - j * block));
            }
          });
        }
      } else {
        throw logic_error("max_grad_norm: the norm of device gradients needs OnHost compute");
      }
    }
    return sums;
  }
};

}  // namespace tierstate::detail
