// SPDX-License-Identifier: Apache-2.0
// The device compute's chunk update: its pieces' kernels queued on the compute stream (the
// routes that move the chunks: transfer/routes/).
#pragma once

namespace tierstate::inline TIERSTATE_ABI {

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::launch_chunk(std::size_t k,
    std::byte* chunk,
                                       std::span<grad_view<grad_type> const> grads,
                                       std::vector<coefficients_type> const& coefficients)
{
  if constexpr (placement::on_device) {
    using arrays_t = update_arrays<Precision, rule_type::slots.size()>;
    for (auto const& pc : store_.pieces(k)) {
      auto const& tensor = tensors_[pc.tensor];
      if (grads[pc.tensor].data == nullptr) { continue; }  // no gradient
      arrays_t a;
      a.param = tensor.param + pc.tensor_begin;
      a.grad  = grads[pc.tensor].data + pc.tensor_begin;
      store_.arrays_at(chunk, pc.chunk_begin, a);
      if constexpr (has_tensor_phase<rule_type>) {
        a.tensor_state  = tensor_state_for_update(pc.tensor);
        a.shape         = tensor.shape;
        a.tensor_offset = pc.tensor_begin;
      }
      if constexpr (Precision::has_stochastic_rounding) {
        a.tensor_offset = pc.tensor_begin;
        a.rounding_key  = codecs::rounding_key(opts_.rounding_seed, rounding_step_, pc.tensor);
      }
      Compute::template update_async<rule_type, Precision>(store_.device().compute, coefficients[pc.tensor], a,
                                                      pc.count);
    }
  } else {
    (void)k, (void)chunk, (void)grads, (void)coefficients;
  }
}

}  // namespace tierstate
