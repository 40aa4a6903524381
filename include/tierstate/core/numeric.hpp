// SPDX-License-Identifier: Apache-2.0
// bf16 and fp16 storage types and their conversions to and from float.
//
// Both are 2-byte storage types (trivially copyable, layout-compatible with CUDA's
// __nv_bfloat16 and __half): arithmetic happens in float. Conversions from float round to
// nearest, ties to even; overflow goes to infinity as IEEE 754 says; NaN stays NaN, whatever
// its payload (the quiet bit is set, the sign and the high payload bits are kept); infinity
// stays infinity. Conversions to float are exact (an fp16 NaN comes back quiet, as x86's
// vcvtph2ps returns it; a bf16 NaN keeps its bits).
//
// The same scalar functions run on the host and inside device code; the host kernels have
// batch versions (kernels/host/detail/convert.hpp) that agree with these bit for bit.
#pragma once

#include <tierstate/core/config.hpp>

#include <cstdint>
#include <string_view>
#include <type_traits>

namespace tierstate::inline TIERSTATE_ABI {
namespace detail {

TIERSTATE_HOST_DEVICE constexpr std::uint32_t bits_of(float x) noexcept
{
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  return __builtin_bit_cast(std::uint32_t, x);
#endif
}

TIERSTATE_HOST_DEVICE constexpr float float_of(std::uint32_t u) noexcept
{
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  return __builtin_bit_cast(float, u);
#endif
}

TIERSTATE_HOST_DEVICE constexpr std::uint16_t float_to_bf16_bits(float x) noexcept
{
  std::uint32_t u = bits_of(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep sign and top payload, force quiet
    return static_cast<std::uint16_t>((u >> 16) | 0x0040u);
  }
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even; carries reach infinity
  return static_cast<std::uint16_t>(u >> 16);
}

TIERSTATE_HOST_DEVICE constexpr float bf16_bits_to_float(std::uint16_t h) noexcept
{
  return float_of(static_cast<std::uint32_t>(h) << 16);  // exact, NaN payload included
}

TIERSTATE_HOST_DEVICE constexpr std::uint16_t float_to_fp16_bits(float x) noexcept
{
  std::uint32_t const u    = bits_of(x);
  std::uint32_t const sign = (u >> 16) & 0x8000u;
  std::uint32_t a          = u & 0x7fffffffu;
  if (a > 0x7f800000u) {  // NaN: keep sign and top payload, force quiet
    return static_cast<std::uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
  }
  if (a >= 0x477ff000u) {  // |x| >= 65520 rounds to infinity (and infinity stays)
    return static_cast<std::uint16_t>(sign | 0x7c00u);
  }
  if (a < 0x38800000u) {  // below 2^-14: a subnormal half (or zero)
    std::uint32_t const e = a >> 23;
    if (e < 102u) { return static_cast<std::uint16_t>(sign); }  // below 2^-25: rounds to 0
    std::uint32_t const m     = (a & 0x7fffffu) | 0x800000u;
    std::uint32_t const shift = 126u - e;  // units of 2^-24
    std::uint32_t q           = m >> shift;
    std::uint32_t const rem   = m & ((1u << shift) - 1u);
    std::uint32_t const half  = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u) != 0u)) { ++q; }
    return static_cast<std::uint16_t>(sign | q);
  }
  a += 0xc8000000u + 0xfffu + ((a >> 13) & 1u);  // rebias 127 -> 15, round to nearest even
  return static_cast<std::uint16_t>(sign | (a >> 13));
}

TIERSTATE_HOST_DEVICE constexpr float fp16_bits_to_float(std::uint16_t h) noexcept
{
  std::uint32_t const sign = (static_cast<std::uint32_t>(h) & 0x8000u) << 16;
  std::uint32_t const e    = (static_cast<std::uint32_t>(h) >> 10) & 0x1fu;
  std::uint32_t const m    = static_cast<std::uint32_t>(h) & 0x3ffu;
  if (e == 0x1fu) {  // infinity, or NaN made quiet
    return float_of(sign | 0x7f800000u | (m << 13) | (m != 0u ? 0x00400000u : 0u));
  }
  if (e == 0u) {  // zero or subnormal: m * 2^-24, exact in float
    return float_of(sign | bits_of(static_cast<float>(m) * 0x1p-24f));
  }
  return float_of(sign | ((e + 112u) << 23) | (m << 13));
}

}  // namespace detail

/// bfloat16: 1 sign, 8 exponent and 7 mantissa bits. A storage type; compute in float.
struct bf16 {
  std::uint16_t bits;

  bf16() = default;
  TIERSTATE_HOST_DEVICE constexpr explicit bf16(float x) noexcept
    : bits(detail::float_to_bf16_bits(x))
  {
  }
  TIERSTATE_HOST_DEVICE constexpr explicit operator float() const noexcept
  {
    return detail::bf16_bits_to_float(bits);
  }
  TIERSTATE_HOST_DEVICE static constexpr bf16 from_bits(std::uint16_t b) noexcept
  {
    bf16 r{};
    r.bits = b;
    return r;
  }
};

/// IEEE 754 binary16: 1 sign, 5 exponent and 10 mantissa bits. A storage type.
struct fp16 {
  std::uint16_t bits;

  fp16() = default;
  TIERSTATE_HOST_DEVICE constexpr explicit fp16(float x) noexcept
    : bits(detail::float_to_fp16_bits(x))
  {
  }
  TIERSTATE_HOST_DEVICE constexpr explicit operator float() const noexcept
  {
    return detail::fp16_bits_to_float(bits);
  }
  TIERSTATE_HOST_DEVICE static constexpr fp16 from_bits(std::uint16_t b) noexcept
  {
    fp16 r{};
    r.bits = b;
    return r;
  }
};

static_assert(sizeof(bf16) == 2 && std::is_trivially_copyable_v<bf16> &&
              std::is_standard_layout_v<bf16>);
static_assert(sizeof(fp16) == 2 && std::is_trivially_copyable_v<fp16> &&
              std::is_standard_layout_v<fp16>);

/// The element types tierstate stores: float, bf16 and fp16.
template <class T>
concept storage_type =
  std::is_same_v<T, float> || std::is_same_v<T, bf16> || std::is_same_v<T, fp16>;

/// Converts between storage types: exact towards float, round-to-nearest-even away from it.
template <storage_type To, storage_type From>
TIERSTATE_HOST_DEVICE constexpr To convert(From x) noexcept
{
  if constexpr (std::is_same_v<To, From>) {
    return x;
  } else if constexpr (std::is_same_v<From, float>) {
    return To(x);
  } else if constexpr (std::is_same_v<To, float>) {
    return static_cast<float>(x);
  } else {
    return To(static_cast<float>(x));
  }
}

/// "fp32", "bf16" or "fp16": the names used in benchmark output and error messages.
template <storage_type T>
inline constexpr std::string_view type_name_v = std::is_same_v<T, float> ? "fp32"
                                                : std::is_same_v<T, bf16> ? "bf16"
                                                                          : "fp16";

}  // namespace tierstate
