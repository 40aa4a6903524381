// SPDX-License-Identifier: Apache-2.0
// Adam and AdamW with torch.optim's exact semantics, and their AMSGrad variants.
//
// One step for one element, as torch.optim.Adam(W) computes it (single-tensor path):
//
//   g  = grad / grad_scale,  negated when maximize
//   Adam  (L2):        g  = g + weight_decay * w            (only when weight_decay != 0)
//   AdamW (decoupled): w  = w * (1 - lr * weight_decay)
//   m  = lerp(m, g, 1 - beta1)
//   v  = beta2 * v + (1 - beta2) * g * g
//   AMSGrad:           v_max = maximum(v_max, v), and v_max replaces v below
//   w  = w - (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//
// (computed as sqrt(v) * (1 / sqrt(1 - beta2^t)) + eps, fused)
//
// The bias corrections are computed once per step in double, then rounded to float, as
// PyTorch does with its Python-float scalars. Every multiply that feeds an add is written
// as an explicit fma, so no compiler can contract it differently in another build, on
// another value type or on the device. (Where PyTorch rounds twice, w * (1 - lr * wd) and
// then the step, this rounds once: the difference is within float rounding.)
#pragma once

#include <tierstate/core/concepts.hpp>
#include <tierstate/core/error.hpp>
#include <tierstate/core/math.hpp>
#include <tierstate/rules/rule.hpp>

#include <array>
#include <span>
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>

namespace tierstate::inline TIERSTATE_ABI {

/// How a rule applies weight decay.
enum class weight_decay_mode : std::uint8_t {
  l2,         ///< torch.optim.Adam: weight_decay * w is added to the gradient
  decoupled,  ///< torch.optim.AdamW: w is scaled by 1 - lr * weight_decay
};

/// The Adam family. Use the aliases Adam, AdamW, AdamAmsgrad and AdamWAmsgrad.
template <weight_decay_mode Decay, bool Amsgrad>
struct AdamRule {
  static constexpr weight_decay_mode decay_mode = Decay;
  static constexpr bool amsgrad                 = Amsgrad;

  static constexpr std::string_view name =
    Decay == weight_decay_mode::l2 ? (Amsgrad ? "adam_amsgrad" : "adam")
                                   : (Amsgrad ? "adamw_amsgrad" : "adamw");

  /// The state arrays besides the master, in this order in `update`'s state argument.
  static constexpr auto slots = [] {
    if constexpr (Amsgrad) {
      return std::array<slot, 3>{slot::exp_avg, slot::exp_avg_sq, slot::max_exp_avg_sq};
    } else {
      return std::array<slot, 2>{slot::exp_avg, slot::exp_avg_sq};
    }
  }();
  static constexpr std::size_t slot_count = slots.size();

  /// torch.optim's arguments and defaults (AdamW's weight_decay defaults to 0.01, Adam's
  /// to 0).
  struct hyperparameters {
    double lr                   = 1e-3;
    std::array<double, 2> betas = {0.9, 0.999};
    double eps                  = 1e-8;
    double weight_decay         = Decay == weight_decay_mode::decoupled ? 1e-2 : 0.0;
    bool maximize               = false;
  };

  /// The table (rules/rule.hpp): validation, and the values a checkpoint records in this
  /// order (lr, beta1, beta2, eps, weight_decay, maximize), come from it. The reasons are
  /// torch.optim's.
  static constexpr std::array<hyperparameter<hyperparameters>, 6> hyperparameter_table{{
    number_row<hyperparameters, &hyperparameters::lr>("lr", value_range::at_least(0.0),
                                                      "the learning rate must be >= 0"),
    element_row<hyperparameters, &hyperparameters::betas, 0>("betas[0]", value_range::half_open(0.0, 1.0),
                                                             "beta1 must be in [0, 1)"),
    element_row<hyperparameters, &hyperparameters::betas, 1>("betas[1]", value_range::half_open(0.0, 1.0),
                                                             "beta2 must be in [0, 1)"),
    number_row<hyperparameters, &hyperparameters::eps>("eps", value_range::at_least(0.0), "epsilon must be >= 0"),
    number_row<hyperparameters, &hyperparameters::weight_decay>("weight_decay", value_range::at_least(0.0),
                                                                "weight decay must be >= 0"),
    flag_row<hyperparameters, &hyperparameters::maximize>("maximize"),
  }};

  /// Everything one element's update needs for one step, in float.
  struct coefficients {
    float grad_mul;        ///< 1 / grad_scale, negated when maximize
    float l2;              ///< Adam: weight_decay (0 disables the term)
    float decay;           ///< AdamW: 1 - lr * weight_decay
    float lerp_weight;     ///< 1 - beta1, as torch's lerp receives it
    bool lerp_from_start;  ///< |lerp_weight| < 0.5: torch's lerp interpolates from m
    float beta2;
    float one_minus_beta2;
    float neg_step_size;  ///< -lr / (1 - beta1^t)
    float inv_bias_correction2_sqrt;  ///< 1 / sqrt(1 - beta2^t)
    float eps;
  };

