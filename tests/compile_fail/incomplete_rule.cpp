// SPDX-License-Identifier: Apache-2.0
// A user's rule with everything but its per-element update: the sentence names it.
// expect: tierstate: a rule needs `template <class V> static void update(coefficients const&, V& weight, V grad, V (&state)[slots.size()])` (`no_slots&` without slots), callable with V = float (rules/rule.hpp)
#include <tierstate/tierstate.hpp>

#include <array>
#include <cstdint>
#include <string_view>

struct NoUpdate {
  static constexpr std::string_view name = "no_update";
  static constexpr std::array<tierstate::slot, 1> slots{tierstate::slot::exp_avg};
  struct hyperparameters {};
  static constexpr std::array<tierstate::hyperparameter<hyperparameters>, 0> hyperparameter_table{};
  struct coefficients {};
  static coefficients coefficients_for(hyperparameters const&, std::int64_t, double) { return {}; }
};

using Opt = tierstate::OffloadedOptimizer<NoUpdate>;
static_assert(sizeof(Opt) > 0);
