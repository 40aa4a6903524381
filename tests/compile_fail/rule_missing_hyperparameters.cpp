// SPDX-License-Identifier: Apache-2.0
// A rule without a hyperparameters struct: refused with the sentence that names it.
// expect: tierstate: a rule needs `struct hyperparameters`, default-constructible and copyable, with torch.optim's defaults (rules/rule.hpp)
#include <tierstate/tierstate.hpp>

#include <array>
#include <string_view>

struct NoHyperparameters {
  static constexpr std::string_view name = "no_hyperparameters";
  static constexpr std::array<tierstate::slot, 1> slots{tierstate::slot::exp_avg};
  struct coefficients {};
  template <class V>
  static void update(coefficients const&, V&, V, V (&)[1]) noexcept {}
};

using Opt = tierstate::OffloadedOptimizer<NoHyperparameters>;
static_assert(sizeof(Opt) > 0);
