// SPDX-License-Identifier: Apache-2.0
// Slots: the per-element arrays of optimizer state. (What a rule is: rules/rule.hpp.)
#pragma once

#include <tierstate/core/config.hpp>

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

}  // namespace tierstate
