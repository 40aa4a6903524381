// SPDX-License-Identifier: Apache-2.0
// Slots and the concepts that policies model.
#pragma once

#include <tierstate/core/config.hpp>

#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace tierstate::inline TIERSTATE_ABI {

/// One per-element array of optimizer state. The names are PyTorch's state_dict keys.
enum class slot : std::uint8_t {
  master,          ///< fp32 master weights (only when the param precision is not fp32)
  exp_avg,         ///< Adam's first moment, m
  exp_avg_sq,      ///< Adam's second moment, v
  max_exp_avg_sq,  ///< AMSGrad's running maximum of v
};

[[nodiscard]] constexpr std::string_view slot_name(slot s) noexcept
{
  switch (s) {
    case slot::master: return "master";
    case slot::exp_avg: return "exp_avg";
    case slot::exp_avg_sq: return "exp_avg_sq";
    case slot::max_exp_avg_sq: return "max_exp_avg_sq";
  }
  return "unknown";
}

/// What an optimizer rule provides. A rule is a small struct:
///   - `name`: a short identifier ("adamw");
///   - `slots`: a std::array<slot, N> of the state arrays it keeps besides the master,
///     fixed at compile time;
///   - `hyperparameters`: a struct with defaults, checked by `validate` (which throws
///     tierstate::invalid_option naming the field and the value);
///   - `coefficients`: everything an update needs for one step, made once per step (in
///     double, then rounded) by `coefficients_for(hyperparameters, step, grad_scale)`;
///   - `update(coefficients, weight, grad, state)`: the per-element math, a template over
///     the value type so the same text runs on float, on SIMD batches and on the device.
template <class R>
concept rule = requires(typename R::hyperparameters const& h, typename R::coefficients& k,
                        float& w, float g, float (&s)[R::slots.size()]) {
  { R::name } -> std::convertible_to<std::string_view>;
  { R::slots.size() } -> std::convertible_to<std::size_t>;
  { R::validate(h) };
  { R::coefficients_for(h, std::int64_t{1}, 1.0) } -> std::same_as<typename R::coefficients>;
  { R::update(k, w, g, s) };
};

}  // namespace tierstate
