// SPDX-License-Identifier: Apache-2.0
// A rule with a tensor phase, written in the tests alone against rules/rule.hpp: momentum
// over a gradient normalized by a factored second moment, Adafactor's way. Its per-tensor
// state is a row factor and a column factor (decaying means of g^2 over each row and each
// column of the tensor's matrix), then the clipping factor and the row factor's mean; it
// takes two passes per step: the factors, then the RMS of the normalized gradient they give
// (clipped to `clip_threshold`, as Adafactor clips its update). It has one per-element slot.
#pragma once

#include <tierstate/core/numeric.hpp>
#include <tierstate/rules/rule.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

namespace tierstate::test {

struct RowColumn {
  static constexpr std::string_view name = "test_row_column";
  static constexpr std::array<slot, 1> slots{slot{"momentum"}};
  struct hyperparameters {
    double lr             = 1e-2;
    double beta           = 0.9;   ///< the factors' decay
    double momentum       = 0.8;
    double eps            = 1e-12; ///< added to each g^2
    double clip_threshold = 1.0;
  };
  static constexpr std::array<hyperparameter<hyperparameters>, 5> hyperparameter_table{{
    {"lr", [](hyperparameters const& h) noexcept { return h.lr; },
     [](hyperparameters& h, double v) noexcept { h.lr = v; }, value_range::at_least(0.0),
     "the learning rate must be >= 0"},
    {"beta", [](hyperparameters const& h) noexcept { return h.beta; },
     [](hyperparameters& h, double v) noexcept { h.beta = v; }, value_range::half_open(0.0, 1.0),
     "beta must be in [0, 1)"},
    {"momentum", [](hyperparameters const& h) noexcept { return h.momentum; },
     [](hyperparameters& h, double v) noexcept { h.momentum = v; }, value_range::half_open(0.0, 1.0),
     "momentum must be in [0, 1)"},
    {"eps", [](hyperparameters const& h) noexcept { return h.eps; },
     [](hyperparameters& h, double v) noexcept { h.eps = v; }, value_range::half_open(1e-30, 1.0),
     "eps must be in [1e-30, 1)"},
    {"clip_threshold", [](hyperparameters const& h) noexcept { return h.clip_threshold; },
     [](hyperparameters& h, double v) noexcept { h.clip_threshold = v; }, value_range::at_least(1e-6),
     "clip_threshold must be >= 1e-6"},
  }};
  struct coefficients {
    float grad_mul, neg_lr, momentum, one_minus_momentum;
    double beta, eps, clip_threshold;
  };
  static coefficients coefficients_for(hyperparameters const& h, std::int64_t, double grad_scale)
  {
    validate_hyperparameters<RowColumn>(h);
    return {static_cast<float>(1.0 / grad_scale), static_cast<float>(-h.lr), static_cast<float>(h.momentum),
            static_cast<float>(1.0 - h.momentum), h.beta, h.eps, h.clip_threshold};
  }

  // The tensor phase. State: rows row factors, columns column factors, the clipping factor,
  // the row factors' mean.
  static constexpr unsigned reduce_passes = 2;
  static std::size_t tensor_state_size(tensor_shape s) { return s.rows + s.columns + 2; }
  static std::size_t statistics_size(tensor_shape s, unsigned pass) { return pass == 0 ? s.rows + s.columns : 1; }

  /// The normalized gradient at one place, in float: what update() computes before clipping.
  template <class V>
  TIERSTATE_HOST_DEVICE static V normalized(coefficients const& k, V g, V row, V column, V row_mean) noexcept
  {
    V const v = row * column / row_mean;
    return g * V(k.grad_mul) / math::sqrt(v);
  }

  static void reduce_row(coefficients const& k, unsigned pass, tensor_shape s, float const* state, std::size_t r,
                         std::span<float const> g, double* statistics)
  {
    if (pass == 0) {
      for (std::size_t c = 0; c < g.size(); ++c) {
        double const x = static_cast<double>(g[c] * k.grad_mul);
        double const q = x * x + k.eps;
        statistics[r] += q;
        statistics[s.rows + c] += q;
      }
    } else {
      for (std::size_t c = 0; c < g.size(); ++c) {
        double const u = normalized<float>(k, g[c], state[r], state[s.rows + c], state[s.rows + s.columns + 1]);
        statistics[0] += u * u;
      }
    }
  }

  static void finish_pass(coefficients const& k, unsigned pass, tensor_shape s, double const* statistics, float* state)
  {
    if (pass == 0) {
      double mean = 0.0;
      for (std::size_t r = 0; r < s.rows; ++r) {
        state[r] = static_cast<float>(k.beta * state[r] + (1.0 - k.beta) * statistics[r] / static_cast<double>(s.columns));
        mean += state[r];
      }
      for (std::size_t c = 0; c < s.columns; ++c) {
        state[s.rows + c] = static_cast<float>(k.beta * state[s.rows + c] +
                                               (1.0 - k.beta) * statistics[s.rows + c] / static_cast<double>(s.rows));
      }
      state[s.rows + s.columns + 1] = static_cast<float>(mean / static_cast<double>(s.rows));
    } else {
      double const rms = std::sqrt(statistics[0] / static_cast<double>(s.elements()));
      state[s.rows + s.columns] = static_cast<float>(1.0 / std::max(1.0, rms / k.clip_threshold));
    }
  }

