// SPDX-License-Identifier: Apache-2.0
// Slots: the per-element arrays of optimizer state. (What a rule is: rules/rule.hpp.)
#pragma once

#include <tierstate/core/config.hpp>

#include <cstdint>
#include <string_view>

namespace tierstate::inline TIERSTATE_ABI {

/// One per-element array of optimizer state, named as PyTorch names it in a state_dict. A
/// rule names its own (`slot{"momentum_buffer"}`); the library's are members: master,
/// exp_avg, exp_avg_sq, max_exp_avg_sq and compensation. Two slots are the same slot when
/// their names are equal. A slot holds a view of its name: make it from a string that
/// outlives it (a literal, as rules do).
class slot {
 public:
  constexpr explicit slot(std::string_view name) noexcept : name_(name) {}

  [[nodiscard]] constexpr std::string_view name() const noexcept { return name_; }
  friend constexpr bool operator==(slot a, slot b) noexcept { return a.name_ == b.name_; }

  static slot const master;          ///< fp32 master weights (only when the param precision is not fp32)
  static slot const exp_avg;         ///< Adam's first moment, m
  static slot const exp_avg_sq;      ///< Adam's second moment, v
  static slot const max_exp_avg_sq;  ///< AMSGrad's running maximum of v
  static slot const compensation;    ///< a bf16 param's rounding error, where it is its own master (Compensated)

 private:
  std::string_view name_;
};

inline constexpr slot slot::master{"master"};
inline constexpr slot slot::exp_avg{"exp_avg"};
inline constexpr slot slot::exp_avg_sq{"exp_avg_sq"};
inline constexpr slot slot::max_exp_avg_sq{"max_exp_avg_sq"};
inline constexpr slot slot::compensation{"compensation"};

[[nodiscard]] constexpr std::string_view slot_name(slot s) noexcept { return s.name(); }

/// The number a checkpoint records for a slot (checkpoint/format.hpp): 0 to 4 for the
/// library's slots, in the order above (so checkpoints of version 1 keep their bytes); for
/// a rule's own, the FNV-1a hash of its name with the top bit set.
[[nodiscard]] constexpr std::uint32_t slot_id(slot s) noexcept
{
  constexpr slot known[] = {slot::master, slot::exp_avg, slot::exp_avg_sq, slot::max_exp_avg_sq,
                            slot::compensation};
  for (std::uint32_t i = 0; i < sizeof known / sizeof known[0]; ++i) {
    if (known[i] == s) { return i; }
  }
  std::uint32_t h = 2166136261u;
  for (char const c : s.name()) {
    h ^= static_cast<unsigned char>(c);
    h *= 16777619u;
  }
  return h | 0x80000000u;
}

}  // namespace tierstate
