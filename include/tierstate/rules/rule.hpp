// SPDX-License-Identifier: Apache-2.0
// What a rule is: the `rule` concept, the hyper-parameter table every rule writes once, and
// what the library derives from that table (validation, the values a checkpoint records).
//
// A rule is a small struct (rules/adam.hpp is one):
//   - `name`: a short identifier ("adamw"), which checkpoints record;
//   - `slots`: a std::array<slot, N> of the state arrays it keeps besides the master, in the
//     order `update` receives them, each with its own name: the library's (slot::exp_avg) or
//     the rule's (slot{"momentum_buffer"}), as torch.optim names it. N may be 0 (plain SGD);
//   - `hyperparameters`: a struct with torch.optim's defaults;
//   - `hyperparameter_table`: a std::array<hyperparameter<hyperparameters>, M>, one row per
//     number: its name as torch.optim spells it ("lr", "betas[0]"), how to read and set it,
//     the values it may take and, in torch's words, why others are refused (number_row,
//     element_row and flag_row make a row from a member). Validation, the values a
//     checkpoint records (in table order) and the PyTorch bindings come from it;
//   - `coefficients`: everything an update needs for one step (trivially copyable: it goes
//     to the device as it is), made once per step by `coefficients_for(hyperparameters,
//     step, grad_scale)`;
//   - `update(coefficients, weight, grad, state)`: the per-element math, a template over the
//     value type, so that the same text runs on float, on xsimd batches and on the device.
//     `state` is a `V (&)[N]`, which is `slot_values<V, N>&`; without slots, a `no_slots&`.
//
// A rule whose numbers constrain each other (torch.optim.SGD: Nesterov needs a momentum and zero
// dampening) adds `validate_combination(hyperparameters const&)`, which throws tierstate::invalid_option
// naming one of them; it runs after the table's ranges, wherever they are checked.
//
// A rule may add a *tensor phase*: statistics over each whole tensor before its update (a
// row and column factor, a trust ratio), with state of its own per tensor that persists
// across steps and that checkpoints keep. It declares
//   - `reduce_passes` (>= 1): how many passes over a tensor's gradient each step makes;
//   - `tensor_state_size(tensor_shape)`: the floats of state it keeps per tensor (zeros
//     before the first step);
//   - `statistics_size(tensor_shape, pass)`: the doubles a pass sums into;
//   - `reduce_row(coefficients, pass, shape, tensor_state, row, grad_row, statistics)`: one
//     of shape.total_rows() rows of the gradient (float, still times the grad scale; row r
//     is in matrix r / shape.rows), which only *adds* to statistics (step/tensor_phase.hpp
//     sums a large tensor's fixed blocks of rows apart, then in block order);
//   - `finish_pass(coefficients, pass, shape, statistics, tensor_state)`: after the pass's
//     last row (so a second pass sees what the first one made);
//   - and its `update` takes one more argument, a tensor_position<V>: where its values lie
//     in the tensor, and that tensor's state.
// With `static constexpr bool reduce_reads_params = true` (Adafactor's RMS of the param),
// reduce_row also takes the param's row, as float, after the gradient's: the param the model
// computes with, as it was before this step. The passes run on the host, in double, so they
// are the same bits whatever the chunks, threads, tier and compute. A tensor whose gradient
// is absent in a step keeps its state as it was.
//
// A type that misses one of these is refused where the optimizer is instantiated, with one
// sentence that names the first thing missing (detail::checked_rule).
#pragma once

#include <tierstate/core/concepts.hpp>
#include <tierstate/core/config.hpp>
#include <tierstate/core/error.hpp>
#include <tierstate/core/math.hpp>
#include <tierstate/core/tensor.hpp>

#include <array>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>

namespace tierstate::inline TIERSTATE_ABI {

/// The values one hyper-parameter may take: [lo, hi] (hi itself excluded when hi_open, lo
/// when lo_open), or, for a flag, exactly 0 and 1. NaN is never one of them.
struct value_range {
  double lo     = -std::numeric_limits<double>::infinity();
  double hi     = std::numeric_limits<double>::infinity();
  bool hi_open  = false;
  bool flag     = false;
  bool lo_open  = false;

