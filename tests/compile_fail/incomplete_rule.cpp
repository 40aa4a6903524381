// SPDX-License-Identifier: Apache-2.0
// A user's rule with everything but its per-element update: the `rule` concept names it.
// expect: R::update(k, w, g, s)
#include <tierstate/tierstate.hpp>

#include <array>
#include <cstdint>
#include <string_view>

struct NoUpdate {
  static constexpr std::string_view name = "no_update";
  static constexpr std::array<tierstate::slot, 1> slots{tierstate::slot::exp_avg};
  struct hyperparameters {};
  struct coefficients {};
  static void validate(hyperparameters const&) {}
  static coefficients coefficients_for(hyperparameters const&, std::int64_t, double) { return {}; }
};

using Opt = tierstate::OffloadedOptimizer<NoUpdate>;
static_assert(sizeof(Opt) > 0);
