// SPDX-License-Identifier: Apache-2.0
// A rule that counts its slots instead of naming them (the state API and checkpoints name
// each one): refused with the sentence that says what slots must be.
// expect: tierstate: a rule needs `static constexpr std::array<tierstate::slot, N> slots` (N >= 0): the state arrays it keeps besides the master, in the order `update` receives them (rules/rule.hpp)
#include <tierstate/tierstate.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

struct CountedSlots {
  static constexpr std::string_view name = "counted";
  static constexpr std::size_t slots = 1;
  struct hyperparameters {};
  static constexpr std::array<tierstate::hyperparameter<hyperparameters>, 0> hyperparameter_table{};
  struct coefficients {};
  static coefficients coefficients_for(hyperparameters const&, std::int64_t, double) { return {}; }
  template <class V>
  static void update(coefficients const&, V&, V, V (&)[1]) noexcept {}
};

using Opt = tierstate::OffloadedOptimizer<CountedSlots>;
static_assert(sizeof(Opt) > 0);