  [[nodiscard]] constexpr bool admits(double v) const noexcept
  {
    if (flag) { return v == 0.0 || v == 1.0; }
    return (lo_open ? lo < v : lo <= v) && (hi_open ? v < hi : v <= hi);
  }

  /// [lo, +inf]
  [[nodiscard]] static constexpr value_range at_least(double lo) noexcept { return {lo}; }
  /// [lo, hi)
  [[nodiscard]] static constexpr value_range half_open(double lo, double hi) noexcept { return {lo, hi, true}; }
  /// (lo, +inf]
  [[nodiscard]] static constexpr value_range above(double lo) noexcept
  {
    return {lo, std::numeric_limits<double>::infinity(), false, false, true};
  }
  /// [lo, hi]
  [[nodiscard]] static constexpr value_range closed(double lo, double hi) noexcept { return {lo, hi}; }
  /// 0 or 1 (a bool)
  [[nodiscard]] static constexpr value_range boolean() noexcept { return {0.0, 1.0, false, true}; }
};

/// One row of a rule's hyper-parameter table (see the file comment).
template <class H>
struct hyperparameter {
  std::string_view name;             ///< torch.optim's spelling: "lr", "betas[0]", "maximize"
  double (*get)(H const&) noexcept;  ///< the value, as a double (a flag: 0 or 1)
  void (*set)(H&, double) noexcept;  ///< sets it from a double the range admits
  value_range range;
  std::string_view why;  ///< why a value outside the range is refused, in torch's words
};

/// A row for a number member of H (`&H::lr`).
template <class H, auto Member>
[[nodiscard]] constexpr hyperparameter<H> number_row(std::string_view name, value_range range,
                                                     std::string_view why) noexcept
{
  return {name, [](H const& h) noexcept { return static_cast<double>(h.*Member); },
          [](H& h, double v) noexcept { h.*Member = v; }, range, why};
}

/// A row for element I of an array member of H (`&H::betas`, 0 for "betas[0]").
template <class H, auto Member, std::size_t I>
[[nodiscard]] constexpr hyperparameter<H> element_row(std::string_view name, value_range range,
                                                      std::string_view why) noexcept
{
  return {name, [](H const& h) noexcept { return static_cast<double>((h.*Member)[I]); },
          [](H& h, double v) noexcept { (h.*Member)[I] = v; }, range, why};
}

/// A row for a bool member of H: 0 or 1.
template <class H, auto Member>
[[nodiscard]] constexpr hyperparameter<H> flag_row(std::string_view name) noexcept
{
  return {name, [](H const& h) noexcept { return h.*Member ? 1.0 : 0.0; },
          [](H& h, double v) noexcept { h.*Member = v != 0.0; }, value_range::boolean(), "must be 0 or 1"};
}

/// What a rule without slots receives as its state (a zero-length array is not C++).
struct no_slots {};

namespace detail {
template <class V, std::size_t N>
struct slot_values_of {
  using type = V[N];
};
template <class V>
struct slot_values_of<V, 0> {
  using type = no_slots;
};
}  // namespace detail

/// The state argument of a rule's `update`: V[N] for N slots (so `V (&state)[N]` is the same
/// type), tierstate::no_slots for none.
template <class V, std::size_t N>
using slot_values = typename detail::slot_values_of<V, N>::type;

/// Where the values of one call of a tensor-phase rule's `update` lie in their tensor: one
/// row, consecutive columns (lane l is column `column + l`), and that tensor's state after
/// this step's passes.
template <class V>
struct tensor_position {
  float const* state = nullptr;  ///< tensor_state_size(shape) floats
  tensor_shape shape{};
  std::size_t row    = 0;  ///< of shape.total_rows(): in matrix row / shape.rows
  std::size_t column = 0;  ///< lane 0's column
  std::size_t lanes  = 1;  ///< the lanes that hold the tensor's values (the rest are padding)

