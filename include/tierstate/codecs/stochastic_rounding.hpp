// SPDX-License-Identifier: Apache-2.0
// Stochastic rounding of a bf16 param that is its own master (Precision's Master =
// StochasticRounding): no fp32 master and no compensation, 2 bytes per element for the
// weight; each update rounds the new weight up or down to a neighbouring bf16, up with the
// probability of its distance from the lower one, so the expected param is the exact weight
// and updates far smaller than a bf16 ulp still move it on average (round to nearest would
// drop them all).
//
// The random bits are a hash of (key, element), where the key is a hash of the optimizer's
// rounding seed, the step count and the tensor's index, and the element is the element's
// index in its tensor: the same bits whatever the chunk size, the thread count, the tier or
// host or device, and a run resumed from a checkpoint with the same seed rounds as the one
// that was not stopped. (Elements 2^32 apart in one tensor share their bits.)
//
// Rounding a float w: add 16 random bits to the 16 bits bf16 drops, and drop them (a carry
// rounds the magnitude up). Infinities and NaN round as float_to_bf16 does.
#pragma once

#include <tierstate/core/config.hpp>
#include <tierstate/core/numeric.hpp>

#include <cstddef>
#include <cstdint>

namespace tierstate::inline TIERSTATE_ABI {

/// A precision's Master where a bf16 param is its own master, rounded stochastically
/// (codecs/stochastic_rounding.hpp).
struct StochasticRounding {};

namespace codecs {

/// 32 well-mixed bits of (key, index): an odd multiply, then xor-shift-multiply rounds.
TIERSTATE_HOST_DEVICE constexpr std::uint32_t rounding_bits(std::uint32_t key, std::uint32_t index) noexcept
{
  std::uint32_t x = index * 0x9E3779B1u + key;
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

/// The key of one tensor's rounding at one step.
TIERSTATE_HOST_DEVICE constexpr std::uint32_t rounding_key(std::uint64_t seed, std::int64_t step, std::size_t tensor) noexcept
{
  auto const s = static_cast<std::uint64_t>(step);
  std::uint32_t k = rounding_bits(static_cast<std::uint32_t>(seed >> 32), static_cast<std::uint32_t>(seed));
  k = rounding_bits(k, static_cast<std::uint32_t>(s));
  k = rounding_bits(k ^ static_cast<std::uint32_t>(s >> 32), static_cast<std::uint32_t>(tensor));
  return rounding_bits(k, static_cast<std::uint32_t>(static_cast<std::uint64_t>(tensor) >> 32));
}

/// w rounded to bf16 with the random bits r (their low 16 used): its bits.
TIERSTATE_HOST_DEVICE std::uint16_t round_stochastic_bf16(float w, std::uint32_t r) noexcept
{
  std::uint32_t const b = tierstate::detail::bits_of(w);
  if ((b & 0x7F800000u) == 0x7F800000u) { return tierstate::detail::float_to_bf16_bits(w); }
  return static_cast<std::uint16_t>((b + (r & 0xFFFFu)) >> 16);
}

/// Element `index` of a tensor rounded with `key`.
TIERSTATE_HOST_DEVICE std::uint16_t round_stochastic_bf16(float w, std::uint32_t key, std::size_t index) noexcept
{
  return round_stochastic_bf16(w, rounding_bits(key, static_cast<std::uint32_t>(index)));
}

}  // namespace codecs
}  // namespace tierstate::inline TIERSTATE_ABI
