// SPDX-License-Identifier: Apache-2.0
// A rule without a name (checkpoints record it): the first thing missing is named.
// expect: tierstate: a rule needs `static constexpr std::string_view name`: a short identifier, which checkpoints record (rules/rule.hpp)
#include <tierstate/tierstate.hpp>

#include <array>
#include <cstdint>

struct Nameless {
  static constexpr std::array<tierstate::slot, 1> slots{tierstate::slot::exp_avg};
  struct hyperparameters {};
  static constexpr std::array<tierstate::hyperparameter<hyperparameters>, 0> hyperparameter_table{};
  struct coefficients {};
  static coefficients coefficients_for(hyperparameters const&, std::int64_t, double) { return {}; }
  template <class V>
  static void update(coefficients const&, V&, V, V (&)[1]) noexcept {}
};

using Opt = tierstate::OffloadedOptimizer<Nameless>;
static_assert(sizeof(Opt) > 0);
