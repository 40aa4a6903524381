// SPDX-License-Identifier: Apache-2.0
// The optimizer's registry: construction, tensors and groups, and their hyperparameters.
// (OffloadedOptimizer's definitions: include/tierstate/optimizer.hpp includes these files in order.)
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>

namespace tierstate::inline TIERSTATE_ABI {
template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::OffloadedOptimizer(
    hyperparameters const& defaults, options const& opts)
  : opts_(opts), pool_(opts.threads, opts.bind_threads)
{
  validate_hyperparameters<rule_type>(defaults);
  if (opts.chunk_elements % layout::element_granularity != 0) {
    throw invalid_option("chunk_elements", detail::to_text(opts.chunk_elements),
                         "must be a multiple of 2048, so every slot array of a chunk is a whole number "
                         "of 4 KiB blocks (0: 2^20, or a loaded checkpoint's)");
  }
  if (!(opts.max_grad_norm >= 0.0) || !std::isfinite(opts.max_grad_norm)) {
    throw invalid_option("max_grad_norm", detail::to_text(opts.max_grad_norm),
                         "must be finite and >= 0 (0: no clipping)");
  }
  if (placement::on_device && opts.delayed_update) {
    throw invalid_option("delayed_update", "true",
                         "the delayed parameter update runs the update on the host: use OnHost compute");
  }
  if (placement::on_device && opts.max_grad_norm > 0.0) {
    throw invalid_option("max_grad_norm", detail::to_text(opts.max_grad_norm),
                         "clipping with OnDevice compute is not supported yet (the norm would need a "
                         "device reduction); clip in the framework, or compute on the host");
  }
  if (opts.shadow_state && (!can_shadow_state || opts.delayed_update)) {
    throw invalid_option("shadow_state", "true",
                         opts.delayed_update
                           ? "a shadowed state serves streaming steps, which delayed_update refuses"
                           : "needs params and gradients in host memory (not CudaOverlapped), a state tier that "
                             "is not (NvmeFile, a user's), OnHost compute, a precision with an fp32 master and a "
                             "rule without a tensor phase");
  }
  (void)detail::check_numa_node(opts.numa_node, "numa_node");  // (a node the machine lacks: refused now)
  if constexpr (std::is_same_v<StateTier, PinnedHost>) { (void)detail::check_numa_node(opts.tier.numa_node); }
  store_type::preflight(opts.tier);
  groups_.push_back(defaults);
}

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
auto OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::add_tensor(std::string name,
    param_type* param, std::size_t count,
                                     location where) -> tensor_id
{
  return add_tensor(std::move(name), param, tensor_shape::of_vector(count), where);
}

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
auto OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::add_tensor(std::string name,
    param_type* param, tensor_shape shape, location where) -> tensor_id
{
  detail::gate_entry const gate(gate_, "add_tensor");
  return register_tensor(std::move(name), param, shape, where, nullptr, 0);
}

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
auto OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::add_tensor(param_source<param_type>& source,
    std::size_t id, std::string name) -> tensor_id
{
  detail::gate_entry const gate(gate_, "add_tensor");
  std::string const& own = source.tensor_name(id);  // (refuses an id the source does not have)
  if (name.empty()) { name = own; }
  auto const who   = "add_tensor('" + name + "', offloaded)";
  if constexpr (placement::on_device) {
    throw logic_error(who + ": OnDevice compute updates params in device memory, and offloaded params rest in "
                            "their tier; use OnHost compute (with CudaOverlapped for device gradients)");
  }
  if (opts_.delayed_update) {
    throw logic_error(who + ": the delayed update keeps its own copy of every param; it does not take "
                            "offloaded params (set delayed_update = false)");
  }
  if constexpr (has_tensor_phase<rule_type>) {
    throw logic_error(who + ": rule " + std::string(rule_type::name) +
                      " reads whole tensors in its tensor phase, which offloaded params do not offer yet");
  }
  for (auto const& e : tensors_) {  // (under another name, it would be updated twice a step)
    if (e.source == &source && e.source_tensor == id) {
      throw logic_error(who + ": tensor '" + own + "' of this source is registered already, as '" + e.name + "'");
    }
  }
  std::size_t const count = source.tensor_size(id);
  return register_tensor(std::move(name), nullptr, tensor_shape::of_vector(count), location::host, &source, id);
}

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
auto OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::register_tensor(std::string name,
    param_type* param, tensor_shape shape, location where, param_source<param_type>* source,
    std::size_t source_tensor) -> tensor_id
{
  auto const who = "add_tensor('" + name + "')";
  auto const shape_text = [&] {
    return (shape.batches != 1 ? std::to_string(shape.batches) + " x " : std::string()) + std::to_string(shape.rows) +
           " x " + std::to_string(shape.columns);
  };
  constexpr std::size_t most = std::numeric_limits<std::size_t>::max();
  if ((shape.columns != 0 && shape.rows > most / shape.columns) ||
      (shape.rows * shape.columns != 0 && shape.batches > most / (shape.rows * shape.columns)) ||
      (shape.rows != 0 && shape.batches > most / shape.rows)) {
    throw logic_error(who + ": a shape of " + shape_text() + " has more elements than a std::size_t counts");
  }
  if (shape.batches == 0) {
    throw logic_error(who + ": a shape of " + shape_text() + " has no batches (a tensor without elements is a vector "
                            "of 0: tensor_shape::of_vector(0))");
  }
  if (shape.vector && (shape.rows != 1 || shape.batches != 1)) {
    throw logic_error(who + ": a vector's shape is one row of one batch, not " + shape_text());
  }
  std::size_t const count = shape.elements();
  if (store_.made()) {
    throw logic_error(who + ": the state already exists (after the first step or copy_state), "
                            "so the set of tensors is fixed");
  }
  if (name.empty()) { throw logic_error("add_tensor: the tensor name is empty"); }
  if (param == nullptr && source == nullptr && count > 0) {
    throw logic_error(who + ": param is a null pointer for " + std::to_string(count) + " elements");
  }
  if constexpr (!placement::device_params) {
    if (where != location::host) {
      throw logic_error(who + ": the param lives on the device; this composition keeps params on "
                              "the host (use the CudaOverlapped transfer, or OnDevice compute)");
    }
  }
  if constexpr (placement::on_device) {
    if (where != location::device) {
      throw logic_error(who + ": the param lives on the host; OnDevice compute updates params on "
                              "the device (register device memory with location::device)");
    }
  }
#if defined(TIERSTATE_ENABLE_CUDA)
  if (count > 0 && (where == location::device) != device::is_device_pointer(param)) {
    throw logic_error(who + ": registered as " + std::string(location_name(where)) +
                      " memory, but the CUDA runtime says the pointer is " +
                      (where == location::device ? "not device memory" : "device memory"));
  }
#endif
  if (index_.find(std::string_view(name)) != index_.end()) {
    throw logic_error(who + ": a tensor of that name is already registered");
  }
  std::size_t const id = tensors_.size();
  auto const [it, inserted] = index_.emplace(name, id);
  try {
    tensors_.push_back({std::move(name), param, count, 0, where, shape, 0, source, source_tensor});
    if (source != nullptr && std::find(sources_.begin(), sources_.end(), source) == sources_.end()) {
      try {
        sources_.push_back(source);
      } catch (...) {
        tensors_.pop_back();
        throw;
      }
    }
  } catch (...) {
    index_.erase(it);  // a refused call leaves the registry as it was
    throw;
  }
  return id;
}

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
auto OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::add_group(hyperparameters const& h,
                                    std::vector<std::string> const& tensor_names) -> group_id
{
  detail::gate_entry const gate(gate_, "add_group");
  validate_hyperparameters<rule_type>(h);
  if (tensor_names.empty()) { throw logic_error("add_group: the group names no tensor"); }
  std::vector<std::size_t> members;
  members.reserve(tensor_names.size());
  for (auto const& n : tensor_names) {
    std::size_t const t = find_tensor(n, "add_group");
    if (tensors_[t].group != 0) {
      throw logic_error("add_group: tensor '" + n + "' is already in group " +
                        std::to_string(tensors_[t].group) + "; a tensor belongs to one group");
    }
    members.push_back(t);
  }
  {
    std::vector<std::size_t> sorted = members;
    std::sort(sorted.begin(), sorted.end());
    auto const twice = std::adjacent_find(sorted.begin(), sorted.end());
    if (twice != sorted.end()) {
      throw logic_error("add_group: tensor '" + tensors_[*twice].name + "' is named twice");
    }
  }
  groups_.push_back(h);
  for (std::size_t const t : members) { tensors_[t].group = groups_.size() - 1; }
  return groups_.size() - 1;
}

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::set_hyperparameters(group_id g,
    hyperparameters const& h)
{
  detail::gate_entry const gate(gate_, "set_hyperparameters");
  check_not_streaming("set_hyperparameters");
  if (g >= groups_.size()) {
    throw logic_error("set_hyperparameters: there is no group " + std::to_string(g) + " (" +
                      std::to_string(groups_.size()) + " groups)");
  }
  validate_hyperparameters<rule_type>(h);
  groups_[g] = h;
}

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
auto OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::get_hyperparameters(
    group_id g) const -> hyperparameters const&
{
  if (g >= groups_.size()) {
    throw logic_error("get_hyperparameters: there is no group " + std::to_string(g));
  }
  return groups_[g];
}

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
auto OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::group_of(
    std::string_view tensor) const -> group_id
{
  return tensors_[find_tensor(tensor, "group_of")].group;
}

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
std::size_t OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::find_tensor(
    std::string_view name, char const* caller) const
{
  if (auto const it = index_.find(name); it != index_.end()) { return it->second; }
  throw logic_error(std::string(caller) + ": no tensor named '" + std::string(name) +
                    "' is registered");
}

}  // namespace tierstate
