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
    constexpr std::size_t first_rule_slot = Precision::leading_slots;
    for (auto const& pc : store_.pieces(k)) {
      auto const& tensor = tensors_[pc.tensor];
      if (grads[pc.tensor].data == nullptr) { continue; }  // no gradient
      arrays_t a;
      a.param = tensor.param + pc.tensor_begin;
      a.grad  = grads[pc.tensor].data + pc.tensor_begin;
      if constexpr (Precision::has_master) {
        a.master = reinterpret_cast<float*>(chunk + store_.layout().slot_offset(0)) + pc.chunk_begin;
      } else if constexpr (Precision::has_compensation) {
        a.compensation = reinterpret_cast<bf16*>(chunk + store_.layout().slot_offset(0)) + pc.chunk_begin;
      }
      std::array<std::byte*, rule_type::slots.size()> state{};
      for (std::size_t j = 0; j < rule_type::slots.size(); ++j) {
        state[j] = chunk + store_.layout().slot_offset(first_rule_slot + j);
      }
      state_arrays_at(state, pc.chunk_begin, a.state);
      if constexpr (has_tensor_phase<rule_type>) {
        a.tensor_state  = tensor_state_for_update(pc.tensor);
        a.shape         = tensor.shape;
        a.tensor_offset = pc.tensor_begin;
      }
      Compute::template update_async<rule_type, Precision>(store_.device().compute, coefficients[tensor.group], a,
                                                      pc.count);
    }
  } else {
    (void)k, (void)chunk, (void)grads, (void)coefficients;
  }
}

}  // namespace tierstate
