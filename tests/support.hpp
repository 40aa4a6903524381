// SPDX-License-Identifier: Apache-2.0
// Shared by the tests: deterministic inputs (bit for bit the same as
// tests/golden/make_golden.py makes them) and a plain double-precision reference of
// torch.optim.Adam/AdamW's update.
#pragma once

#include "compositions.hpp"

#include <tierstate/tierstate.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace tierstate::test {

/// A 32-bit integer hash of (element, step).
inline std::uint32_t mix(std::uint64_t i, std::uint64_t t)
{
  auto x = static_cast<std::uint32_t>(i * 0x9E3779B1u + t * 0x85EBCA77u + 0x165667B1u);
  x ^= x >> 15;
  x *= 0x2C1B3C6Du;
  x ^= x >> 12;
  x *= 0x297A2D39u;
  x ^= x >> 15;
  return x;
}

/// A dyadic value in [-1, 1) with 24 significant bits: exact in float.
inline float unit(std::uint64_t i, std::uint64_t t)
{
  return static_cast<float>(static_cast<double>(mix(i, t) >> 8) * 0x1p-23 - 1.0);
}

/// The gradient of element i at step t: magnitudes from 2^-2 down to 2^-8.
inline float grad_value(std::uint64_t i, std::uint64_t t)
{
  return std::ldexp(unit(i, t), -static_cast<int>(2 + i % 7));
}

/// The initial weight of element i, in [-2, 2).
inline float init_value(std::uint64_t i) { return unit(i, 1'000'003) * 2.0f; }

/// A decaying learning-rate schedule (the same expression as make_golden.py's lr_at).
inline double lr_at(double lr_max, int t, int steps)
{
  return lr_max * (0.1 + 0.9 * static_cast<double>(steps - t) / static_cast<double>(steps));
}

/// Hyper-parameters of the reference, in torch.optim's terms.
struct reference_options {
  bool decoupled      = true;  // AdamW
  bool amsgrad        = false;
  double beta1        = 0.9;
  double beta2        = 0.999;
  double eps          = 1e-8;
  double weight_decay = 0.0;
  bool maximize       = false;
  bool bf16_state     = false;  // round m, v (and v_max) to bf16 after every step
};

struct reference_element {
  double w = 0, m = 0, v = 0, vmax = 0;
};

/// One torch.optim.Adam(W) step for one element, straightforwardly in double.
inline void reference_step_double(reference_element& e, double grad, double lr, int step,
                                  double grad_scale, reference_options const& o)
{
  double g = grad / grad_scale;
  if (o.maximize) { g = -g; }
  if (o.weight_decay != 0.0) {
    if (o.decoupled) {
      e.w *= 1.0 - lr * o.weight_decay;
    } else {
      g += o.weight_decay * e.w;
    }
  }
  e.m += (1.0 - o.beta1) * (g - e.m);
  e.v = o.beta2 * e.v + (1.0 - o.beta2) * g * g;
  double const bc1 = 1.0 - std::pow(o.beta1, step);
  double const bc2 = 1.0 - std::pow(o.beta2, step);
  double second    = e.v;
  if (o.amsgrad) {
    e.vmax = std::max(e.vmax, e.v);
    second = e.vmax;
  }
  double const denom = std::sqrt(second) / std::sqrt(bc2) + o.eps;
  e.w -= (lr / bc1) * e.m / denom;
}

