// SPDX-License-Identifier: Apache-2.0
// SGD with momentum, with torch.optim.SGD's exact semantics (single-tensor path):
//
//   g   = grad / grad_scale,  negated when maximize
//   g   = g + weight_decay * w                      (only when weight_decay != 0)
//   buf = g                                         on the tensor's first step
//   buf = momentum * buf + (1 - dampening) * g      after it
//   g   = g + momentum * buf  (nesterov),  or  g = buf
//   w   = w - lr * g
//
// torch keeps no buffer at all when momentum is 0; here the slots are fixed at compile time,
// so this rule, which keeps `momentum_buffer`, refuses momentum 0 by name. Each product that
// feeds an add is an explicit fma, in the order torch's CPU kernels round: buf * momentum is
// rounded, then (1 - dampening) * g is added to it in one fused step, as `add_` with an alpha
// computes it.
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

/// torch.optim.SGD(momentum > 0): one slot, momentum_buffer.
struct SGDMomentum {
  static constexpr std::string_view name = "sgd_momentum";
  static constexpr std::array<slot, 1> slots{slot{"momentum_buffer"}};
  static constexpr std::size_t slot_count = slots.size();

  /// torch.optim.SGD's arguments and defaults, except momentum: torch's default, 0, keeps no
  /// buffer, which this rule exists to keep.
  struct hyperparameters {
    double lr           = 1e-3;
    double momentum     = 0.9;
    double dampening    = 0.0;
    double weight_decay = 0.0;
    bool nesterov       = false;
    bool maximize       = false;
  };

  /// The table (rules/rule.hpp): a checkpoint records the values in this order (lr, momentum,
  /// dampening, weight_decay, nesterov, maximize). torch accepts any dampening.
  static constexpr std::array<hyperparameter<hyperparameters>, 6> hyperparameter_table{{
    {"lr", [](hyperparameters const& h) noexcept { return h.lr; },
     [](hyperparameters& h, double v) noexcept { h.lr = v; }, value_range::at_least(0.0),
     "the learning rate must be >= 0"},
    {"momentum", [](hyperparameters const& h) noexcept { return h.momentum; },
     [](hyperparameters& h, double v) noexcept { h.momentum = v; }, value_range::above(0.0),
     "momentum must be > 0 for a rule that keeps a momentum buffer (momentum 0 keeps none: "
     "torch.optim.SGD(momentum=0) is a rule without slots)"},
    {"dampening", [](hyperparameters const& h) noexcept { return h.dampening; },
     [](hyperparameters& h, double v) noexcept { h.dampening = v; }, value_range{},
     "dampening must be a number"},
    {"weight_decay", [](hyperparameters const& h) noexcept { return h.weight_decay; },
     [](hyperparameters& h, double v) noexcept { h.weight_decay = v; }, value_range::at_least(0.0),
     "weight decay must be >= 0"},
    {"nesterov", [](hyperparameters const& h) noexcept { return h.nesterov ? 1.0 : 0.0; },
     [](hyperparameters& h, double v) noexcept { h.nesterov = v != 0.0; }, value_range::boolean(),
     "must be 0 or 1"},
    {"maximize", [](hyperparameters const& h) noexcept { return h.maximize ? 1.0 : 0.0; },
     [](hyperparameters& h, double v) noexcept { h.maximize = v != 0.0; }, value_range::boolean(),
     "must be 0 or 1"},
  }};

  /// torch's one refused combination.
  static void validate_combination(hyperparameters const& h)
  {
    if (h.nesterov && h.dampening != 0.0) {
      throw invalid_option(std::string(name) + ".dampening", detail::to_text(h.dampening),
                           "Nesterov momentum requires a momentum and zero dampening");
    }
  }

  struct coefficients {
    float grad_mul;      ///< 1 / grad_scale, negated when maximize
    float weight_decay;  ///< 0 disables the term
    float momentum;
    float one_minus_dampening;
    float neg_lr;
    bool first;  ///< the tensor's first step: the buffer starts as the gradient
    bool nesterov;
  };

  static void validate(hyperparameters const& h) { validate_hyperparameters<SGDMomentum>(h); }

  [[nodiscard]] static coefficients coefficients_for(hyperparameters const& h, std::int64_t step,
                                                     double grad_scale = 1.0)
  {
    validate(h);
    if (step < 1) { throw invalid_option(std::string(name) + ".step", detail::to_text(step), "steps are counted from 1"); }
    if (!(grad_scale > 0.0) || !std::isfinite(grad_scale)) {
      throw invalid_option(std::string(name) + ".grad_scale", detail::to_text(grad_scale),
                           "the gradient scale must be finite and > 0");
    }
    float const inv = static_cast<float>(1.0 / grad_scale);
    coefficients k{};
    k.grad_mul            = h.maximize ? -inv : inv;
    k.weight_decay        = static_cast<float>(h.weight_decay);
    k.momentum            = static_cast<float>(h.momentum);
    k.one_minus_dampening = static_cast<float>(1.0 - h.dampening);
    k.neg_lr              = static_cast<float>(-h.lr);
    k.first               = step == 1;
    k.nesterov            = h.nesterov;
    return k;
  }

  template <class V>
  TIERSTATE_HOST_DEVICE static void update(coefficients const& k, V& w, V g, V (&state)[1]) noexcept
  {
    V& buf = state[0];
    g      = math::fma(g, V(k.grad_mul), V(0.0f));  // an fma, not a product: see rules/adam.hpp
    if (k.weight_decay != 0.0f) { g = math::fma(w, V(k.weight_decay), g); }
    if (k.first) {
      buf = g;
    } else {
      buf = math::fma(g, V(k.one_minus_dampening), V(k.momentum) * buf);
    }
    V const dir = k.nesterov ? math::fma(buf, V(k.momentum), g) : buf;
    w           = math::fma(dir, V(k.neg_lr), w);
  }
};

static_assert(rule<SGDMomentum>);

}  // namespace tierstate
