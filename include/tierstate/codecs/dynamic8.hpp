// SPDX-License-Identifier: Apache-2.0
// 8-bit blockwise state: each block of 256 elements stored as its largest magnitude (a
// float, the block's scale) and one 8-bit code per element, a code naming a value of a
// fixed nonlinear map in [-1, 1]: value = map[code] * scale. This is the blockwise dynamic
// quantization of bitsandbytes' 8-bit optimizers (Dettmers et al., "8-bit Optimizers via
// Block-wise Quantization", 2022), with their two maps:
//
//   - `codecs::dynamic8` (signed, for Adam's m, Lion's and SGD's momentum): 0, then for each
//     decade d = 10^-6 .. 10^0, 2^i values (i = 0 .. 6) spread evenly over [0.1 d, d] (the
//     midpoints of 2^i equal steps), with both signs, and 1.0: 256 values;
//   - `codecs::udynamic8` (unsigned, for Adam's v, which is never negative): 0, 2^(i+1)
//     values per decade, and 1.0: 256 values, twice the resolution of the signed map.
//
// Most of the map lies near zero, where a moment's small values are: relative error about
// 1/(2^i) of a decade in the decade i, rather than a linear map's fixed absolute step.
//
// A block (`block_bytes` = 260): the scale as a float, then 256 codes. Encoding picks each
// value's nearest map value (ties to the smaller magnitude), after dividing by the scale
// (multiplying by its float reciprocal). The scale is the block's largest magnitude, and
// negative where that is a negative value's: bitsandbytes keeps it positive, so its largest
// negative value becomes -0.99297 times itself and shrinks again at each decode and encode;
// here it is exact, and a decoded block encodes to the same bytes (a state_dict round trip
// changes nothing). bitsandbytes' blocks decode the same here (their scale is positive). The maps' values are bitsandbytes' own, bit for bit:
// computed in the float32 steps its create_dynamic_map takes, so a code means the same in both. A block holding a non-finite value encodes every code as
// zero with that scale, so it decodes to NaN throughout (a moment that overflowed is lost,
// not silently replaced by finite numbers). A block of zero bytes decodes to zeros.
//
// The host kernels encode and decode whole batches (kernels/host/detail/codec_simd.hpp): the
// map's `bucket` table finds a value's code with one table lookup instead of a search, and
// gives the same codes as encode() below.
#pragma once

#include <tierstate/codecs/codec.hpp>
#include <tierstate/core/config.hpp>
#include <tierstate/core/precision.hpp>

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string_view>

namespace tierstate::inline TIERSTATE_ABI::codecs {

/// A dynamic map and the tables that encode to it.
///
/// The map's magnitudes form a ladder of `rungs` + 1 values, rung 0 = 0 and the last = 1.0;
/// `midpoint[r]` lies between rungs r and r + 1 (and is +inf from `rungs` on). A magnitude
/// x >= 0 encodes to rung k = the number of midpoints below x: the nearest rung, of two as near
/// the lower (each midpoint is the exact one rounded down to float, so `midpoint < x` is exact). Unsigned, the code is k;
/// signed, it is `zero_code` + k for x >= 0 and `zero_code` - min(k, zero_code) below (there
/// is no -1.0, so a magnitude nearest 1.0 takes the largest negative value). `value` is each
/// code's value, in code order (ascending).
///
/// Bucket q holds the floats whose bits shifted right by `bucket_shift` are `bucket_base` + q
/// (an exponent and 7 bits of mantissa). No bucket holds two midpoints, so `bucket[q]` packs
/// the number of midpoints below the bucket (bits 17 and up) and the low 16 bits of the
/// midpoint inside it (bits 0-16: 0xFFFF where there is none): a magnitude x in the bucket is
/// at rung (bucket[q] >> 17) + ((bits of x & 0xFFFF) > (bucket[q] & 0x1FFFF)), its high bits
/// being the midpoint's. q is clamped to [0, buckets - 1]: no midpoint lies in the first
/// bucket or below it, nor in the last (1.0 and up), so the magnitudes clamped there land
/// right whatever their low bits.
struct dynamic_map {
  static constexpr int bucket_shift       = 16;  ///< keeps 7 bits of mantissa
  static constexpr std::int32_t bucket_base = (127 - 23) << 7;  ///< 2^-23: below it, rung 0
  static constexpr int buckets            = 23 * 128 + 1;       ///< through 1.0

