// SPDX-License-Identifier: Apache-2.0
// A rule that declares a tensor phase (`reduce_passes`) but leaves out how a pass ends
// (finish_pass): refused with the sentence that lists what a tensor phase needs.
// expect: tierstate: a rule with `reduce_passes` (a tensor phase) needs `reduce_passes` >= 1, `static std::size_t tensor_state_size(tensor_shape)`, `static std::size_t statistics_size(tensor_shape, unsigned pass)`, `static void reduce_row(coefficients const&, unsigned pass, tensor_shape, float const* tensor_state, std::size_t row, std::span<float const> grad, double* statistics)` and `static void finish_pass(coefficients const&, unsigned pass, tensor_shape, double const* statistics, float* tensor_state)` (rules/rule.hpp)
#include <tierstate/tierstate.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

struct HalfPhased {
  static constexpr std::string_view name = "half_phased";
  static constexpr std::array<tierstate::slot, 1> slots{tierstate::slot{"buffer"}};
  struct hyperparameters {};
  static constexpr std::array<tierstate::hyperparameter<hyperparameters>, 0> hyperparameter_table{};
  struct coefficients {};
  static coefficients coefficients_for(hyperparameters const&, std::int64_t, double) { return {}; }
  static constexpr unsigned reduce_passes = 1;
  static std::size_t tensor_state_size(tierstate::tensor_shape s) { return s.rows; }
  static std::size_t statistics_size(tierstate::tensor_shape s, unsigned) { return s.rows; }
  static void reduce_row(coefficients const&, unsigned, tierstate::tensor_shape, float const*, std::size_t,
                         std::span<float const>, double*)
  {
  }
  template <class V>
  static void update(coefficients const&, V&, V, V (&)[1], tierstate::tensor_position<V> const&) noexcept
  {
  }
};

using Opt = tierstate::OffloadedOptimizer<HalfPhased>;
static_assert(sizeof(Opt) > 0);
