// SPDX-License-Identifier: Apache-2.0
// The delayed parameter update (optimizer_options::delayed_update): step() takes a copy of
// the gradients, starts the update on a thread of its own and returns at once; the update
// writes the params into the component's own buffer, and the next step (or flush) waits for
// it and writes them into the model. The model thus trains one step behind its optimizer,
// while the update overlaps the next forward and backward.
#pragma once

#include <tierstate/core/device_runtime.hpp>
#include <tierstate/core/layout.hpp>
#include <tierstate/core/stats.hpp>
#include <tierstate/core/tensor.hpp>
#include <tierstate/core/thread_pool.hpp>
#include <tierstate/tiers/pinned_host.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <span>
#include <thread>
#include <utility>
#include <vector>

namespace tierstate::inline TIERSTATE_ABI::detail {

/// `DeviceParams`: params and gradients may be device memory (copied over the d2h stream).
template <class Grad, class Param, class Coefficients, bool DeviceParams>
class delayed_update {
 public:
  delayed_update() = default;
  ~delayed_update() { wait(); }
  delayed_update(delayed_update const&)            = delete;
  delayed_update& operator=(delayed_update const&) = delete;

  /// Waits for an update in flight, if any, leaving its outcome for flush.
  void wait() noexcept
  {
    if (worker_.joinable()) { worker_.join(); }
  }

  /// Whether the buffers exist: from the first delayed step until discard.
  [[nodiscard]] bool made() const noexcept { return made_; }
  /// Whether an update was started and not yet flushed.
  [[nodiscard]] bool running() const noexcept { return worker_.joinable(); }
  /// Where the update reads and writes the params of the tensor at `offset` in the layout.
  [[nodiscard]] Param* params(std::size_t offset) const noexcept { return params_at_ + offset; }
  /// The gradients of the update, in the component's own buffer.
  [[nodiscard]] std::span<grad_view<Grad> const> views() const noexcept { return views_; }

  /// Makes the buffers (one gradient and one param per element, in layout order), the params
  /// read from the model as they are now.
  template <class Entry>
  void make(layout const& lay, std::span<Entry const> tensors)
  {
    std::size_t const total = lay.total_elements();
    PinnedHost grads(total * sizeof(Grad));
    PinnedHost params(total * sizeof(Param));
    auto* p = reinterpret_cast<Param*>(params.data());
    for (std::size_t t = 0; t < tensors.size(); ++t) {
      auto const& e = tensors[t];
      Param* to     = p + lay.tensors()[t].offset;
      if (e.where == location::device) {
        device::copy(to, e.param, e.count * sizeof(Param));
      } else {
        std::copy(e.param, e.param + e.count, to);
      }
    }
    grads_     = std::move(grads);
    params_    = std::move(params);
    params_at_ = p;
    views_.assign(tensors.size(), grad_view<Grad>{});
    made_ = true;
  }

  /// Back to no buffers (load writes the params; the next delayed step reads them anew).
  void discard() noexcept
  {
    grads_  = PinnedHost{0};
    params_    = PinnedHost{0};
    params_at_ = nullptr;
    views_.clear();
    made_ = false;
  }

  /// Copies the step's gradients into the component's buffer (the caller may reuse theirs
  /// at once): host gradients by the pool, device ones over `d2h` (after the work queued on
  /// it so far), and waits for both.
  void take(std::span<grad_view<Grad> const> grads, layout const& lay, thread_pool& pool, device::stream* d2h)
  {
    auto* own = reinterpret_cast<Grad*>(grads_.data());
    // Host gradients are copied by the pool, in pieces of at most 16 Ki elements (a copy
    // of a model's gradients is memory-bound: one thread does not saturate the memory).
    struct host_copy {
      Grad const* from;
      Grad* to;
      std::size_t n;
    };
    std::vector<host_copy> pieces;
    constexpr std::size_t piece_elements = std::size_t{1} << 14;
    for (std::size_t t = 0; t < grads.size(); ++t) {
      auto const& g = grads[t];
      if (g.data == nullptr) {
        views_[t] = {};
        continue;
      }
      Grad* to = own + lay.tensors()[t].offset;
      if (g.where == location::device) {
        if constexpr (DeviceParams) { device::copy_async(to, g.data, g.size * sizeof(Grad), *d2h); }
      } else {
        for (std::size_t b = 0; b < g.size; b += piece_elements) {
          pieces.push_back({g.data + b, to + b, std::min(piece_elements, g.size - b)});
        }
      }
      views_[t] = {to, g.size, location::host};
    }
    pool.parallel_for(pieces.size(), 1, [&](std::size_t b, std::size_t e) {
      for (std::size_t i = b; i < e; ++i) { std::copy_n(pieces[i].from, pieces[i].n, pieces[i].to); }
    });
    if constexpr (DeviceParams) {
      d2h->synchronize();
    } else {
      (void)d2h;
    }
  }

  /// Starts run(views, coefficients, result) on the update's thread, for step number `step`.
  template <class Run>
  void start(std::vector<Coefficients> coefficients, std::int64_t step, Run&& run)
  {
    coefficients_ = std::move(coefficients);
    result_       = step_result{};
    result_.step  = step;
    worker_       = std::thread([this, run = std::forward<Run>(run)]() mutable {
      auto const start = std::chrono::steady_clock::now();
      try {
        run(views(), coefficients_, result_);
      } catch (...) {
        error_ = std::current_exception();
      }
      result_.stats.total_seconds = seconds_since(start);
    });
  }

  /// Waits for the update started last, rethrows its failure, or writes its params into the
  /// model and returns its result.
  template <class Entry>
  step_result flush(layout const& lay, std::span<Entry const> tensors)
  {
    worker_.join();
    if (error_) { std::rethrow_exception(std::exchange(error_, nullptr)); }
    for (std::size_t t = 0; t < tensors.size(); ++t) {
      auto const& e      = tensors[t];
      Param const* from  = params(lay.tensors()[t].offset);
      if (e.where == location::device) {
        device::copy(e.param, from, e.count * sizeof(Param));
      } else {
        std::copy(from, from + e.count, e.param);
      }
    }
    return result_;
  }

 private:
  bool made_ = false;
  PinnedHost grads_{0};   ///< every tensor's gradient, in layout order
  PinnedHost params_{0};  ///< every tensor's params as the update leaves them, in layout order
  Param* params_at_ = nullptr;  ///< params_'s elements
  std::vector<grad_view<Grad>> views_;
  std::vector<Coefficients> coefficients_;
  step_result result_;
  std::exception_ptr error_;
  std::thread worker_;  ///< declared last
};

}  // namespace tierstate::detail
