// SPDX-License-Identifier: Apache-2.0
// The delayed parameter update (step/delayed_update.hpp): step() with delayed_update, and
// flush().
#pragma once

namespace tierstate::inline TIERSTATE_ABI {

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
step_result OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::step_delayed(std::span<grad_view<grad_type> const> grads, double grad_scale,
                                              device::stream_view ready)
{
  auto const t_start = std::chrono::steady_clock::now();
  checks::check_grads(grads, std::span<tensor_entry const>(tensors_));
  step_result const previous = flush();  // also the first place a failed update is reported
  store_.check_not_lost("step");
  auto coefficients = coefficients_for(grad_scale);
  rounding_step_    = step_ + 1;  // (the update runs after count_step: the key is this step's)
  materialize();
  if (!delayed_.made()) { delayed_.make(store_.layout(), std::span<tensor_entry const>(tensors_)); }
  device::stream* d2h = nullptr;
  if constexpr (placement::device_params) {  // device gradients: after the work queued on `ready`
    auto& d = store_.device();
    d.ready.record(ready);
    d.d2h.wait(d.ready);
    d2h = &d.d2h;
  } else {
    (void)ready;
  }
  delayed_.take(grads, store_.layout(), pool_, d2h);

  step_result r;
  r.deferred = true;
  r.stats    = previous.stats;
  detail::trace_scope checking(tracer_, trace_phase::check);
  bool const go = check_and_clip(delayed_.views(), grad_scale, coefficients, r);
  checking.done();
  if (!go) {
    r.skipped             = true;
    r.step                = step_;
    r.stats.total_seconds = detail::seconds_since(t_start);
    return r;
  }
  reduce_tensors(delayed_.views(), coefficients);
  count_step(delayed_.views());  // counted when started: a failure loses the state anyway
  r.step = step_;
  delayed_.start(std::move(coefficients), step_,
                 [this](std::span<grad_view<grad_type> const> views,
                        std::vector<coefficients_type>& coefficients,
                        step_result& result) {
                   // On the update's thread: its events are readable once flush() (or trace(nullptr)) returns.
                   detail::trace_scope const traced_step(tracer_, trace_phase::step);
                   run_step(views, coefficients, result);
                 });
  return r;
}

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
step_result OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::flush()
{
  detail::gate_entry const gate(gate_, "flush");
  if (!delayed_.running()) { return {}; }
  return delayed_.flush(store_.layout(), std::span<tensor_entry const>(tensors_));
}

}  // namespace tierstate
