// SPDX-License-Identifier: Apache-2.0
// SGD, with torch.optim.SGD's exact semantics (single-tensor path), in two rules: SGD
// (momentum 0: no slot) and SGDMomentum (one slot, momentum_buffer).
//
//   g   = grad / grad_scale,  negated when maximize
//   g   = g + weight_decay * w                      (only when weight_decay != 0)
//   buf = g                                         on the first step
//   buf = momentum * buf + (1 - dampening) * g      after it
//   g   = g + momentum * buf  (nesterov),  or  g = buf
//   w   = w - lr * g
//
// torch keeps no buffer at all when momentum is 0; here the slots are fixed at compile time,
// so SGDMomentum, which keeps `momentum_buffer`, refuses momentum 0 by name, and SGD refuses
// any other. Both have the same table (torch's six numbers, in torch's order), so a trainer
// picks one by the value of momentum, and a checkpoint of one is refused by the other. (torch
// also lets groups of one optimizer differ in whether momentum is 0; here they cannot.)
//
// Each product that feeds an add is an explicit fma, in the order torch's CPU kernels round:
// buf * momentum is rounded, then (1 - dampening) * g is added in one fused step, as `add_`
// with an alpha computes it.
//
// "The first step" is the tensor's own step 1 (its step count: a step in which it had no
// gradient does not count), where torch asks whether the param's buffer exists yet. A buffer
// written with write_state before then is replaced by the first gradient, as torch's would
// not be: set the tensor's step count to 1 or more with it (set_step_count(name, n)), as
// tierstate_torch does when it loads a torch.optim.SGD state_dict.
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

namespace detail {

/// Both rules' table, the momentum row apart: a checkpoint records lr, momentum, dampening,
/// weight_decay, nesterov, maximize, in this order. torch accepts any dampening.
template <class H>
constexpr std::array<hyperparameter<H>, 6> sgd_table(value_range momentum, std::string_view momentum_why)
{
  return {{
    number_row<H, &H::lr>("lr", value_range::at_least(0.0), "the learning rate must be >= 0"),
    number_row<H, &H::momentum>("momentum", momentum, momentum_why),
    number_row<H, &H::dampening>("dampening", value_range{}, "dampening must be a number"),
    number_row<H, &H::weight_decay>("weight_decay", value_range::at_least(0.0), "weight decay must be >= 0"),
    flag_row<H, &H::nesterov>("nesterov"),
    flag_row<H, &H::maximize>("maximize"),
  }};
}

/// torch's one refused combination: Nesterov without a momentum, or with dampening.
template <class H>
void sgd_validate_combination(std::string_view rule, H const& h)
{
  std::string_view const why = "Nesterov momentum requires a momentum and zero dampening";
  if (h.nesterov && !(h.momentum > 0.0)) {
    throw invalid_option(std::string(rule) + ".nesterov", "1", std::string(why));
  }
  if (h.nesterov && h.dampening != 0.0) {
    throw invalid_option(std::string(rule) + ".dampening", detail::to_text(h.dampening), std::string(why));
  }
}

}  // namespace detail

/// torch.optim.SGD(momentum=0), its default: no slot; only the master (or the fp32 param).
struct SGD {
  static constexpr std::string_view name = "sgd";
  static constexpr std::array<slot, 0> slots{};
  static constexpr std::size_t slot_count = 0;

  /// torch.optim.SGD's arguments and defaults.
  struct hyperparameters {
    double lr           = 1e-3;
    double momentum     = 0.0;
    double dampening    = 0.0;
    double weight_decay = 0.0;
    bool nesterov       = false;
    bool maximize       = false;
  };
  static constexpr auto hyperparameter_table = detail::sgd_table<hyperparameters>(
    value_range::closed(0.0, 0.0),
    "momentum must be 0 for a rule without slots (a momentum buffer is kept by SGDMomentum)");
  static void validate_combination(hyperparameters const& h) { detail::sgd_validate_combination(name, h); }

  struct coefficients {
    float grad_mul;      ///< 1 / grad_scale, negated when maximize
    float weight_decay;  ///< 0 disables the term
    float neg_lr;
  };

  static void validate(hyperparameters const& h) { validate_hyperparameters<SGD>(h); }

  [[nodiscard]] static coefficients coefficients_for(hyperparameters const& h, std::int64_t step,
                                                     double grad_scale = 1.0)
  {
    validate(h);
    validate_step(name, step, grad_scale);
    float const inv = static_cast<float>(1.0 / grad_scale);
    return {h.maximize ? -inv : inv, static_cast<float>(h.weight_decay), static_cast<float>(-h.lr)};
  }

  template <class V>
  TIERSTATE_HOST_DEVICE static void update(coefficients const& k, V& w, V g, no_slots&) noexcept
  {
    g = math::fma(g, V(k.grad_mul), V(0.0f));  // an fma, not a product: see rules/adam.hpp
    if (k.weight_decay != 0.0f) { g = math::fma(w, V(k.weight_decay), g); }
    w = math::fma(g, V(k.neg_lr), w);
  }
};

static_assert(rule<SGD>);

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
  static constexpr auto hyperparameter_table = detail::sgd_table<hyperparameters>(
    value_range::above(0.0),
    "momentum must be > 0 for a rule that keeps a momentum buffer (momentum 0 keeps none: that is SGD)");
  static void validate_combination(hyperparameters const& h) { detail::sgd_validate_combination(name, h); }

  struct coefficients {
    float grad_mul;      ///< 1 / grad_scale, negated when maximize
    float weight_decay;  ///< 0 disables the term
    float momentum;
    float one_minus_dampening;
    float neg_lr;
    bool first;  ///< the first step: the buffer starts as the gradient (see the file comment)
    bool nesterov;
  };

  static void validate(hyperparameters const& h) { validate_hyperparameters<SGDMomentum>(h); }

  [[nodiscard]] static coefficients coefficients_for(hyperparameters const& h, std::int64_t step,
                                                     double grad_scale = 1.0)
  {
    validate(h);
    validate_step(name, step, grad_scale);
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
