// SPDX-License-Identifier: Apache-2.0
// A plain reference per rule, for the tests that run every rule the same way: one element's
// step in double (the rule's semantics written out straightforwardly), or, for bf16 state,
// in float with the state rounded to bf16 after the step (support.hpp says why).
//
// reference_model<R>(hyperparameters, bf16_state).step(element, grad, lr, step, grad_scale);
// the element's `m` holds a one-slot rule's slot.
#pragma once

#include "support.hpp"

#include <cmath>

namespace tierstate::test {

template <class R>
struct reference_model;

template <weight_decay_mode D, bool A>
struct reference_model<AdamRule<D, A>> {
  reference_options o;
  reference_model(typename AdamRule<D, A>::hyperparameters const& h, bool bf16_state)
    : o(reference_for<AdamRule<D, A>>(h, bf16_state))
  {
  }
  void step(reference_element& e, float grad, double lr, int t, double scale) const
  {
    reference_step(e, grad, lr, t, scale, o);
  }
};

template <>
struct reference_model<SGDMomentum> {
  SGDMomentum::hyperparameters h;
  bool bf16_state;
  reference_model(SGDMomentum::hyperparameters const& hp, bool bf16) : h(hp), bf16_state(bf16) {}

  void step(reference_element& e, float grad, double lr, int t, double scale) const
  {
    if (bf16_state) {
      // As the rule computes it, in float, each fma once.
      auto const f    = [](double x) { return static_cast<float>(x); };
      float const inv = f(1.0 / scale);
      float w = f(e.w), m = f(e.m);
      float g = std::fma(grad, h.maximize ? -inv : inv, 0.0f);
      if (h.weight_decay != 0.0) { g = std::fma(w, f(h.weight_decay), g); }
      m = t == 1 ? g : std::fma(g, f(1.0 - h.dampening), f(h.momentum) * m);
      float const dir = h.nesterov ? std::fma(m, f(h.momentum), g) : m;
      e.w = std::fma(dir, f(-lr), w);
      e.m = static_cast<float>(bf16(m));
      return;
    }
    double g = static_cast<double>(grad) / scale;
    if (h.maximize) { g = -g; }
    g += h.weight_decay * e.w;
    e.m = t == 1 ? g : h.momentum * e.m + (1.0 - h.dampening) * g;
    e.w -= lr * (h.nesterov ? g + h.momentum * e.m : e.m);
  }
};

template <>
struct reference_model<SGD> {
  SGD::hyperparameters h;
  bool bf16_state;  // (no state to round)
  reference_model(SGD::hyperparameters const& hp, bool bf16) : h(hp), bf16_state(bf16) {}

  void step(reference_element& e, float grad, double lr, int, double scale) const
  {
    double g = static_cast<double>(grad) / scale;
    if (h.maximize) { g = -g; }
    e.w -= lr * (g + h.weight_decay * e.w);
  }
};

template <>
struct reference_model<Lion> {
  Lion::hyperparameters h;
  bool bf16_state;
  reference_model(Lion::hyperparameters const& hp, bool bf16) : h(hp), bf16_state(bf16) {}

  static double sign(double x) { return x > 0 ? 1.0 : (x < 0 ? -1.0 : 0.0); }

  void step(reference_element& e, float grad, double lr, int, double scale) const
  {
    // Always in float, each fma once, as the rule computes it: in double, the sign of c
    // would differ wherever c lies within float rounding of zero (fp16 gradients make such
    // places common), and each such place moves w by 2 lr. tests/golden holds Lion against
    // the paper's update written out in torch.
    double const b1 = h.betas[0], b2 = h.betas[1];
    auto const f    = [](double x) { return static_cast<float>(x); };
    float const inv = f(1.0 / scale);
    float w = f(e.w), m = f(e.m);
    float const g = std::fma(grad, h.maximize ? -inv : inv, 0.0f);
    float const c = std::fma(g, f(1.0 - b1), f(b1) * m);
    w   = std::fma(static_cast<float>(sign(c)), f(-lr), w * f(1.0 - lr * h.weight_decay));
    m   = std::fma(g, f(1.0 - b2), f(b2) * m);
    e.w = w;
    e.m = bf16_state ? static_cast<float>(bf16(m)) : m;
  }
};

/// Hyper-parameters off each rule's defaults, reaching its other branches: weight decay,
/// maximize, and beta1 < 0.5 (Adam's lerp from the far end), dampening, Nesterov.
template <class R>
typename R::hyperparameters unusual_hyperparameters()
{
  typename R::hyperparameters h;
  h.weight_decay = 0.1;
  h.maximize     = true;
  if constexpr (requires { h.eps; }) {
    h.betas = {0.3, 0.95};
    h.eps   = 1e-6;
  } else if constexpr (requires { h.betas; }) {
    h.betas = {0.3, 0.9};
  } else if constexpr (R::slot_count == 1) {
    h.momentum = 0.8;
    h.nesterov = true;
  } else {
    h.dampening = 0.5;  // no effect without momentum, as in torch
  }
  return h;
}

/// The same with dampening instead of Nesterov, for SGD; for the others, unusual_hyperparameters.
template <class R>
typename R::hyperparameters unusual_hyperparameters_2()
{
  auto h = unusual_hyperparameters<R>();
  if constexpr (requires { h.dampening; }) {
    h.nesterov  = false;
    h.dampening = 0.3;
    h.maximize  = false;
  }
  return h;
}

}  // namespace tierstate::test