  bool is_signed      = false;
  int rungs           = 0;  ///< midpoints: 128 signed, 255 unsigned
  int zero_code       = 0;  ///< the code of 0: 127 signed, 0 unsigned
  float value[256]    = {};
  float midpoint[256] = {};
  std::int32_t bucket[buckets] = {};
};

namespace detail {

/// torch.linspace(0.1, 1, steps)[k] in float32: one fused multiply-add from the nearer end
/// (the product of two floats and a float sum are exact in double here, so rounding that sum
/// to float is the fused result).
constexpr float linspace_at(int k, int steps)
{
  float const step = (1.0f - 0.1f) / static_cast<float>(steps - 1);
  return k < steps / 2 ? static_cast<float>(static_cast<double>(step) * k + static_cast<double>(0.1f))
                       : static_cast<float>(static_cast<double>(-step) * (steps - 1 - k) + 1.0);
}

/// The map bitsandbytes' create_dynamic_map(signed) defines (7 decades, 8 bits), in the
/// float32 steps it computes it with: the midpoints of torch.linspace(0.1, 1, count + 1),
/// times 10^(i - 6) rounded to float.
constexpr dynamic_map make_dynamic_map(bool is_signed)
{
  dynamic_map m;
  m.is_signed = is_signed;
  double ladder[257] = {};
  int n = 0;
  ladder[n++] = 0.0;
  constexpr double decade[7] = {1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0};
  for (int i = 0; i < 7; ++i) {
    int const count = is_signed ? 1 << i : 2 << i;
    for (int j = 0; j < count; ++j) {
      float const mean = (linspace_at(j, count + 1) + linspace_at(j + 1, count + 1)) / 2.0f;
      ladder[n++]      = static_cast<double>(mean * static_cast<float>(decade[i]));
    }
  }
  ladder[n++] = 1.0;
  m.rungs     = n - 1;
  m.zero_code = is_signed ? 127 : 0;
  for (int r = 0; r < 256; ++r) {
    if (r >= m.rungs) {
      m.midpoint[r] = std::numeric_limits<float>::infinity();
      continue;
    }
    // The largest float not above the exact midpoint (a double: the mean of two floats): for
    // a float x, x > that float exactly when x lies above the midpoint.
    double const mid = (ladder[r] + ladder[r + 1]) / 2.0;
    float f          = static_cast<float>(mid);
    if (static_cast<double>(f) > mid) { f = std::bit_cast<float>(std::bit_cast<std::uint32_t>(f) - 1); }
    m.midpoint[r] = f;
  }
  for (int c = 0; c < 256; ++c) {
    int const r = c - m.zero_code;
    m.value[c]  = static_cast<float>(r >= 0 ? ladder[r] : -ladder[-r]);
  }
  // Buckets by a merge walk over the ascending midpoints.
  int below = 0;
  for (int q = 0; q < dynamic_map::buckets; ++q) {
    float const lo = std::bit_cast<float>((dynamic_map::bucket_base + q) << dynamic_map::bucket_shift);
    float const hi = std::bit_cast<float>((dynamic_map::bucket_base + q + 1) << dynamic_map::bucket_shift);
    while (below < m.rungs && m.midpoint[below] < lo) { ++below; }
    bool const inside = below < m.rungs && m.midpoint[below] < hi;
    if (inside && (q == 0 || q + 1 == dynamic_map::buckets)) {
      throw "dynamic_map: a midpoint in the first or last bucket (whose clamped magnitudes are compared by their low bits)";
    }
    // One midpoint at most in [lo, hi): else the packed comparison would not be enough.
    if (inside && below + 1 < m.rungs && m.midpoint[below + 1] < hi) { throw "dynamic_map: a bucket holds two midpoints"; }
    auto const low = inside ? static_cast<std::int32_t>(std::bit_cast<std::uint32_t>(m.midpoint[below]) & 0xFFFFu) : 0xFFFF;
    m.bucket[q]    = below << 17 | low;
  }
  if (m.midpoint[0] < std::bit_cast<float>(dynamic_map::bucket_base << dynamic_map::bucket_shift)) {
    throw "dynamic_map: a midpoint below the first bucket";
  }
  return m;
}

inline constexpr dynamic_map signed_dynamic_map   = make_dynamic_map(true);
inline constexpr dynamic_map unsigned_dynamic_map = make_dynamic_map(false);

#if defined(__CUDACC__)
// Device code cannot index a host constexpr array at run time: the device's copies, one per
// translation unit (nvcc's whole-program mode gives device variables internal linkage).
static __device__ constexpr dynamic_map device_signed_dynamic_map   = make_dynamic_map(true);
static __device__ constexpr dynamic_map device_unsigned_dynamic_map = make_dynamic_map(false);
#endif

template <bool Signed>
TIERSTATE_HOST_DEVICE dynamic_map const& dynamic_map_for() noexcept
{
#if defined(__CUDA_ARCH__)
  return Signed ? device_signed_dynamic_map : device_unsigned_dynamic_map;
#else
  return Signed ? signed_dynamic_map : unsigned_dynamic_map;
#endif
}

/// The rung of magnitude x >= 0: a binary search for the number of midpoints below x.
TIERSTATE_HOST_DEVICE int rung_of(dynamic_map const& m, float x) noexcept
{
  int lo = 0, hi = m.rungs;  // the count lies in [lo, hi]
  while (lo < hi) {
    int const mid = (lo + hi) / 2;
    if (m.midpoint[mid] < x) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

}  // namespace detail

/// Blocks of 256 values, 8-bit codes on a dynamic map (signed or unsigned) and a float scale.
template <bool Signed>
struct blockwise8 {
  static constexpr std::string_view name   = Signed ? "dynamic8_256" : "udynamic8_256";
  static constexpr std::size_t block       = 256;
  static constexpr std::size_t block_bytes = sizeof(float) + block;
  static constexpr bool is_signed          = Signed;
  /// decode and encode are element by element under the block's scale (scaled_map_codec)
  static constexpr bool scaled_map = true;

  TIERSTATE_HOST_DEVICE static dynamic_map const& map() noexcept { return detail::dynamic_map_for<Signed>(); }

  /// The extremes of values seen so far: max(0, largest), min(0, smallest), any NaN.
  struct extremes {
    float hi = 0.0f, lo = 0.0f;
    bool nan = false;
    TIERSTATE_HOST_DEVICE void add(float const* in, std::size_t n) noexcept
    {
      for (std::size_t i = 0; i < n; ++i) {
        nan = nan || in[i] != in[i];
        hi  = in[i] > hi ? in[i] : hi;
        lo  = in[i] < lo ? in[i] : lo;
      }
    }
    /// The block's scale: its largest magnitude, negative (signed map) where that is a
    /// negative value's and no positive one's, so that value encodes as 1.0 exactly (the
    /// signed map has no -1.0) and a decoded block encodes to the same bytes; NaN where a
    /// value is NaN.
    [[nodiscard]] TIERSTATE_HOST_DEVICE float scale() const noexcept
    {
      if (nan) { return std::numeric_limits<float>::quiet_NaN(); }
      if constexpr (Signed) {
        return -lo > hi ? lo : hi;
      } else {
        return -lo > hi ? -lo : hi;  // (magnitudes: v is never negative)
      }
    }
  };

  /// 1 / scale, or 0 where the block is zero, not finite, or so small (subnormal) that its
  /// reciprocal is not finite: every code then the zero code (0 * inf would be NaN, whose
  /// code no two paths would agree on).
  TIERSTATE_HOST_DEVICE static float inverse_scale(float scale) noexcept
  {
    float const inverse = 1.0f / scale;
    float const a       = std::fabs(inverse);
    return a > 0.0f && a <= std::numeric_limits<float>::max() ? inverse : 0.0f;
  }

  /// The code of x (already multiplied by the inverse scale).
  TIERSTATE_HOST_DEVICE static std::uint8_t code_of(dynamic_map const& m, float x) noexcept
  {
    int const k = detail::rung_of(m, std::fabs(x));
    if constexpr (Signed) {
      return static_cast<std::uint8_t>(x < 0.0f ? m.zero_code - (k < m.zero_code ? k : m.zero_code) : m.zero_code + k);
    } else {
      return static_cast<std::uint8_t>(k);
    }
  }

  /// value * scale, a zero always +0 (where code 0's negative value meets a zero scale, or a
  /// negative value's product underflows). (Not `value * scale + 0.0f`: a compiler that
  /// contracts it into a fused multiply-add, as clang and nvcc do by default, rounds an
  /// underflowing negative product to -0.)
  TIERSTATE_HOST_DEVICE static float scaled(float value, float scale) noexcept
  {
    float const r = value * scale;
    return r == 0.0f ? 0.0f : r;
  }

  TIERSTATE_HOST_DEVICE static void decode(std::byte const* from, float* out, std::size_t n) noexcept
  {
    float scale;
    std::memcpy(&scale, from, sizeof scale);
    auto const& m = map();
    for (std::size_t i = 0; i < n; ++i) { out[i] = scaled(m.value[static_cast<std::uint8_t>(from[sizeof(float) + i])], scale); }
  }

  TIERSTATE_HOST_DEVICE static void encode(float const* in, std::size_t n, std::byte* to) noexcept
  {
    extremes e;
    e.add(in, n);
    float const scale = e.scale();
    std::memcpy(to, &scale, sizeof scale);
    float const inverse = inverse_scale(scale);
    auto const& m       = map();
    for (std::size_t i = 0; i < block; ++i) {
      to[sizeof(float) + i] = static_cast<std::byte>(i < n && inverse != 0.0f ? code_of(m, in[i] * inverse) : m.zero_code);
    }
  }
};

/// bitsandbytes' signed dynamic map: Adam's m, momentum.
using dynamic8 = blockwise8<true>;
/// bitsandbytes' unsigned dynamic map: Adam's v.
using udynamic8 = blockwise8<false>;

static_assert(scaled_map_codec<dynamic8> && scaled_map_codec<udynamic8>);

}  // namespace tierstate::inline TIERSTATE_ABI::codecs

namespace tierstate::inline TIERSTATE_ABI {

/// bf16 params and grads, an fp32 master, Adam's m and v in 8-bit blocks (bitsandbytes'
/// AdamW8bit). For Adam and AdamW; a rule with one moment (Lion, SGDMomentum) takes
/// Precision<bf16, bf16, float, codecs::dynamic8>.
using Bf16Mixed8bit = Precision<bf16, bf16, float, slot_codecs<codecs::dynamic8, codecs::udynamic8>>;
/// fp32 params (their own master), Adam's m and v in 8-bit blocks.
using Fp32With8bitState = Precision<float, float, float, slot_codecs<codecs::dynamic8, codecs::udynamic8>>;

}  // namespace tierstate::inline TIERSTATE_ABI
