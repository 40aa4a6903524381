// SPDX-License-Identifier: Apache-2.0
// A rule with hyper-parameters but no table of them (validation and checkpoints read the
// table): refused with the sentence that names it.
// expect: tierstate: a rule needs `static constexpr std::array<tierstate::hyperparameter<hyperparameters>, M> hyperparameter_table`: each number's name, how to read and set it, and the values it may take (rules/rule.hpp)
#include <tierstate/tierstate.hpp>

#include <array>
#include <cstdint>
#include <string_view>

struct NoTable {
  static constexpr std::string_view name = "no_table";
  static constexpr std::array<tierstate::slot, 1> slots{tierstate::slot::exp_avg};
  struct hyperparameters {
    double lr = 1e-3;
  };
  struct coefficients {};
  static coefficients coefficients_for(hyperparameters const&, std::int64_t, double) { return {}; }
  template <class V>
  static void update(coefficients const&, V&, V, V (&)[1]) noexcept {}
};

using Opt = tierstate::OffloadedOptimizer<NoTable>;
static_assert(sizeof(Opt) > 0);
