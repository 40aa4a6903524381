// SPDX-License-Identifier: Apache-2.0
// Adafactor (Shazeer and Stern 2018) with the semantics of torch.optim.Adafactor (PyTorch
// 2.11): a second moment factored into row and column statistics for every matrix (the last
// two dimensions of a tensor of rank >= 2; the leading ones are a batch of matrices), kept
// whole for vectors, a relative step size, an update clipped by its RMS, and decoupled weight
// decay. Per tensor, at its own step t (g = grad / grad_scale, negated when maximize):
//
//   w2     = t ^ beta2_decay                       (the weight of the new statistics)
//   rho    = min(lr, 1 / sqrt(t))
//   alpha  = max(eps2, RMS(param)) * rho           (the param as it was before this step)
//   matrix: R = lerp(R, mean of g^2 over each row, w2), C = lerp(C, mean over each column, w2)
//           V = R C / max(mean of R over the rows, eps1)        (per matrix of a batch)
//   vector: V = lerp(V, g^2, w2)
//   U      = g / sqrt(max(V, eps1^2))
//   param  = param * (1 - lr * weight_decay) - alpha / max(1, RMS(U) / d) * U
//
// eps1 is torch's eps[0]; torch's None (the param dtype's machine epsilon) is the default
// here for fp32 params: tierstate_torch passes the dtype's. No slot is kept per element: the
// statistics are the rule's tensor state (rules/rule.hpp), and a tensor's passes make them,
// its param's RMS and its update's RMS, in double (torch's norms are fp32 reductions, so the
// results agree to rounding, not to the bit; tests/test_adafactor.cpp says how closely).
// A vector keeps a float per element there: on the host, beside the optimizer, as torch
// keeps `variance`. A tensor added by count is a vector; add it with its shape to factor it.
//
// Tensor state (floats), for batches B of R x C (TR = B * R):
//   matrix: row statistics [0, TR), column statistics [TR, TR + B*C), each matrix's clamped
//           row mean [TR + B*C, TR + B*C + B), then the step's scale -alpha / max(1, RMS(U)/d)
//   vector of n: its statistics [0, n), then the scale
#pragma once

#include <tierstate/core/concepts.hpp>
#include <tierstate/core/error.hpp>
#include <tierstate/core/math.hpp>
#include <tierstate/core/tensor.hpp>
#include <tierstate/rules/rule.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string_view>

namespace tierstate::inline TIERSTATE_ABI {

struct Adafactor {
  static constexpr std::string_view name = "adafactor";
  static constexpr std::array<slot, 0> slots{};
  static constexpr std::size_t slot_count = 0;

  /// torch.optim.Adafactor's arguments and defaults (eps[0]: see the file comment).
  struct hyperparameters {
    double lr                 = 1e-2;
    double beta2_decay        = -0.8;
    std::array<double, 2> eps = {1.1920928955078125e-07, 1e-3};
    double d                  = 1.0;
    double weight_decay       = 0.0;
    bool maximize             = false;
  };

  /// The table (rules/rule.hpp), in torch's words.
  static constexpr std::array<hyperparameter<hyperparameters>, 7> hyperparameter_table{{
    number_row<hyperparameters, &hyperparameters::lr>("lr", value_range::at_least(0.0),
                                                      "the learning rate should be >= 0"),
    number_row<hyperparameters, &hyperparameters::beta2_decay>("beta2_decay", value_range::closed(-std::numeric_limits<double>::infinity(), 0.0),
                                                               "beta2_decay should be <= 0"),
    element_row<hyperparameters, &hyperparameters::eps, 0>("eps[0]", value_range::at_least(0.0),
                                                           "epsilon1 should be >= 0"),
    element_row<hyperparameters, &hyperparameters::eps, 1>("eps[1]", value_range::at_least(0.0),
                                                           "epsilon2 should be >= 0"),
    number_row<hyperparameters, &hyperparameters::d>("d", value_range::at_least(1.0),
                                                     "the clipping threshold d should be >= 1"),
    number_row<hyperparameters, &hyperparameters::weight_decay>("weight_decay", value_range::at_least(0.0),
                                                                "weight_decay should be >= 0"),
    flag_row<hyperparameters, &hyperparameters::maximize>("maximize"),
  }};

  struct coefficients {
    float grad_mul;  ///< 1 / grad_scale, negated when maximize
    float decay;     ///< 1 - lr * weight_decay
    float w2;        ///< t ^ beta2_decay
    float eps1, eps1_squared;
    double rho, eps2, d;
  };