  /// Throws tierstate::invalid_option, naming the field and the value, for exactly the
  /// values torch.optim.AdamW refuses (a NaN is refused everywhere): the table's ranges.
  static void validate(hyperparameters const& h) { validate_hyperparameters<AdamRule>(h); }

  /// The coefficients of step `step` (1 for the first step, as torch counts), for gradients
  /// multiplied by `grad_scale` (GradScaler's scale; 1 when unscaled). Validates `h`.
  [[nodiscard]] static coefficients coefficients_for(hyperparameters const& h, std::int64_t step,
                                                     double grad_scale = 1.0)
  {
    validate(h);
    validate_step(name, step, grad_scale);
    auto const t       = static_cast<double>(step);
    double const bc1   = 1.0 - std::pow(h.betas[0], t);
    double const bc2   = 1.0 - std::pow(h.betas[1], t);
    float const inv    = static_cast<float>(1.0 / grad_scale);  // GradScaler's fp32 inv_scale
    float const weight = static_cast<float>(1.0 - h.betas[0]);

    coefficients k{};
    k.grad_mul              = h.maximize ? -inv : inv;
    k.l2                    = Decay == weight_decay_mode::l2 ? static_cast<float>(h.weight_decay) : 0.0f;
    k.decay                 = Decay == weight_decay_mode::decoupled
                                ? static_cast<float>(1.0 - h.lr * h.weight_decay)
                                : 1.0f;
    k.lerp_weight           = weight;
    k.lerp_from_start       = weight < 0.5f;
    k.beta2                 = static_cast<float>(h.betas[1]);
    k.one_minus_beta2       = static_cast<float>(1.0 - h.betas[1]);
    k.neg_step_size         = static_cast<float>(-(h.lr / bc1));
    k.inv_bias_correction2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
    k.eps                   = static_cast<float>(h.eps);
    return k;
  }

  /// One step for one element (V = float) or one batch of elements (V = SIMD batch).
  /// `w` is the fp32 weight (the master, or the fp32 param itself); `state` holds the
  /// slots in the order of `slots`.
  template <class V>
  TIERSTATE_HOST_DEVICE static void update(coefficients const& k, V& w, V g,
                                           V (&state)[slot_count]) noexcept
  {
    V& m = state[0];
    V& v = state[1];

    // The scaling is an fma with a zero addend rather than a multiply: a bare product that
    // feeds the subtraction below could be contracted into an fms by one compiler and not
    // by another (g++ and nvcc contract across statements), which would change the bits.
    g = math::fma(g, V(k.grad_mul), V(0.0f));
    if constexpr (Decay == weight_decay_mode::l2) {
      if (k.l2 != 0.0f) { g = math::fma(V(k.l2), w, g); }
    }

    // torch's lerp: interpolate from the nearer end, in one fused step.
    V const diff = g - m;
    if (k.lerp_from_start) {
      m = math::fma(V(k.lerp_weight), diff, m);
    } else {
      m = math::fma(V(k.lerp_weight - 1.0f), diff, g);
    }
    v = math::fma(V(k.one_minus_beta2) * g, g, V(k.beta2) * v);

    V second = v;
    if constexpr (Amsgrad) {
      state[2] = math::maximum(state[2], v);
      second   = state[2];
    }
    // torch divides by sqrt(1 - beta2^t); multiplying by its inverse (made in double)
    // differs by at most an ulp and spares a division, the costliest instruction here.
    V const denom = math::fma(math::sqrt(second), V(k.inv_bias_correction2_sqrt), V(k.eps));
    V const delta = (V(k.neg_step_size) * m) / denom;
    if constexpr (Decay == weight_decay_mode::decoupled) {
      w = math::fma(w, V(k.decay), delta);  // w * (1 - lr * wd), then the step, fused
    } else {
      w = w + delta;
    }
  }
};

/// torch.optim.Adam: L2 weight decay folded into the gradient.
using Adam = AdamRule<weight_decay_mode::l2, false>;
/// torch.optim.AdamW: decoupled weight decay.
using AdamW = AdamRule<weight_decay_mode::decoupled, false>;
/// torch.optim.Adam(amsgrad=True): one more slot, max_exp_avg_sq.
using AdamAmsgrad = AdamRule<weight_decay_mode::l2, true>;
/// torch.optim.AdamW(amsgrad=True).
using AdamWAmsgrad = AdamRule<weight_decay_mode::decoupled, true>;

static_assert(rule<Adam> && rule<AdamW> && rule<AdamAmsgrad> && rule<AdamWAmsgrad>);

}  // namespace tierstate