/// The same step in float arithmetic, each operation rounded once as written (fusions are
/// explicit std::fma, where the library documents them), with m, v and v_max rounded to
/// bf16 after the step: the reference for bf16 state. Rounding the state to 8 bits makes
/// the trajectory sensitive to the last bit of m and v, so a double reference would drift
/// by flips of whole bf16 steps; this one makes the same rounding decisions a correct
/// implementation must make.
inline void reference_step_bf16_state(reference_element& e, float grad, double lr, int step,
                                      double grad_scale, reference_options const& o)
{
  auto const f   = [](double x) { return static_cast<float>(x); };
  float const inv = f(1.0 / grad_scale);
  float w = f(e.w), m = f(e.m), v = f(e.v), vmax = f(e.vmax);
  float g = std::fma(grad, o.maximize ? -inv : inv, 0.0f);
  if (!o.decoupled && o.weight_decay != 0.0) { g = std::fma(f(o.weight_decay), w, g); }
  float const lw = f(1.0 - o.beta1);
  m = lw < 0.5f ? std::fma(lw, g - m, m) : std::fma(lw - 1.0f, g - m, g);
  v = std::fma(f(1.0 - o.beta2) * g, g, f(o.beta2) * v);
  float second = v;
  if (o.amsgrad) {
    vmax   = (vmax >= v) ? vmax : v;
    second = vmax;
  }
  float const denom = std::fma(std::sqrt(second), f(1.0 / std::sqrt(1.0 - std::pow(o.beta2, step))), f(o.eps));
  float const delta = (f(-(lr / (1.0 - std::pow(o.beta1, step)))) * m) / denom;
  w = o.decoupled ? std::fma(w, f(1.0 - lr * o.weight_decay), delta) : w + delta;
  e.w    = w;
  e.m    = static_cast<float>(bf16(m));
  e.v    = static_cast<float>(bf16(v));
  e.vmax = static_cast<float>(bf16(vmax));
}

/// One reference step: in double, or for bf16 state as reference_step_bf16_state says.
inline void reference_step(reference_element& e, float grad, double lr, int step,
                           double grad_scale, reference_options const& o)
{
  if (o.bf16_state) {
    reference_step_bf16_state(e, grad, lr, step, grad_scale, o);
  } else {
    reference_step_double(e, grad, lr, step, grad_scale, o);
  }
}

/// The reference options matching a rule and its hyper-parameters.
template <class R>
reference_options reference_for(typename R::hyperparameters const& h, bool bf16_state)
{
  reference_options o;
  o.decoupled    = R::decay_mode == weight_decay_mode::decoupled;
  o.amsgrad      = R::amsgrad;
  o.beta1        = h.betas[0];
  o.beta2        = h.betas[1];
  o.eps          = h.eps;
  o.weight_decay = h.weight_decay;
  o.maximize     = h.maximize;
  o.bf16_state   = bf16_state;
  return o;
}

/// Raw bits of a storage value, for bitwise comparison.
template <class T>
std::uint32_t bits(T x)
{
  if constexpr (std::is_same_v<T, float>) {
    return detail::bits_of(x);
  } else {
    return x.bits;
  }
}

/// "t0", "t1", ... (appended: GCC 12 warns falsely, -Wrestrict, on "literal" + string).
inline std::string tensor_name(std::size_t k) { return std::string("t").append(std::to_string(k)); }

/// A model of several tensors of the given sizes: params from init_value, gradients of step
/// t from grad_value, element numbers running on across the tensors.
template <class P>
struct test_model {
  std::vector<std::vector<typename P::param_type>> params;
  std::vector<std::vector<typename P::grad_type>> grads;
  explicit test_model(std::vector<std::size_t> const& sizes)
  {
    std::size_t base = 0;
    for (std::size_t const n : sizes) {
      params.emplace_back(n);
      grads.emplace_back(n);
      for (std::size_t i = 0; i < n; ++i) { params.back()[i] = convert<typename P::param_type>(init_value(base + i)); }
      base += n;
    }
  }
  void fill_grads(int t)
  {
    std::size_t base = 0;
    for (auto& g : grads) {
      for (std::size_t i = 0; i < g.size(); ++i) { g[i] = convert<typename P::grad_type>(grad_value(base + i, t)); }
      base += g.size();
    }
  }
  [[nodiscard]] std::vector<grad_view<typename P::grad_type>> views() const
  {
    std::vector<grad_view<typename P::grad_type>> v;
    for (auto const& g : grads) { v.push_back({g.data(), g.size(), location::host}); }
    return v;
  }
};

}  // namespace tierstate::test
