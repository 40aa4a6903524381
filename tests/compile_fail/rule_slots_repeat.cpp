// SPDX-License-Identifier: Apache-2.0
// A rule that names two of its slots alike (copy_state and checkpoints tell slots apart by
// name): refused with the sentence that says how slots are named.
// expect: tierstate: a rule's slots need distinct, non-empty names, none of them `master` or `compensation` (the library keeps those) (rules/rule.hpp)
#include <tierstate/tierstate.hpp>

#include <array>
#include <cstdint>
#include <string_view>

struct Twice {
  static constexpr std::string_view name = "twice";
  static constexpr std::array<tierstate::slot, 2> slots{tierstate::slot{"buffer"}, tierstate::slot{"buffer"}};
  struct hyperparameters {};
  static constexpr std::array<tierstate::hyperparameter<hyperparameters>, 0> hyperparameter_table{};
  struct coefficients {};
  static coefficients coefficients_for(hyperparameters const&, std::int64_t, double) { return {}; }
  template <class V>
  static void update(coefficients const&, V&, V, V (&)[2]) noexcept {}
};

using Opt = tierstate::OffloadedOptimizer<Twice>;
static_assert(sizeof(Opt) > 0);
