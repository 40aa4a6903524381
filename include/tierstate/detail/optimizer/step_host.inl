// SPDX-License-Identifier: Apache-2.0
// The step's dispatch (run_step): the transfer's schedule over the composition's route
// (transfer/routes/route.hpp); the host update of a range of a chunk; the coefficients.
#pragma once

namespace tierstate::inline TIERSTATE_ABI {

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::update_chunk_range(std::size_t k,
    std::byte* chunk, std::size_t b, std::size_t e,
                                             std::span<grad_view<grad_type> const> grads,
                                             std::vector<coefficients_type> const& coefficients,
                                             grad_type const* grad_stage, param_type* param_stage)
{
  if constexpr (placement::on_device) {  // the device routes launch kernels instead (step_device.inl)
    (void)k, (void)chunk, (void)b, (void)e, (void)grads, (void)coefficients, (void)grad_stage, (void)param_stage;
  } else {
    using arrays_t = update_arrays<Precision, rule_type::slots.size()>;
    // The pieces (tensor parts) of chunk k that overlap [b, e), each with its tensor's coefficients.
    for (auto const& pc : store_.pieces(k)) {
      std::size_t const lo = std::max(b, pc.chunk_begin);
      std::size_t const hi = std::min(e, pc.chunk_begin + pc.count);
      if (lo >= hi) { continue; }
      bool const kept = streaming_.stashed(pc.tensor);  // (the gradient rests in the tensor's source)
      if (grads[pc.tensor].data == nullptr && !kept) { continue; }  // no gradient
      std::size_t const tofs = pc.tensor_begin + (lo - pc.chunk_begin);
      auto const& tensor     = tensors_[pc.tensor];
      arrays_t a;
      std::vector<grad_type> kept_grad;  // (read here unless the route read the chunk's into grad_stage)
      if constexpr (keeps_grads_in_sources) {
        if (kept && grad_stage == nullptr) {
          kept_grad.resize(hi - lo);
          tensor.source->read_grad(tensor.source_tensor, tofs, kept_grad);
        }
      }
      std::vector<param_type> offloaded;  // params that rest in a param_source: read, updated, written back
      if (tensor.source != nullptr) {
        offloaded.resize(hi - lo);
        if constexpr (!Precision::has_master) { tensor.source->read(tensor.source_tensor, tofs, offloaded); }
        a.param = offloaded.data();
      } else {
        a.param = update_params_on_device(pc.tensor) ? param_stage + lo : update_params(pc.tensor) + tofs;
      }
      a.grad   = kept ? (grad_stage != nullptr ? grad_stage + lo : kept_grad.data())
                 : grads[pc.tensor].where == location::device ? grad_stage + lo
                                                              : grads[pc.tensor].data + tofs;
      store_.arrays_at(chunk, lo, a);
      if constexpr (has_tensor_phase<rule_type>) {
        a.tensor_state  = tensor_state_for_update(pc.tensor);
        a.shape         = tensor.shape;
        a.tensor_offset = tofs;
      }
      if constexpr (Precision::has_stochastic_rounding) {
        a.tensor_offset = tofs;
        a.rounding_key  = codecs::rounding_key(opts_.rounding_seed, rounding_step_, pc.tensor);
      }
      Compute::template update_range<rule_type, Precision>(coefficients[pc.tensor], a, 0, hi - lo);
      if (tensor.source != nullptr) { tensor.source->write(tensor.source_tensor, tofs, offloaded); }
    }
  }
}

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
step_result OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::step(
    std::span<grad_view<grad_type> const> grads, double grad_scale,
                                     device::stream_view ready)
{
  detail::gate_entry const gate(gate_, "step");
  auto const t_start = std::chrono::steady_clock::now();
  check_not_streaming("step");
  if (opts_.delayed_update) { return step_delayed(grads, grad_scale, ready); }
  store_.check_not_lost("step");
  checks::check_grads(grads, std::span<tensor_entry const>(tensors_));
  // Every group's coefficients first: a refused hyper-parameter or scale changes nothing.
  auto coefficients = coefficients_for(grad_scale);
  detail::flush_sources(sources_);  // a param write of the user's that failed behind: refused here, nothing changed
  detail::trace_scope const traced_step(tracer_, trace_phase::step);  // (a refused step records nothing)
  rounding_step_ = step_ + 1;
  materialize();

  if constexpr (placement::device_params) {
    // Device gradients are read after the work queued on `ready` so far.
    auto& d = store_.device();
    d.ready.record(ready);
    d.compute.wait(d.ready);
    d.d2h.wait(d.ready);
    d.h2d.wait(d.ready);
  }
  step_result result;
  detail::trace_scope checking(tracer_, trace_phase::check);
  bool const go = check_and_clip(grads, grad_scale, coefficients, result);
  checking.done();
  if (!go) {
    result.skipped             = true;
    result.step                = step_;
    result.stats.total_seconds = detail::seconds_since(t_start);
    return result;
  }
  reduce_tensors(grads, coefficients);
  run_step(grads, coefficients, result);
  count_step(grads);
  result.step                = step_;
  result.stats.total_seconds = detail::seconds_since(t_start);
  io_watch_.observe(result.stats, StateTier::name);
  return result;
}

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::reduce_tensors(
    std::span<grad_view<grad_type> const> grads, std::vector<coefficients_type> const& coefficients)
{
  if constexpr (has_tensor_phase<rule_type>) {
    detail::trace_scope const traced(tracer_, trace_phase::reduce);
    tensor_phase_.reduce(grads, std::span<tensor_entry const>(tensors_), coefficients, pool_,
                         [this](void* to, void const* from, std::size_t bytes) {
                           if constexpr (placement::device_params) {  // after the gradients' own work
                             auto& d = store_.device();
                             device::copy_async(to, from, bytes, d.d2h);
                             d.d2h.synchronize();
                           } else {  // (check_grads refuses device gradients here; params are on the host)
                             (void)this, (void)to, (void)from, (void)bytes;
                           }
                         });
    if constexpr (placement::on_device) {  // the kernels read it on the device
      auto& d          = store_.device();
      auto const next  = tensor_phase_.next();
      std::size_t const bytes = next.size() * sizeof(float);
      if (d.tensor_state == nullptr && bytes > 0) {
        d.tensor_state = static_cast<float*>(device::allocate_async(bytes, d.compute));
      }
      if (bytes > 0) { device::copy_async(d.tensor_state, next.data(), bytes, d.compute); }
    }
  } else {
    (void)grads, (void)coefficients;
  }
}

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
float const* OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::tensor_state_for_update(
    std::size_t t) noexcept
{
  if constexpr (placement::on_device) {
    return store_.device().tensor_state + tensor_phase_.offset_of(t);
  } else {
    return tensor_phase_.next_of(t);
  }
}

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
auto OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::coefficients_for(
    double grad_scale) const
  -> std::vector<coefficients_type>
{
  // Per tensor: its group's numbers at its own next step. Tensors mostly share both with the
  // tensor before them, whose coefficients are then copied rather than made again.
  std::vector<coefficients_type> coefficients;
  coefficients.reserve(tensors_.size());
  for (std::size_t t = 0; t < tensors_.size(); ++t) {
    auto const& e = tensors_[t];
    if (t > 0 && e.group == tensors_[t - 1].group && e.step == tensors_[t - 1].step) {
      coefficients.push_back(coefficients.back());
    } else {
      coefficients.push_back(rule_type::coefficients_for(groups_[e.group], e.step + 1, grad_scale));
    }
  }
  if (tensors_.empty()) {  // a refused scale is refused all the same
    for (auto const& h : groups_) { (void)rule_type::coefficients_for(h, step_ + 1, grad_scale); }
  }
  return coefficients;
}

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::count_step(
    std::span<grad_view<grad_type> const> grads) noexcept
{
  ++step_;
  for (std::size_t t = 0; t < tensors_.size(); ++t) {
    if (grads[t].data != nullptr || streaming_.stashed(t)) { ++tensors_[t].step; }
  }
}

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::run_step(
    std::span<grad_view<grad_type> const> grads,
                                   std::vector<coefficients_type>& coefficients,
                                   step_result& result)
{
  bool changed = false;  // whether a chunk's params and state began to change
  // The transfer's schedule over the composition's route (transfer/concept.hpp).
  using route_type = routes::route_of<OffloadedOptimizer>;
  try {
    route_type route(*this, grads, coefficients, result.stats, changed);
    try {
      Transfer::schedule(route);
      detail::flush_sources(sources_);  // (a param write that failed behind fails the step)
    } catch (...) {
      route.abandon();  // no staging buffer in the tier's hands when the exception leaves
      throw;
    }
    tensor_phase_.commit();  // every chunk updated: the tensor phase's result is the state now
  } catch (std::exception const& e) {  // (a shadowed step's state is intact: its driver undoes the rest)
    if (changed && !store_.shadowing()) { store_.mark_lost(e.what()); }
    throw;
  } catch (...) {
    if (changed && !store_.shadowing()) { store_.mark_lost("an exception that is not a std::exception"); }
    throw;
  }
}

}  // namespace tierstate
