// SPDX-License-Identifier: Apache-2.0
// A checkpoint's header: made from the layout, checked against it on load, and the I/O
// engine a save or load uses.
#pragma once

namespace tierstate::inline TIERSTATE_ABI {

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
checkpoint::header OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::make_header() const
{
  return make_header(store_.layout());
}

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
checkpoint::header OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::make_header(
    layout const& lay) const
{
  checkpoint::header h;
  h.rule           = std::string(rule_type::name);
  h.precision      = Precision::name();
  for (auto const& row : rule_type::hyperparameter_table) { h.hyperparameter_names.emplace_back(row.name); }
  h.step           = step_;
  h.chunk_elements = lay.chunk_elements();
  h.chunk_bytes    = lay.chunk_bytes();
  h.chunk_count    = lay.chunk_count();
  h.total_elements = lay.total_elements();
  for (std::size_t i = 0; i < lay.slots().size(); ++i) {
    auto const& f = lay.slot_format_of(i);
    h.slots.push_back({slot_id(lay.slots()[i]), static_cast<std::uint32_t>(f.block_bytes),
                       std::string(slot_name(lay.slots()[i])), std::string(f.codec),
                       static_cast<std::uint32_t>(f.block)});
  }
  for (std::size_t t = 0; t < tensors_.size(); ++t) {
    auto const& e = tensors_[t];
    h.tensors.push_back({e.name, lay.tensors()[t].offset, e.count, e.group, e.step, e.shape.rows, e.shape.columns,
                         e.shape.batches, e.shape.vector});
  }
  for (std::size_t t = 0; t < tensors_.size(); ++t) {  // offloaded params: the file keeps them
    if (tensors_[t].source != nullptr) { h.param_tensors.push_back(t); }
  }
  h.param_bytes      = h.param_tensors.empty() ? 0 : static_cast<std::uint32_t>(sizeof(param_type));
  h.values_per_group = static_cast<std::uint32_t>(rule_type::hyperparameter_table.size());
  for (auto const& g : groups_) {
    auto const v = hyperparameter_values<rule_type>(g);
    h.groups.emplace_back(v.begin(), v.end());
  }
  if constexpr (has_tensor_phase<rule_type>) {  // (zeros before the state is made)
    for (std::size_t t = 0; t < tensors_.size(); ++t) {
      auto const shape = tensors_[t].shape;
      h.tensor_states.emplace_back();
      auto& values = h.tensor_states.back().values;
      if (tensor_phase_.made()) {
        auto const s = tensor_phase_.state(t);
        values.assign(s.begin(), s.end());
      } else {
        values.assign(rule_type::tensor_state_size(shape), 0.0f);
      }
    }
  }
  return h;
}

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::check_header(
    checkpoint::header const& h, layout const& lay, std::string const& path) const
{
  using detail::quoted;
  auto differ = [&](std::string const& what, std::string const& there, std::string const& here) {
    throw checkpoint_error(path, "was saved with " + what + " " + there + ", and this optimizer has " + here);
  };
  if (h.rule != rule_type::name) { differ("rule", quoted(h.rule), quoted(std::string(rule_type::name))); }
  if (h.precision != Precision::name()) { differ("precision", detail::clipped(h.precision), Precision::name()); }
  auto const mine = make_header(lay);
  if (h.version >= 2 && h.hyperparameter_names != mine.hyperparameter_names) {
    auto list = [](std::vector<std::string> const& names) {
      std::string s = "(";
      for (auto const& n : names) { s += (s.size() > 1 ? ", " : "") + detail::clipped(n); }
      return s + ")";
    };
    differ("the hyper-parameters", list(h.hyperparameter_names),
           std::string(rule_type::name) + "'s " + list(mine.hyperparameter_names));
  }
  if (h.slots.size() != mine.slots.size()) {
    differ("slot count", std::to_string(h.slots.size()), std::to_string(mine.slots.size()));
  }
  for (std::size_t i = 0; i < h.slots.size(); ++i) {
    auto const& a = h.slots[i];
    auto const& b = mine.slots[i];
    if (a.id != b.id || a.element_bytes != b.element_bytes ||
        (h.version >= 2 && (a.name != b.name || a.codec != b.codec || a.block != b.block))) {
      auto describe = [&](checkpoint::header::slot_entry const& e, bool named) {
        return "(" + (named ? detail::clipped(e.name) + ": " : std::string()) + "id " + std::to_string(e.id) +
               (named ? ", codec " + quoted(e.codec) + ", blocks of " + std::to_string(e.block) : "") + ", " +
               std::to_string(e.element_bytes) + " bytes)";
      };
      differ("slot " + std::to_string(i), describe(a, h.version >= 2), describe(b, true));
    }
  }
  if (!h.param_tensors.empty() && h.param_bytes != sizeof(param_type)) {
    differ("params of", std::to_string(h.param_bytes) + " bytes", std::to_string(sizeof(param_type)) + "-byte params");
  }
  if (h.tensors.size() != mine.tensors.size()) {
    differ("tensor count", std::to_string(h.tensors.size()), std::to_string(mine.tensors.size()));
  }
  for (std::size_t t = 0; t < h.tensors.size(); ++t) {
    auto const& a = h.tensors[t];
    auto const& b = mine.tensors[t];
    if (a.name != b.name || a.count != b.count || a.offset != b.offset) {
      differ("tensor " + std::to_string(t), quoted(a.name) + " of " + std::to_string(a.count) + " elements",
             quoted(b.name) + " of " + std::to_string(b.count) + " elements");
    }
    // (a.rows * a.batches: "dims" divided "tens"'s rows by batches, which it checked)
    std::uint64_t const rows = a.rows * a.batches;
    bool const shape_fits = a.columns == 0 ? a.count == 0 : a.count % a.columns == 0 && a.count / a.columns == rows;
    auto const shape_text = [&](checkpoint::header::tensor_entry const& e) {
      if (!h.dims_recorded) { return std::to_string(e.rows * e.batches) + " x " + std::to_string(e.columns); }
      return (e.batches != 1 ? std::to_string(e.batches) + " x " : std::string()) + std::to_string(e.rows) + " x " +
             std::to_string(e.columns) + (e.vector ? " (a vector)" : "");
    };
    if (h.shapes_recorded && (!shape_fits || (a.vector && (a.rows != 1 || a.batches != 1)))) {
      throw checkpoint_error(path, "tensor " + quoted(b.name) + " of " + std::to_string(a.count) +
                                     " elements is shaped " + shape_text(a) + " (corrupt)");
    }
    // A shape matters to a rule with a tensor phase; to the others, only the count does. A file
    // without "dims" (saved before tensors had batches) records (batches x rows) x columns.
    bool const same_shape = h.dims_recorded ? a.rows == b.rows && a.columns == b.columns && a.batches == b.batches &&
                                                a.vector == b.vector
                                            : rows == b.rows * b.batches && a.columns == b.columns;
    if (has_tensor_phase<rule_type> && h.shapes_recorded && !same_shape) {
      differ("tensor " + quoted(b.name) + " shaped", shape_text(a), shape_text(b));
    }
    if (a.step < 0 || a.step > detail::max_step_count) {
      throw checkpoint_error(path, "tensor " + quoted(b.name) + " has step count " + std::to_string(a.step) +
                                     " (corrupt)");
    }
  }
  if (h.chunk_elements != mine.chunk_elements) {
    differ("chunk_elements", std::to_string(h.chunk_elements), std::to_string(mine.chunk_elements));
  }
  if (h.chunk_bytes != mine.chunk_bytes || h.chunk_count != mine.chunk_count ||
      h.total_elements != mine.total_elements) {
    differ("a layout of", std::to_string(h.chunk_count) + " chunks of " + std::to_string(h.chunk_bytes) + " bytes",
           std::to_string(mine.chunk_count) + " chunks of " + std::to_string(mine.chunk_bytes) + " bytes");
  }
  if (h.step < 0 || h.step > detail::max_step_count) {
    throw checkpoint_error(path, "step count " + std::to_string(h.step) + " is out of range (corrupt)");
  }
  if (h.values_per_group != rule_type::hyperparameter_table.size() || h.groups.empty()) {
    throw checkpoint_error(path, std::to_string(h.groups.size()) + " groups of " + std::to_string(h.values_per_group) +
                                   " hyper-parameters; " + std::string(rule_type::name) + " has " +
                                   std::to_string(rule_type::hyperparameter_table.size()) + " (corrupt)");
  }
  for (std::size_t t = 0; t < h.tensors.size(); ++t) {
    if (h.tensors[t].group >= h.groups.size()) {
      throw checkpoint_error(path, "tensor " + quoted(h.tensors[t].name) + " is in group " +
                                     std::to_string(h.tensors[t].group) + " of " + std::to_string(h.groups.size()) +
                                     " (corrupt)");
    }
  }
  for (std::size_t g = 0; g < h.groups.size(); ++g) {
    try {
      (void)hyperparameters_from_values<rule_type>(h.groups[g]);
    } catch (invalid_option const& e) {
      throw checkpoint_error(path, "group " + std::to_string(g) + ": " + e.what());
    }
  }
  if (h.tensor_states.size() != mine.tensor_states.size()) {
    throw checkpoint_error(path, "holds the per-tensor state of " + std::to_string(h.tensor_states.size()) +
                                   " tensors; " + std::string(rule_type::name) + " keeps " +
                                   (has_tensor_phase<rule_type> ? "one per tensor, " : "none, ") +
                                   std::to_string(mine.tensor_states.size()) + " here (corrupt)");
  }
  for (std::size_t t = 0; t < h.tensor_states.size(); ++t) {
    auto const& a = h.tensor_states[t];
    auto const& b = mine.tensor_states[t];
    if (a.values.size() != b.values.size()) {
      throw checkpoint_error(path, "tensor " + quoted(mine.tensors[t].name) + " has " +
                                     std::to_string(a.values.size()) + " floats of per-tensor state; " +
                                     std::string(rule_type::name) + " keeps " + std::to_string(b.values.size()) +
                                     " for its shape (corrupt)");
    }
  }
}

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
io::engine_options OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::checkpoint_io(
    checkpoint_options const& o) const
{
  io::engine_options eo;
  if (o.io) {
    eo = *o.io;
  } else if constexpr (requires { { opts_.tier.io } -> std::convertible_to<io::engine_options const&>; }) {
    eo        = opts_.tier.io;  // the tier's engine choice (its backend above all) carries over
    eo.faults = nullptr;        // a fault plan planted for the tier is the tier's
  }
  try {
    eo.validate();
  } catch (invalid_option const& e) {
    throw invalid_option("checkpoint_options::io", o.io ? "(given)" : "(the tier's options.io)", e.what());
  }
  return eo;
}

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
io::engine OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::checkpoint_engine(
    io::engine_options const& eo, checkpoint_options const& o,
                                                  std::string const& path) const
{
  try {
    return io::engine(eo);
  } catch (io_error const& e) {
    throw io_error(e.code().value(), path, "start the checkpoint's I/O engine", 0, 0,
                   std::string(e.what()) + "; the checkpoint's engine is checkpoint_options::io" +
                     (o.io ? "" : ", which by default follows the state tier's (options.tier.io)") +
                     ": set its .backend = io::backend::psync where io_uring is forbidden");
  }
}

}  // namespace tierstate