  static void validate(hyperparameters const& h) { validate_hyperparameters<Adafactor>(h); }

  [[nodiscard]] static coefficients coefficients_for(hyperparameters const& h, std::int64_t step,
                                                     double grad_scale = 1.0)
  {
    validate(h);
    validate_step(name, step, grad_scale);
    auto const t      = static_cast<double>(step);
    float const inv   = static_cast<float>(1.0 / grad_scale);
    coefficients k{};
    k.grad_mul     = h.maximize ? -inv : inv;
    k.decay        = h.weight_decay == 0.0 ? 1.0f : static_cast<float>(1.0 - h.lr * h.weight_decay);  // (lr may be inf)
    k.w2           = static_cast<float>(std::pow(t, h.beta2_decay));
    k.eps1         = static_cast<float>(h.eps[0]);
    k.eps1_squared = static_cast<float>(h.eps[0] * h.eps[0]);
    k.rho          = std::min(h.lr, 1.0 / std::sqrt(t));
    k.eps2         = h.eps[1];
    k.d            = h.d;
    return k;
  }

  // --- the tensor phase -------------------------------------------------------------------

  static constexpr unsigned reduce_passes  = 2;  ///< the statistics; RMS(U) and RMS(param)
  static constexpr bool reduce_reads_params = true;

  [[nodiscard]] TIERSTATE_HOST_DEVICE static constexpr std::size_t tensor_state_size(tensor_shape s) noexcept
  {
    return s.vector ? s.columns + 1 : s.total_rows() + s.batches * s.columns + s.batches + 1;
  }
  /// Pass 0: the row sums and column sums of g^2 (a vector: its g^2); pass 1: the sums of
  /// U^2 and of param^2.
  [[nodiscard]] static std::size_t statistics_size(tensor_shape s, unsigned pass) noexcept
  {
    if (pass == 1) { return 2; }
    return s.vector ? s.columns : s.total_rows() + s.batches * s.columns;
  }

  static void reduce_row(coefficients const& k, unsigned pass, tensor_shape s, float const* state, std::size_t r,
                         std::span<float const> grad, std::span<float const> param, double* statistics) noexcept
  {
    std::size_t const columns = s.columns;
    float const mul           = k.grad_mul;
    if (pass == 0) {
      if (s.vector) {
        for (std::size_t c = 0; c < columns; ++c) {
          float const g = grad[c] * mul;
          statistics[c] += g * g;  // torch's grad * grad, in float
        }
        return;
      }
      double* column_sums = statistics + s.total_rows() + (r / s.rows) * columns;
      for (std::size_t c = 0; c < columns; ++c) {
        double const g = grad[c] * mul;
        column_sums[c] += g * g;
      }
      statistics[r] += sum_of(columns, [&](std::size_t c) {
        double const g = grad[c] * mul;
        return g * g;
      });
      return;
    }
    // U at this row's columns, as update() makes it: V is row x column / mean (a matrix).
    float const row     = s.vector ? 1.0f : state[r];
    float const mean    = s.vector ? 1.0f : state[s.total_rows() + s.batches * s.columns + r / s.rows];
    float const* column = s.vector ? state : state + s.total_rows() + (r / s.rows) * columns;
    // In pieces: U in float first (a loop the compiler vectorizes), then its squares summed.
    constexpr std::size_t piece = 512;
    float u[piece];
    double sum = 0.0;
    for (std::size_t c0 = 0; c0 < columns; c0 += piece) {
      std::size_t const m = std::min(piece, columns - c0);
      if (s.vector) {
        for (std::size_t c = 0; c < m; ++c) { u[c] = normalized<float>(k, grad[c0 + c] * mul, column[c0 + c]); }
      } else {
        for (std::size_t c = 0; c < m; ++c) {
          u[c] = normalized<float>(k, grad[c0 + c] * mul, row * column[c0 + c] / mean);
        }
      }
      sum += sum_of(m, [&](std::size_t c) { return static_cast<double>(u[c]) * u[c]; });
    }
    statistics[0] += sum;
    statistics[1] += sum_of(columns, [&](std::size_t c) { return static_cast<double>(param[c]) * param[c]; });
  }