  /// p[column + l] in lane l: a per-column array's values at these values' columns (zeros in
  /// the padding lanes; nothing past the last column is read).
  [[nodiscard]] TIERSTATE_HOST_DEVICE V columns(float const* p) const noexcept { return math::load<V>(p + column, lanes); }
};

namespace detail {

template <class T, class H>
struct is_hyperparameter_table : std::false_type {};
template <class H, std::size_t N>
struct is_hyperparameter_table<std::array<hyperparameter<H>, N>, H> : std::true_type {};

template <class T>
struct is_slot_array : std::false_type {};
template <std::size_t N>
struct is_slot_array<std::array<slot, N>> : std::true_type {};

// The parts of the `rule` concept, each named for the sentence detail::checked_rule says
// when it is missing.
template <class R>
concept rule_has_name = requires {
  { R::name } -> std::convertible_to<std::string_view>;
};
template <class R>
concept rule_has_slots = requires { R::slots; } && is_slot_array<std::remove_cvref_t<decltype(R::slots)>>::value;
/// Whether R's slot names are distinct, non-empty and not the library's own.
template <class R>
consteval bool slot_names_distinct()
{
  for (std::size_t i = 0; i != R::slots.size(); ++i) {
    auto const s = R::slots[i];
    if (s.name().empty() || s == slot::master || s == slot::compensation) { return false; }
    for (std::size_t j = 0; j < i; ++j) {
      if (R::slots[j] == s) { return false; }
    }
  }
  return true;
}
template <class R>
concept rule_slots_distinct = rule_has_slots<R> && slot_names_distinct<R>();
template <class R>
concept rule_has_hyperparameters = requires { typename R::hyperparameters; } &&
                                   std::semiregular<typename R::hyperparameters>;
template <class R>
concept rule_has_table = requires { R::hyperparameter_table; } &&
                         is_hyperparameter_table<std::remove_cvref_t<decltype(R::hyperparameter_table)>,
                                                 typename R::hyperparameters>::value;
template <class R>
concept rule_has_coefficients =
  requires(typename R::hyperparameters const& h) {
    typename R::coefficients;
    { R::coefficients_for(h, std::int64_t{1}, 1.0) } -> std::same_as<typename R::coefficients>;
  } && std::is_trivially_copyable_v<typename R::coefficients>;
template <class R>
concept rule_updates_float = requires(typename R::coefficients const& k, float& w, float g,
                                      slot_values<float, R::slots.size()>& s) { R::update(k, w, g, s); };

/// Whether R says it has a tensor phase (see the file comment).
template <class R>
concept rule_declares_tensor_phase = requires { R::reduce_passes; };
template <class R>
concept rule_reduce_reads_params = requires { requires static_cast<bool>(R::reduce_reads_params); };
template <class R>
concept rule_reduces_rows =
  (rule_reduce_reads_params<R> &&
   requires(typename R::coefficients const& k, tensor_shape sh, float const* cs, double* st, std::span<float const> g) {
     R::reduce_row(k, 0u, sh, cs, std::size_t{0}, g, g, st);
   }) ||
  (!rule_reduce_reads_params<R> &&
   requires(typename R::coefficients const& k, tensor_shape sh, float const* cs, double* st, std::span<float const> g) {
     R::reduce_row(k, 0u, sh, cs, std::size_t{0}, g, st);
   });
template <class R>
concept rule_has_tensor_phase =
  requires(typename R::coefficients const& k, tensor_shape sh, float const* cs, float* s, double* st,
           double const* cst, std::span<float const> g) {
    { R::reduce_passes } -> std::convertible_to<unsigned>;
    { R::tensor_state_size(sh) } -> std::same_as<std::size_t>;
    { R::statistics_size(sh, 0u) } -> std::same_as<std::size_t>;
    R::finish_pass(k, 0u, sh, cst, s);
  } && (R::reduce_passes >= 1) && rule_reduces_rows<R>;
template <class R>
concept rule_updates_float_at =
  requires(typename R::coefficients const& k, float& w, float g, slot_values<float, R::slots.size()>& s,
           tensor_position<float> const& at) { R::update(k, w, g, s, at); };
/// The update as the rule's kind needs it: with a tensor_position for a tensor-phase rule.
template <class R>
concept rule_updates =
  (!rule_declares_tensor_phase<R> && rule_updates_float<R>) || (rule_has_tensor_phase<R> && rule_updates_float_at<R>);

}  // namespace detail

/// See the file comment.
template <class R>
concept rule = detail::rule_has_name<R> && detail::rule_slots_distinct<R> && detail::rule_has_hyperparameters<R> &&
               detail::rule_has_table<R> && detail::rule_has_coefficients<R> && detail::rule_updates<R>;

/// Whether rule R has a tensor phase (see the file comment).
template <class R>
inline constexpr bool has_tensor_phase = detail::rule_declares_tensor_phase<R>;

/// Throws tierstate::invalid_option ("<rule>.<name> = <value>: <why>") for the first number
/// of `h`, in table order, that its row's range does not admit; then for a combination the
/// rule's validate_combination refuses, if it has one.
template <rule R>
void validate_hyperparameters(typename R::hyperparameters const& h)
{
  for (auto const& row : R::hyperparameter_table) {
    double const v = row.get(h);
    if (!row.range.admits(v)) {
      throw invalid_option(std::string(R::name) + "." + std::string(row.name), detail::to_text(v),
                           std::string(row.why));
    }
  }
  if constexpr (requires { R::validate_combination(h); }) { R::validate_combination(h); }
}

/// The checks every rule's coefficients_for makes of its other arguments: throws
/// tierstate::invalid_option ("<rule>.step", "<rule>.grad_scale") for a step below 1 (torch
/// counts from 1) or a gradient scale that is not finite and > 0.
inline void validate_step(std::string_view rule, std::int64_t step, double grad_scale)
{
  if (step < 1) {
    throw invalid_option(std::string(rule) + ".step", detail::to_text(step), "steps are counted from 1");
  }
  if (!(grad_scale > 0.0) || !std::isfinite(grad_scale)) {
    throw invalid_option(std::string(rule) + ".grad_scale", detail::to_text(grad_scale),
                         "the gradient scale must be finite and > 0");
  }
}

/// The numbers of `h`, in table order: what a checkpoint records per group.
template <rule R>
[[nodiscard]] std::array<double, R::hyperparameter_table.size()> hyperparameter_values(
    typename R::hyperparameters const& h) noexcept
{
  std::array<double, R::hyperparameter_table.size()> out{};
  for (std::size_t i = 0; i < out.size(); ++i) { out[i] = R::hyperparameter_table[i].get(h); }
  return out;
}

/// The inverse of hyperparameter_values: throws tierstate::invalid_option for a count that
/// is not the table's, or a value its row does not admit (a corrupt checkpoint).
template <rule R>
[[nodiscard]] typename R::hyperparameters hyperparameters_from_values(std::span<double const> v)
{
  constexpr std::size_t n = R::hyperparameter_table.size();
  if (v.size() != n) {
    throw invalid_option(std::string(R::name) + " hyper-parameters", std::to_string(v.size()) + " values",
                         "the rule has " + std::to_string(n));
  }
  typename R::hyperparameters h{};
  for (std::size_t i = 0; i < n; ++i) {
    auto const& row = R::hyperparameter_table[i];
    if (!row.range.admits(v[i])) {
      throw invalid_option(std::string(R::name) + "." + std::string(row.name), detail::to_text(v[i]),
                           std::string(row.why));
    }
    row.set(h, v[i]);
  }
  if constexpr (requires { R::validate_combination(h); }) { R::validate_combination(h); }
  return h;
}

namespace detail {

/// What a refused rule is replaced with, so that its one sentence is the only error.
struct stand_in_rule {
  static constexpr std::string_view name = "stand_in";
  static constexpr std::array<slot, 1> slots{slot::exp_avg};
  struct hyperparameters {};
  static constexpr std::array<hyperparameter<hyperparameters>, 0> hyperparameter_table{};
  struct coefficients {
    float unused;
  };
  static coefficients coefficients_for(hyperparameters const&, std::int64_t, double) { return {}; }
  template <class V>
  TIERSTATE_HOST_DEVICE static void update(coefficients const&, V&, V, V (&)[1]) noexcept
  {
  }
};

/// `R`, checked: each part of the rule concept in turn, the first one missing refused with
/// a sentence; `type` is R, or a stand-in once one is refused.
template <class R>
struct checked_rule {
  static constexpr bool named = rule_has_name<R>;
  static_assert(named, "tierstate: a rule needs `static constexpr std::string_view name`: a short identifier, "
                       "which checkpoints record (rules/rule.hpp)");
  static constexpr bool has_slots = !named || rule_has_slots<R>;
  static_assert(has_slots, "tierstate: a rule needs `static constexpr std::array<tierstate::slot, N> slots` "
                           "(N >= 0): the state arrays it keeps besides the master, in the order `update` "
                           "receives them (rules/rule.hpp)");
  static constexpr bool slotted = named && has_slots && rule_slots_distinct<R>;
  static_assert(!(named && has_slots) || slotted,
                "tierstate: a rule's slots need distinct, non-empty names, none of them `master` or "
                "`compensation` (the library keeps those) (rules/rule.hpp)");
  static constexpr bool with_hyperparameters = !(named && slotted) || rule_has_hyperparameters<R>;
  static_assert(with_hyperparameters,
                "tierstate: a rule needs `struct hyperparameters`, default-constructible and copyable, "
                "with torch.optim's defaults (rules/rule.hpp)");
  static constexpr bool tabled = !(named && slotted && with_hyperparameters) || rule_has_table<R>;
  static_assert(tabled, "tierstate: a rule needs `static constexpr std::array<tierstate::hyperparameter<"
                        "hyperparameters>, M> hyperparameter_table`: each number's name, how to read and set "
                        "it, and the values it may take (rules/rule.hpp)");
  static constexpr bool with_coefficients =
    !(named && slotted && with_hyperparameters && tabled) || rule_has_coefficients<R>;
  static_assert(with_coefficients,
                "tierstate: a rule needs a trivially copyable `struct coefficients` and `static coefficients "
                "coefficients_for(hyperparameters const&, std::int64_t step, double grad_scale)` (rules/rule.hpp)");
  static constexpr bool before_update = named && slotted && with_hyperparameters && tabled && with_coefficients;
  static constexpr bool phased = !(before_update && rule_declares_tensor_phase<R>) || rule_has_tensor_phase<R>;
  static_assert(phased, "tierstate: a rule with `reduce_passes` (a tensor phase) needs `reduce_passes` >= 1, "
                        "`static std::size_t tensor_state_size(tensor_shape)`, `static std::size_t "
                        "statistics_size(tensor_shape, unsigned pass)`, `static void reduce_row(coefficients "
                        "const&, unsigned pass, tensor_shape, float const* tensor_state, std::size_t row, "
                        "std::span<float const> grad, double* statistics)` and `static void finish_pass("
                        "coefficients const&, unsigned pass, tensor_shape, double const* statistics, float* "
                        "tensor_state)` (rules/rule.hpp)");
  static constexpr bool updates = !(before_update && phased) || rule_updates<R>;
  static_assert(updates || rule_declares_tensor_phase<R>,
                "tierstate: a rule needs `template <class V> static void update(coefficients const&, "
                "V& weight, V grad, V (&state)[slots.size()])` (`no_slots&` without slots), callable with V = float "
                "(rules/rule.hpp)");
  static_assert(updates || !rule_declares_tensor_phase<R>,
                "tierstate: a rule with a tensor phase needs `template <class V> static void update(coefficients "
                "const&, V& weight, V grad, V (&state)[slots.size()], tensor_position<V> const&)`, callable with "
                "V = float (rules/rule.hpp)");

  using type = std::conditional_t<rule<R>, R, stand_in_rule>;
};

}  // namespace detail
}  // namespace tierstate