  template <class V>
  TIERSTATE_HOST_DEVICE static void update(coefficients const& k, V& w, V g, V (&s)[1],
                                           tensor_position<V> const& at) noexcept
  {
    float const* st = at.state;
    std::size_t const rows = at.shape.rows, cols = at.shape.columns;
    V const u = normalized<V>(k, g, V(st[at.row]), at.columns(st + rows), V(st[rows + cols + 1])) * V(st[rows + cols]);
    s[0]      = math::fma(V(k.momentum), s[0], u * V(k.one_minus_momentum));
    w         = math::fma(V(k.neg_lr), s[0], w);
  }
};
static_assert(rule<RowColumn> && has_tensor_phase<RowColumn>);

// --- What the tests run it on, and what it must give ------------------------------------

/// Awkward shapes: rows shorter than a batch, a lone element, a matrix spanning chunks, a
/// tensor registered by count (one row).
constexpr std::array<tensor_shape, 5> rc_shapes{{{37, 53}, {1, 1}, {64, 129}, {5, 3}, {1, 3001}}};
constexpr std::array<std::string_view, 5> rc_names{"t0", "t1", "t2", "t3", "t4"};

inline float rc_grad(int step, std::size_t t, std::size_t i)
{
  // Magnitudes that differ by row, so the factors matter; some steps clip, some do not.
  float const row_scale = 1.0f + 0.5f * static_cast<float>((i / rc_shapes[t].columns) % 3);
  return row_scale * std::sin(0.41f * static_cast<float>(step) + 0.013f * static_cast<float>(i) + static_cast<float>(t));
}

inline RowColumn::hyperparameters rc_hyper()
{
  RowColumn::hyperparameters h;
  h.lr             = 0.02;
  h.clip_threshold = 0.95;
  return h;
}

/// One step over `views`: step(), or a streaming step with the gradients handed over in
/// backward's order.
template <class Opt, class View>
void rc_step(Opt& opt, std::vector<View> const& views, bool streaming)
{
  if (streaming) {
    opt.begin_step();
    for (std::size_t t = views.size(); t-- > 0;) { opt.grad_ready(t, views[t]); }
    (void)opt.finish_step();
  } else {
    (void)opt.step(views);
  }
}

struct rc_result {
  std::vector<std::vector<float>> params, momentum, tensor_state;
  bool operator==(rc_result const&) const = default;
};

/// The run as a plain loop: per tensor, the rule's passes over its rows, then each element
/// updated by the rule's text on floats.
template <class P>
rc_result rc_plain(int steps)
{
  auto const h = rc_hyper();
  rc_result r;
  std::vector<std::vector<float>> master;
  for (auto const sh : rc_shapes) {
    master.emplace_back(sh.elements());
    for (std::size_t i = 0; i < sh.elements(); ++i) {
      master.back()[i] = convert<float>(convert<typename P::param_type>(0.001f * static_cast<float>(i % 97) - 0.05f));
    }
    r.momentum.emplace_back(sh.elements(), 0.0f);
    r.tensor_state.emplace_back(RowColumn::tensor_state_size(sh), 0.0f);
  }
  for (int s = 1; s <= steps; ++s) {
    auto const k = RowColumn::coefficients_for(h, s, 1.0);
    for (std::size_t t = 0; t < rc_shapes.size(); ++t) {
      auto const sh = rc_shapes[t];
      std::vector<float> g(sh.elements());
      for (std::size_t i = 0; i < g.size(); ++i) { g[i] = convert<float>(convert<typename P::grad_type>(rc_grad(s, t, i))); }
      float* st = r.tensor_state[t].data();
      for (unsigned pass = 0; pass < RowColumn::reduce_passes; ++pass) {
        std::vector<double> statistics(RowColumn::statistics_size(sh, pass), 0.0);
        for (std::size_t row = 0; row < sh.rows; ++row) {
          RowColumn::reduce_row(k, pass, sh, st, row, std::span<float const>(g.data() + row * sh.columns, sh.columns),
                                statistics.data());
        }
        RowColumn::finish_pass(k, pass, sh, statistics.data(), st);
      }
      for (std::size_t i = 0; i < g.size(); ++i) {
        float m[1] = {r.momentum[t][i]};
        RowColumn::update(k, master[t][i], g[i], m, tensor_position<float>{st, sh, i / sh.columns, i % sh.columns, 1});
        r.momentum[t][i] = m[0];
      }
    }
  }
  for (auto const& w : master) {
    r.params.emplace_back();
    for (float const x : w) { r.params.back().push_back(convert<float>(convert<typename P::param_type>(x))); }
  }
  return r;
}


}  // namespace tierstate::test