  static void finish_pass(coefficients const& k, unsigned pass, tensor_shape s, double const* statistics,
                          float* state) noexcept
  {
    if (pass == 0) {
      if (s.vector) {
        for (std::size_t c = 0; c < s.columns; ++c) { state[c] = lerp(state[c], static_cast<float>(statistics[c]), k.w2); }
      } else {
        std::size_t const rows = s.total_rows(), columns = s.columns, batches = s.batches;
        for (std::size_t r = 0; r < rows; ++r) { state[r] = lerp(state[r], mean_square(statistics[r], columns), k.w2); }
        for (std::size_t c = 0; c < batches * columns; ++c) {
          state[rows + c] = lerp(state[rows + c], mean_square(statistics[rows + c], s.rows), k.w2);
        }
        for (std::size_t b = 0; b < batches; ++b) {
          double sum = 0.0;
          for (std::size_t r = 0; r < s.rows; ++r) { sum += state[b * s.rows + r]; }
          float const mean = s.rows == 0 ? 0.0f : static_cast<float>(sum / static_cast<double>(s.rows));
          state[rows + batches * columns + b] = std::max(mean, k.eps1);
        }
      }
      return;
    }
    // In double, as torch's Python does with its norms' values.
    auto const root_n  = std::sqrt(static_cast<double>(s.elements()));
    bool const empty   = s.elements() == 0;
    double const alpha = std::max(k.eps2, empty ? 0.0 : rounded_norm(statistics[1]) / root_n) * k.rho;
    double const clip  = std::max(1.0, empty ? 0.0 : rounded_norm(statistics[0]) / (root_n * k.d));
    state[tensor_state_size(s) - 1] = static_cast<float>(-alpha / clip);
  }

  template <class V>
  TIERSTATE_HOST_DEVICE static void update(coefficients const& k, V& w, V g, no_slots&, tensor_position<V> const& at) noexcept
  {
    V const u     = normalized<V>(k, g * V(k.grad_mul), variance_at<V>(at.shape, at.state, at.row, at.column, at.lanes));
    float const s = at.state[tensor_state_size(at.shape) - 1];
    w             = math::fma(u, V(s), w * V(k.decay));
  }

 private:
  /// V at row r (of all batches), columns [c, c + lanes).
  template <class V>
  TIERSTATE_HOST_DEVICE static V variance_at(tensor_shape s, float const* state, std::size_t r, std::size_t c,
                                            std::size_t lanes) noexcept
  {
    if (s.vector) { return math::load<V>(state + c, lanes); }
    std::size_t const rows = s.total_rows(), b = r / s.rows;
    V const column         = math::load<V>(state + rows + b * s.columns + c, lanes);
    return V(state[r]) * column / V(state[rows + s.batches * s.columns + b]);
  }

  /// g / sqrt(max(V, eps1^2)), as torch's clamp_, rsqrt_ and mul_ round it.
  template <class V>
  TIERSTATE_HOST_DEVICE static V normalized(coefficients const& k, V g, V v) noexcept
  {
    return V(1.0f) / math::sqrt(math::maximum(v, V(k.eps1_squared))) * g;
  }

  /// The sum of f(0), ..., f(n - 1) in four interleaved partial sums (not one dependent
  /// chain), in a fixed order.
  template <class F>
  [[nodiscard]] static double sum_of(std::size_t n, F&& f) noexcept
  {
    double part[4] = {0.0, 0.0, 0.0, 0.0};
    std::size_t c = 0;
    for (; c + 4 <= n; c += 4) {
      for (std::size_t j = 0; j < 4; ++j) { part[j] += f(c + j); }
    }
    for (; c < n; ++c) { part[c % 4] += f(c); }
    return (part[0] + part[1]) + (part[2] + part[3]);
  }

  /// torch's lerp of floats.
  [[nodiscard]] static float lerp(float self, float end, float weight) noexcept
  {
    float const diff = end - self;
    return std::abs(weight) < 0.5f ? std::fma(weight, diff, self) : std::fma(-(1.0f - weight), diff, end);
  }

  /// A norm as torch's fp32 reductions round it: the sum of squares' root, in float.
  [[nodiscard]] static double rounded_norm(double squares) noexcept { return static_cast<float>(std::sqrt(squares)); }

  /// torch's `norm(g, dim).square_().div_(n)` from the sum of squares: each step in float.
  [[nodiscard]] static float mean_square(double squares, std::size_t n) noexcept
  {
    if (n == 0) { return 0.0f; }
    auto const norm = static_cast<float>(std::sqrt(squares));
    return norm * norm / static_cast<float>(n);
  }
};

static_assert(rule<Adafactor> && has_tensor_phase<Adafactor>);

}  // namespace tierstate
