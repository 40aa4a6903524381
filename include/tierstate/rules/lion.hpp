// SPDX-License-Identifier: Apache-2.0
// Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), with the
// semantics of the lion-pytorch reference: decoupled weight decay, then a sign update from an
// interpolation of the momentum and the gradient, then the momentum's own decay.
//
//   g = grad / grad_scale,  negated when maximize (an addition of tierstate's, as torch.optim
//       has it everywhere)
//   c = beta1 * m + (1 - beta1) * g
//   w = w * (1 - lr * weight_decay) - lr * sign(c)        (sign(0) = 0, as torch.sign)
//   m = beta2 * m + (1 - beta2) * g
//
// One slot, `exp_avg`, as lion-pytorch names it. Each product that feeds an add is an
// explicit fma, rounded where the reference rounds: beta * m is rounded, then (1 - beta) * g
// is added in one fused step, as torch's `mul_(beta).add_(g, alpha=1 - beta)` does; the
// decayed weight is rounded, then -lr * sign(c) is added.
#pragma once

#include <tierstate/core/concepts.hpp>
#include <tierstate/core/error.hpp>
#include <tierstate/core/math.hpp>
#include <tierstate/rules/rule.hpp>

#include <array>
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>

namespace tierstate::inline TIERSTATE_ABI {

struct Lion {
  static constexpr std::string_view name = "lion";
  static constexpr std::array<slot, 1> slots{slot::exp_avg};
  static constexpr std::size_t slot_count = slots.size();

  /// lion-pytorch's arguments and defaults.
  struct hyperparameters {
    double lr                   = 1e-4;
    std::array<double, 2> betas = {0.9, 0.99};
    double weight_decay         = 0.0;
    bool maximize               = false;
  };

  /// The table (rules/rule.hpp): a checkpoint records lr, beta1, beta2, weight_decay,
  /// maximize, in this order.
  static constexpr std::array<hyperparameter<hyperparameters>, 5> hyperparameter_table{{
    number_row<hyperparameters, &hyperparameters::lr>("lr", value_range::at_least(0.0),
                                                      "the learning rate must be >= 0"),
    element_row<hyperparameters, &hyperparameters::betas, 0>("betas[0]", value_range::closed(0.0, 1.0),
                                                             "beta1 must be in [0, 1]"),
    element_row<hyperparameters, &hyperparameters::betas, 1>("betas[1]", value_range::closed(0.0, 1.0),
                                                             "beta2 must be in [0, 1]"),
    number_row<hyperparameters, &hyperparameters::weight_decay>("weight_decay", value_range::at_least(0.0),
                                                                "weight decay must be >= 0"),
    flag_row<hyperparameters, &hyperparameters::maximize>("maximize"),
  }};

  struct coefficients {
    float grad_mul;  ///< 1 / grad_scale, negated when maximize
    float decay;     ///< 1 - lr * weight_decay
    float neg_lr;
    float beta1, one_minus_beta1;
    float beta2, one_minus_beta2;
  };

  static void validate(hyperparameters const& h) { validate_hyperparameters<Lion>(h); }

  /// Lion keeps no bias correction: `step` is only checked.
  [[nodiscard]] static coefficients coefficients_for(hyperparameters const& h, std::int64_t step,
                                                     double grad_scale = 1.0)
  {
    validate(h);
    validate_step(name, step, grad_scale);
    float const inv = static_cast<float>(1.0 / grad_scale);
    coefficients k{};
    k.grad_mul        = h.maximize ? -inv : inv;
    k.decay           = static_cast<float>(1.0 - h.lr * h.weight_decay);
    k.neg_lr          = static_cast<float>(-h.lr);
    k.beta1           = static_cast<float>(h.betas[0]);
    k.one_minus_beta1 = static_cast<float>(1.0 - h.betas[0]);
    k.beta2           = static_cast<float>(h.betas[1]);
    k.one_minus_beta2 = static_cast<float>(1.0 - h.betas[1]);
    return k;
  }

  template <class V>
  TIERSTATE_HOST_DEVICE static void update(coefficients const& k, V& w, V g, V (&state)[1]) noexcept
  {
    V& m      = state[0];
    g         = math::fma(g, V(k.grad_mul), V(0.0f));  // an fma, not a product: see rules/adam.hpp
    V const c = math::fma(g, V(k.one_minus_beta1), V(k.beta1) * m);
    w         = math::fma(math::sign(c), V(k.neg_lr), w * V(k.decay));
    m         = math::fma(g, V(k.one_minus_beta2), V(k.beta2) * m);
  }
};

static_assert(rule<Lion>);

}  // namespace tierstate
