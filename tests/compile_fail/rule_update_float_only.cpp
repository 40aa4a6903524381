// SPDX-License-Identifier: Apache-2.0
// A rule whose update is written for float alone: it models the concept (the device runs it
// on float), but the host kernels run it on xsimd batches, and say so at the first step.
// expect: tierstate: the rule's update must also take xsimd::batch<float, Arch>, the host kernels' value type
#include <tierstate/tierstate.hpp>

#include <array>
#include <cstdint>
#include <span>
#include <string_view>

struct FloatOnly {
  static constexpr std::string_view name = "float_only";
  static constexpr std::array<tierstate::slot, 1> slots{tierstate::slot::exp_avg};
  struct hyperparameters {};
  static constexpr std::array<tierstate::hyperparameter<hyperparameters>, 0> hyperparameter_table{};
  struct coefficients {
    float lr;
  };
  static coefficients coefficients_for(hyperparameters const&, std::int64_t, double) { return {1e-3f}; }
  static void update(coefficients const& k, float& w, float g, float (&s)[1]) noexcept
  {
    s[0] = 0.9f * s[0] + g;
    w -= k.lr * s[0];
  }
};
static_assert(tierstate::rule<FloatOnly>);

using Opt = tierstate::OffloadedOptimizer<FloatOnly, tierstate::Fp32>;
tierstate::step_result step(Opt& opt, std::span<tierstate::grad_view<float> const> grads) { return opt.step(grads); }
