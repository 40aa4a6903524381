// SPDX-License-Identifier: Apache-2.0
// The optimizer's state calls (copy_state, write_state, set_step_count, state_layout,
// state_tier) over its state store (state/store.hpp), and where the update writes params.
#pragma once

namespace tierstate::inline TIERSTATE_ABI {

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::materialize(bool fill_master,
                                                                                    std::size_t chunk_elements)
{
  store_.make(tensors_, opts_.tier, chunk_elements != 0 ? chunk_elements : opts_.chunk_elements, fill_master,
              opts_.shadow_state, opts_.progress, opts_.numa_node);
  tensor_phase_.make(std::span<tensor_entry const>(tensors_));
}

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
std::size_t OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::tensor_state_size(std::string_view tensor)
{
  detail::gate_entry const gate(gate_, "tensor_state_size");
  std::size_t const t = find_tensor(tensor, "tensor_state_size");
  if constexpr (has_tensor_phase<rule_type>) {
    return rule_type::tensor_state_size(tensors_[t].shape);
  } else {
    return 0;
  }
}

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::copy_tensor_state(std::string_view tensor,
    std::span<float> to)
{
  detail::gate_entry const gate(gate_, "copy_tensor_state");
  check_not_streaming("copy_tensor_state");
  flush();
  std::size_t const t = find_tensor(tensor, "copy_tensor_state");
  if constexpr (has_tensor_phase<rule_type>) {
    std::size_t const n = rule_type::tensor_state_size(tensors_[t].shape);
    if (to.size() != n) {
      throw logic_error("copy_tensor_state('" + tensors_[t].name + "'): the span has " + std::to_string(to.size()) +
                        " floats; the tensor's state has " + std::to_string(n));
    }
    materialize();
    auto const from = tensor_phase_.state(t);
    std::copy(from.begin(), from.end(), to.begin());
  } else {
    (void)to;
    throw logic_error("copy_tensor_state('" + tensors_[t].name + "'): rule " + std::string(rule_type::name) +
                      " keeps no per-tensor state (it has no tensor phase)");
  }
}

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::write_tensor_state(std::string_view tensor,
    std::span<float const> from)
{
  detail::gate_entry const gate(gate_, "write_tensor_state");
  check_not_streaming("write_tensor_state");
  flush();
  std::size_t const t = find_tensor(tensor, "write_tensor_state");
  if constexpr (has_tensor_phase<rule_type>) {
    std::size_t const n = rule_type::tensor_state_size(tensors_[t].shape);
    if (from.size() != n) {
      throw logic_error("write_tensor_state('" + tensors_[t].name + "'): the span has " +
                        std::to_string(from.size()) + " floats; the tensor's state has " + std::to_string(n));
    }
    materialize();
    auto const to = tensor_phase_.state(t);
    std::copy(from.begin(), from.end(), to.begin());
  } else {
    (void)from;
    throw logic_error("write_tensor_state('" + tensors_[t].name + "'): rule " + std::string(rule_type::name) +
                      " keeps no per-tensor state (it has no tensor phase)");
  }
}

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
std::size_t OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::staging_bytes() const noexcept
{
  return store_.staging_bytes();
}

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
std::size_t OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::device_staging_bytes() const noexcept
{
  return store_.device_staging_bytes();
}

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
auto OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::update_params(std::size_t t) const noexcept -> param_type*
{
  return delayed_.made() ? delayed_.params(store_.layout().tensors()[t].offset) : tensors_[t].param;
}

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
bool OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::update_params_on_device(std::size_t t) const noexcept
{
  return !delayed_.made() && tensors_[t].where == location::device;
}

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::copy_state(std::string_view tensor,
    slot s, std::span<float> to)
{
  detail::gate_entry const gate(gate_, "copy_state");
  check_not_streaming("copy_state");
  flush();
  store_.check_not_lost("copy_state");
  std::size_t const t = find_tensor(tensor, "copy_state");
  if (to.size() != tensors_[t].count) {  // checked before the state is made: a refusal changes nothing
    throw logic_error("copy_state('" + tensors_[t].name + "'): the span has " + std::to_string(to.size()) +
                      " elements; the tensor has " + std::to_string(tensors_[t].count));
  }
  check_slot(s, "copy_state");
  materialize();
  store_.read_slot(t, store_.layout().slot_index(s), to);
}

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::check_slot(slot s,
    char const* call) const
{
  bool const kept = (Precision::has_master && s == slot::master) ||
                    (Precision::has_compensation && s == slot::compensation) ||
                    std::find(rule_type::slots.begin(), rule_type::slots.end(), s) != rule_type::slots.end();
  if (!kept) {
    throw logic_error(std::string(call) + ": this optimizer keeps no slot " + std::string(slot_name(s)) +
                      (s != slot::master     ? ""
                       : Precision::has_compensation ? " (its bf16 params are their own master, with slot compensation)"
                       : Precision::has_stochastic_rounding ? " (its bf16 params are their own master, rounded stochastically)"
                                                     : " (fp32 params are their own master)"));
  }
}

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::trace(tracer* t)
{
  detail::gate_entry const gate(gate_, "trace");
  check_not_streaming("trace");
  flush();
  tracer_ = detail::traced(t);
}

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::set_step_count(std::int64_t n)
{
  detail::gate_entry const gate(gate_, "set_step_count");
  check_not_streaming("set_step_count");
  if (n < 0 || n > detail::max_step_count) {
    throw invalid_option("step_count", detail::to_text(n), "the step count must be in [0, 2^53]");
  }
  flush();
  step_ = n;
  for (auto& e : tensors_) { e.step = n; }
}

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::set_step_count(std::string_view tensor,
                                                                                       std::int64_t n)
{
  detail::gate_entry const gate(gate_, "set_step_count");
  check_not_streaming("set_step_count");
  std::size_t const t = find_tensor(tensor, "set_step_count");
  if (n < 0 || n > detail::max_step_count) {
    throw invalid_option("step_count", detail::to_text(n),
                         "the step count of tensor '" + std::string(tensor) + "' must be in [0, 2^53]");
  }
  flush();
  tensors_[t].step = n;
}

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
std::int64_t OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::step_count(
    std::string_view tensor) const
{
  check_not_streaming("step_count");  // the step's driver counts it before finish_step
  return tensors_[find_tensor(tensor, "step_count")].step;
}

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::write_state(std::string_view tensor,
    slot s, std::span<float const> from)
{
  detail::gate_entry const gate(gate_, "write_state");
  check_not_streaming("write_state");
  flush();
  store_.check_not_lost("write_state");
  std::size_t const t = find_tensor(tensor, "write_state");
  if (from.size() != tensors_[t].count) {  // checked before the state is made: a refusal changes nothing
    throw logic_error("write_state('" + tensors_[t].name + "'): the span has " + std::to_string(from.size()) +
                      " elements; the tensor has " + std::to_string(tensors_[t].count));
  }
  check_slot(s, "write_state");
  materialize();
  store_.write_slot(t, store_.layout().slot_index(s), from);
}

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
layout const& OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::state_layout()
{
  detail::gate_entry const gate(gate_, "state_layout");
  materialize();
  return store_.layout();
}

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
StateTier& OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::state_tier()
{
  detail::gate_entry const gate(gate_, "state_tier");
  materialize();
  return store_.tier();
}

}  // namespace tierstate
