// SPDX-License-Identifier: Apache-2.0
// The streaming step (begin_step, grad_ready, finish_step, flush): chunks updated as their
// gradients arrive.
#pragma once

namespace tierstate::inline TIERSTATE_ABI {

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
std::size_t OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::chunk_at(std::size_t j) const noexcept
{
  return streaming_ && streaming_->active ? streaming_->order[j] : j;
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::await_chunk(std::size_t k,
    step_stats& stats)
{
  if (!(streaming_ && streaming_->active)) { return; }
  auto& st      = *streaming_;
  auto const t0 = std::chrono::steady_clock::now();
  std::unique_lock lock(st.m);
  if (st.checks && !st.checked) {
    st.cv.wait(lock, [&] { return st.abandoned || st.finals == tensors_.size(); });
    if (st.abandoned) { throw logic_error("the optimizer was destroyed during a streaming step"); }
    st.checked = true;
    lock.unlock();
    stats.grad_wait_seconds += detail::seconds_since(t0);
    if constexpr (placement::device_params) {  // every gradient's device work first
      for (std::size_t t = 0; t < tensors_.size(); ++t) {
        if (st.views[t].where == location::device && st.views[t].data != nullptr) {
          store_.device().d2h.wait(*st.grad_events[t]);
          store_.device().compute.wait(*st.grad_events[t]);
        }
      }
    }
    if (!check_and_clip(st.views, st.grad_scale, st.coefficients, st.result)) {
      throw detail::skip_step_signal{};
    }
    return;
  }
  st.cv.wait(lock, [&] { return st.abandoned || st.ready[k] != 0; });
  if (st.abandoned) { throw logic_error("the optimizer was destroyed during a streaming step"); }
  lock.unlock();
  stats.grad_wait_seconds += detail::seconds_since(t0);
  if constexpr (placement::device_params) {  // the device work that made these gradients comes first
    for (auto const& pc : store_.pieces(k)) {
      std::size_t const t = pc.tensor;
      if (st.views[t].where == location::device && st.views[t].data != nullptr) {
        store_.device().d2h.wait(*st.grad_events[t]);
        store_.device().compute.wait(*st.grad_events[t]);
      }
    }
  }
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
bool OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::chunk_is_ready(std::size_t k)
{
  auto& st = *streaming_;
  std::lock_guard lock(st.m);
  return st.ready[k] != 0 && (!st.checks || st.checked);
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::check_not_streaming(
    char const* call) const
{
  if (in_step()) {
    throw logic_error(std::string(call).append(": a streaming step is in progress (begin_step without finish_step)"));
  }
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::begin_step(double grad_scale,
    unsigned micro_batches)
{
  detail::gate_entry const gate(gate_, "begin_step");
  check_not_streaming("begin_step");
  if (opts_.delayed_update) {
    throw logic_error("begin_step: streaming steps and delayed_update do not combine (the delayed "
                      "update already runs during the next forward and backward): call step()");
  }
  store_.check_not_lost("begin_step");
  if (micro_batches == 0) { throw invalid_option("micro_batches", "0", "must be >= 1"); }
  if (tensors_.empty()) { throw logic_error("begin_step: no tensor is registered: add_tensor first"); }
  auto coefficients = coefficients_for(grad_scale);  // refused values change nothing
  materialize();
  if (!streaming_) { streaming_ = std::make_unique<streaming_state>(); }
  auto& st            = *streaming_;
  std::size_t const n = store_.layout().chunk_count();
  std::size_t const T = tensors_.size();
  st.started          = std::chrono::steady_clock::now();
  st.abandoned        = false;
  st.checks  = opts_.on_nonfinite != nonfinite_policy::ignore || opts_.max_grad_norm > 0.0;
  st.checked = false;
  st.micro_batches = micro_batches;
  st.grad_scale    = grad_scale;
  st.views.assign(T, grad_view<grad_type>{});
  st.arrivals.assign(T, 0);
  st.final_.assign(T, 0);
  st.finals = 0;
  st.pending.resize(n);
  for (std::size_t k = 0; k < n; ++k) { st.pending[k] = store_.pieces(k).size(); }
  st.ready.assign(n, 0);
  st.arrival.clear();
  st.arrival.reserve(n);
  if (next_order_.size() == n) {
    st.order = next_order_;
  } else {  // backward's order: the last registered tensors' chunks first
    st.order.resize(n);
    for (std::size_t j = 0; j < n; ++j) { st.order[j] = n - 1 - j; }
  }
  if constexpr (placement::device_params) {
    while (st.grad_events.size() < T) { st.grad_events.push_back(std::make_unique<device::event>()); }
  }
  st.coefficients = std::move(coefficients);
  st.result       = step_result{};
  st.error        = nullptr;
  for (std::size_t t = 0; t < T; ++t) {
    if (tensors_[t].count == 0) {
      st.final_[t] = 1;
      ++st.finals;
    }
  }
  st.active = true;
  try {
    st.driver = std::thread([this] { drive_streaming_step(); });
  } catch (...) {
    st.active = false;
    throw;
  }
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::grad_ready(tensor_id t,
    grad_view<grad_type> g, device::stream_view ready)
{
  if (t >= tensors_.size()) {
    throw logic_error("grad_ready: there is no tensor " + std::to_string(t) + " (" +
                      std::to_string(tensors_.size()) + " registered)");
  }
  auto const& e  = tensors_[t];
  auto const who = "grad_ready: the gradient of tensor " + std::to_string(t) + " ('" + e.name + "')";
  checks::check_view(who, g, e);
  if (!streaming_) { throw logic_error("grad_ready: no streaming step is in progress (call begin_step)"); }
  auto& st = *streaming_;
  {
    std::lock_guard lock(st.m);
    if (!st.active) { throw logic_error("grad_ready: no streaming step is in progress (call begin_step)"); }
    if (e.count == 0) { return; }  // nothing to update: an empty tensor is final from begin_step on
    if (st.final_[t] != 0) {
      throw logic_error(who + " was already handed over " + std::to_string(st.arrivals[t]) +
                        " time(s), and micro_batches is " + std::to_string(st.micro_batches));
    }
    st.views[t] = g;
    if constexpr (placement::device_params) {
      // The gradient is final after the work queued on `ready` so far.
      if (g.where == location::device) { st.grad_events[t]->record(ready); }
    }
    if (++st.arrivals[t] == st.micro_batches) { mark_final(t); }
  }
  st.cv.notify_all();
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::mark_final(std::size_t t)
{
  auto& st     = *streaming_;
  st.final_[t] = 1;
  ++st.finals;
  std::size_t const ce    = store_.layout().chunk_elements();
  std::size_t const first = store_.layout().tensors()[t].offset / ce;
  std::size_t const last  = (store_.layout().tensors()[t].offset + tensors_[t].count - 1) / ce;
  for (std::size_t k = first; k <= last; ++k) {
    if (--st.pending[k] == 0) {  // its last tensor: the chunk may go
      st.ready[k] = 1;
      st.arrival.push_back(k);
    }
  }
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
step_result OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::finish_step()
{
  detail::gate_entry const gate(gate_, "finish_step");
  if (!in_step()) { throw logic_error("finish_step: no streaming step is in progress (call begin_step)"); }
  auto& st = *streaming_;
  {
    // Every tensor not handed over has no gradient this step.
    std::lock_guard lock(st.m);
    for (std::size_t t = 0; t < tensors_.size(); ++t) {
      if (st.final_[t] != 0) { continue; }
      st.views[t] = grad_view<grad_type>{};
      mark_final(t);
    }
  }
  st.cv.notify_all();
  st.driver.join();
  {
    std::lock_guard lock(st.m);
    st.active = false;
  }
  next_order_ = st.arrival;  // the next step follows the order this one's chunks came in
  if (st.error) { std::rethrow_exception(st.error); }
  step_result r         = st.result;
  r.stats.total_seconds = detail::seconds_since(st.started);
  return r;
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::drive_streaming_step()
{
  auto& st = *streaming_;
  try {
    run_step(st.views, st.coefficients, st.result);
    st.result.step = ++step_;
  } catch (detail::skip_step_signal const&) {
    st.result.skipped = true;
    st.result.step    = step_;
  } catch (...) {
    st.error = std::current_exception();
  }
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
step_result OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::flush()
{
  detail::gate_entry const gate(gate_, "flush");
  if (!delayed_ || !delayed_->worker.joinable()) { return {}; }
  auto& dl = *delayed_;
  dl.worker.join();
  if (dl.error) { std::rethrow_exception(std::exchange(dl.error, nullptr)); }
  // The update's params into the model.
  auto const* params = reinterpret_cast<param_type const*>(dl.params.data());
  for (std::size_t t = 0; t < tensors_.size(); ++t) {
    auto const& e          = tensors_[t];
    param_type const* from = params + store_.layout().tensors()[t].offset;
    if (e.where == location::device) {
      device::copy(e.param, from, e.count * sizeof(param_type));
    } else {
      std::copy(from, from + e.count, e.param);
    }
  }
  return dl.result;
}

}  // namespace tierstate
