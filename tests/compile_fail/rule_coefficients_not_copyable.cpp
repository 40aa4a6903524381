// SPDX-License-Identifier: Apache-2.0
// A rule whose coefficients are not trivially copyable (they go to the device as they are,
// and are copied per step): refused with the sentence about coefficients.
// expect: tierstate: a rule needs a trivially copyable `struct coefficients` and `static coefficients coefficients_for(hyperparameters const&, std::int64_t step, double grad_scale)` (rules/rule.hpp)
#include <tierstate/tierstate.hpp>

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

struct HeavyCoefficients {
  static constexpr std::string_view name = "heavy";
  static constexpr std::array<tierstate::slot, 1> slots{tierstate::slot::exp_avg};
  struct hyperparameters {};
  static constexpr std::array<tierstate::hyperparameter<hyperparameters>, 0> hyperparameter_table{};
  struct coefficients {
    std::string label;
  };
  static coefficients coefficients_for(hyperparameters const&, std::int64_t, double) { return {}; }
  template <class V>
  static void update(coefficients const&, V&, V, V (&)[1]) noexcept {}
};

using Opt = tierstate::OffloadedOptimizer<HeavyCoefficients>;
static_assert(sizeof(Opt) > 0);
