// SPDX-License-Identifier: Apache-2.0
// The delayed parameter update: the step runs beside the next forward and backward.
#pragma once

namespace tierstate::inline TIERSTATE_ABI {

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
step_result OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::step_delayed(
    std::span<grad_view<grad_type> const> grads,
                                              double grad_scale, device::stream_view ready)
{
  auto const t_start = std::chrono::steady_clock::now();
  checks::check_grads(grads, std::span<tensor_entry const>(tensors_));
  step_result const previous = flush();  // also the first place a failed update is reported
  store_.check_not_lost("step");
  auto coefficients = coefficients_for(grad_scale);
  materialize();
  std::size_t const total = store_.layout().total_elements();
  if (!delayed_) {
    auto dl    = std::make_unique<delayed_state>();
    dl.get()->grads  = PinnedHost(total * sizeof(grad_type));
    dl.get()->params = PinnedHost(total * sizeof(param_type));
    auto* params = reinterpret_cast<param_type*>(dl->params.data());
    for (std::size_t t = 0; t < tensors_.size(); ++t) {
      auto const& e = tensors_[t];
      param_type* to = params + store_.layout().tensors()[t].offset;
      if (e.where == location::device) {
        device::copy(to, e.param, e.count * sizeof(param_type));
      } else {
        std::copy(e.param, e.param + e.count, to);
      }
    }
    dl->views.resize(tensors_.size());
    delayed_ = std::move(dl);
  }
  auto& dl = *delayed_;
  // The gradients into the optimizer's own buffer: the caller may reuse theirs at once.
  auto* own = reinterpret_cast<grad_type*>(dl.grads.data());
  if constexpr (placement::device_params) {
    store_.device().ready.record(ready);
    store_.device().d2h.wait(store_.device().ready);
  } else {
    (void)ready;
  }
  // Host gradients are copied by the pool, in pieces of at most 16 Ki elements (a copy
  // of a model's gradients is memory-bound: one thread does not saturate the memory).
  struct host_copy {
    grad_type const* from;
    grad_type* to;
    std::size_t n;
  };
  std::vector<host_copy> pieces;
  constexpr std::size_t piece_elements = std::size_t{1} << 14;
  for (std::size_t t = 0; t < tensors_.size(); ++t) {
    auto const& g = grads[t];
    if (g.data == nullptr) {
      dl.views[t] = {};
      continue;
    }
    grad_type* to = own + store_.layout().tensors()[t].offset;
    if (g.where == location::device) {
      if constexpr (placement::device_params) { device::copy_async(to, g.data, g.size * sizeof(grad_type), store_.device().d2h); }
    } else {
      for (std::size_t b = 0; b < g.size; b += piece_elements) {
        pieces.push_back({g.data + b, to + b, std::min(piece_elements, g.size - b)});
      }
    }
    dl.views[t] = {to, g.size, location::host};
  }
  pool_.parallel_for(pieces.size(), 1, [&](std::size_t b, std::size_t e) {
    for (std::size_t i = b; i < e; ++i) { std::copy_n(pieces[i].from, pieces[i].n, pieces[i].to); }
  });
  if constexpr (placement::device_params) { store_.device().d2h.synchronize(); }

  step_result r;
  r.deferred = true;
  r.stats    = previous.stats;
  if (!check_and_clip(dl.views, grad_scale, coefficients, r)) {
    r.skipped = true;
    r.step    = step_;
    r.stats.total_seconds = detail::seconds_since(t_start);
    return r;
  }
  r.step          = ++step_;  // counted when started: a failure loses the state anyway
  dl.coefficients = std::move(coefficients);
  dl.result       = step_result{};
  dl.result.step  = step_;
  dl.worker       = std::thread([this] {
    auto& d          = *delayed_;
    auto const start = std::chrono::steady_clock::now();
    try {
      run_step(d.views, d.coefficients, d.result);
    } catch (...) {
      d.error = std::current_exception();
    }
    d.result.stats.total_seconds = detail::seconds_since(start);
  });
  return r;
}

}  // namespace tierstate
