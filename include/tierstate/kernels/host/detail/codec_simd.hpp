// SPDX-License-Identifier: Apache-2.0
// Codecs on the host: decode and encode one block through xsimd batches where the codec has a
// batch path, else through its own decode and encode; and a batch of bf16 params rounded
// stochastically (codecs/stochastic_rounding.hpp).
//
// A map codec (codecs/dynamic8.hpp: codes into a fixed map, times the block's scale)
// decodes with one table gather per batch, and encodes with one: its bucket table, indexed by
// the magnitude's exponent and leading mantissa bits, gives the rungs below the bucket and the
// low bits of the one midpoint inside it, and comparing the magnitude's low bits with those
// settles the code. The codes are the ones the codec's encode() makes by
// binary search (tests/test_dynamic8.cpp compares them at every midpoint), so a block's bytes
// do not depend on which path wrote it, nor on host or device.
#pragma once

#include <tierstate/codecs/codec.hpp>
#include <tierstate/codecs/dynamic8.hpp>
#include <tierstate/codecs/stochastic_rounding.hpp>
#include <tierstate/kernels/host/detail/simd.hpp>

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace tierstate::inline TIERSTATE_ABI::host::detail {

/// A block codec whose blocks are a float scale then one 8-bit code per element of a
/// codecs::dynamic_map.
template <class C>
concept map_codec = block_codec<C> && requires {
  { C::map() } -> std::same_as<codecs::dynamic_map const&>;
  { C::is_signed } -> std::convertible_to<bool>;
} && C::block_bytes == sizeof(float) + C::block;

/// Loads n = batch size uint8 values, zero-extended into int32 lanes.
template <class A>
TIERSTATE_ALWAYS_INLINE int_batch<A> load_u8(std::uint8_t const* p) noexcept
{
#if XSIMD_WITH_AVX512F
  if constexpr (is_avx512<A>) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<__m128i const*>(p)));
  } else
#endif
#if XSIMD_WITH_AVX2
  if constexpr (is_avx2<A>) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<__m128i const*>(p)));
  } else
#endif
  {
    constexpr std::size_t n = int_batch<A>::size;
    alignas(64) std::int32_t wide[n];
    for (std::size_t i = 0; i < n; ++i) { wide[i] = p[i]; }
    return int_batch<A>::load_unaligned(wide);
  }
}

/// Stores int32 lanes, each in [0, 255], as uint8.
template <class A>
TIERSTATE_ALWAYS_INLINE void store_u8(std::uint8_t* p, int_batch<A> const& v) noexcept
{
#if XSIMD_WITH_AVX512F
  if constexpr (is_avx512<A>) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(v));
  } else
#endif
  {
    constexpr std::size_t n = int_batch<A>::size;
    alignas(64) std::int32_t wide[n];
    v.store_aligned(wide);
    for (std::size_t i = 0; i < n; ++i) { p[i] = static_cast<std::uint8_t>(wide[i]); }
  }
}

/// table[index] per lane. (xsimd 8.1's batch::gather passes two template arguments to its
/// kernels, which its AVX-512 and AVX2 float overloads do not take: it falls back to a lane
/// by lane insert, several times slower. The instructions, then, where there are some.)
template <class A, class T>
TIERSTATE_ALWAYS_INLINE xsimd::batch<T, A> gather(T const* table, int_batch<A> const& index) noexcept
{
  static_assert(sizeof(T) == 4);
#if XSIMD_WITH_AVX512F
  if constexpr (is_avx512<A>) {
    if constexpr (std::is_same_v<T, float>) {
      return _mm512_i32gather_ps(index, table, 4);
    } else {
      return _mm512_i32gather_epi32(index, table, 4);
    }
  } else
#endif
#if XSIMD_WITH_AVX2
  if constexpr (is_avx2<A>) {
    if constexpr (std::is_same_v<T, float>) {
      return _mm256_i32gather_ps(table, index, 4);
    } else {
      return _mm256_i32gather_epi32(reinterpret_cast<int const*>(table), index, 4);
    }
  } else
#endif
  {
    constexpr std::size_t n = int_batch<A>::size;
    alignas(64) std::int32_t at[n];
    alignas(64) T out[n];
    index.store_aligned(at);
    for (std::size_t i = 0; i < n; ++i) { out[i] = table[at[i]]; }
    return xsimd::batch<T, A>::load_aligned(out);
  }
}

#if XSIMD_WITH_AVX512F && defined(__AVX512VBMI__)
/// A map's 256 values as four planes of bytes (plane b: byte b of each value), for lookups
/// with byte permutes.
struct value_planes {
  alignas(64) std::uint8_t byte[4][256];
};
constexpr value_planes make_value_planes(codecs::dynamic_map const& m) noexcept
{
  value_planes p{};
  for (int c = 0; c < 256; ++c) {
    auto const bits = std::bit_cast<std::uint32_t>(m.value[c]);
    for (int b = 0; b < 4; ++b) { p.byte[b][c] = static_cast<std::uint8_t>(bits >> (8 * b)); }
  }
  return p;
}
template <bool Signed>
inline constexpr value_planes value_planes_of = make_value_planes(Signed ? codecs::detail::signed_dynamic_map : codecs::detail::unsigned_dynamic_map);

/// Decodes 64 codes to their values times `scale` at out[0 .. 64) with byte permutes instead
/// of gathers (7x faster on Zen 5): each plane's byte looked up from two registers' 128 bytes
/// by the code's low 7 bits, the half chosen by its top bit, then the four planes interleaved
/// into floats, multiplied by the scale and their zeros made +0 (codecs::blockwise8::scaled).
/// The interleave (unpack within 128-bit lanes) leaves element 16k + 4L + j at position
/// 16L + 4k + j, so the codes are put there first.
TIERSTATE_ALWAYS_INLINE void decode_values64(value_planes const& p, std::uint8_t const* codes, __m512 scale,
                                             float* out) noexcept
{
  alignas(64) static constexpr std::uint8_t order[64] = {
#define TIERSTATE_ORDER_ROW(L) 4 * (L), 4 * (L) + 1, 4 * (L) + 2, 4 * (L) + 3, 16 + 4 * (L), 17 + 4 * (L), 18 + 4 * (L), \
                               19 + 4 * (L), 32 + 4 * (L), 33 + 4 * (L), 34 + 4 * (L), 35 + 4 * (L), 48 + 4 * (L),  \
                               49 + 4 * (L), 50 + 4 * (L), 51 + 4 * (L)
    TIERSTATE_ORDER_ROW(0), TIERSTATE_ORDER_ROW(1), TIERSTATE_ORDER_ROW(2), TIERSTATE_ORDER_ROW(3)
#undef TIERSTATE_ORDER_ROW
  };
  __m512i const index = _mm512_permutexvar_epi8(_mm512_load_si512(order), _mm512_loadu_si512(codes));
  __mmask64 const upper = _mm512_movepi8_mask(index);
  __m512i b[4];
  for (int k = 0; k < 4; ++k) {
    __m512i const lower = _mm512_permutex2var_epi8(_mm512_load_si512(p.byte[k]), index, _mm512_load_si512(p.byte[k] + 64));
    __m512i const upper_half =
      _mm512_permutex2var_epi8(_mm512_load_si512(p.byte[k] + 128), index, _mm512_load_si512(p.byte[k] + 192));
    b[k] = _mm512_mask_blend_epi8(upper, lower, upper_half);
  }
  __m512i const low01 = _mm512_unpacklo_epi8(b[0], b[1]), high01 = _mm512_unpackhi_epi8(b[0], b[1]);
  __m512i const low23 = _mm512_unpacklo_epi8(b[2], b[3]), high23 = _mm512_unpackhi_epi8(b[2], b[3]);
  auto const store = [&](float* to, __m512i values) {
    __m512 const r = _mm512_mul_ps(_mm512_castsi512_ps(values), scale);
    _mm512_storeu_ps(to, _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(r, _mm512_setzero_ps(), _CMP_NEQ_UQ), r));
  };
  store(out, _mm512_unpacklo_epi16(low01, low23));
  store(out + 16, _mm512_unpackhi_epi16(low01, low23));
  store(out + 32, _mm512_unpacklo_epi16(high01, high23));
  store(out + 48, _mm512_unpackhi_epi16(high01, high23));
}
#endif

/// r with its zeros +0 (codecs::blockwise8::scaled, lane for lane: a compare and a blend,
/// never an add that a contracting compiler could fuse with the multiply before it).
template <class A>
TIERSTATE_ALWAYS_INLINE float_batch<A> positive_zero(float_batch<A> const& r) noexcept
{
  return xsimd::select(r == float_batch<A>(0.0f), float_batch<A>(0.0f), r);
}

/// Decodes a block's first n values into `out`.
template <class C, class A>
TIERSTATE_ALWAYS_INLINE void decode_block(std::byte const* from, float* out, std::size_t n) noexcept
{
  if constexpr (map_codec<C>) {
    constexpr std::size_t N = float_batch<A>::size;
    auto const& m           = C::map();
    float scale;
    std::memcpy(&scale, from, sizeof scale);
    auto const* codes = reinterpret_cast<std::uint8_t const*>(from + sizeof(float));
    float_batch<A> const s(scale);
    std::size_t const whole = n / N * N;
#if XSIMD_WITH_AVX512F && defined(__AVX512VBMI__)
    if constexpr (is_avx512<A> && std::is_same_v<C, codecs::blockwise8<C::is_signed>>) {
      if (n == C::block) {
        for (std::size_t i = 0; i < n; i += 64) { decode_values64(value_planes_of<C::is_signed>, codes + i, s, out + i); }
        return;
      }
    }
#endif
    for (std::size_t i = 0; i < whole; i += N) {
      positive_zero<A>(gather<A>(m.value, load_u8<A>(codes + i)) * s).store_unaligned(out + i);
    }
    for (std::size_t i = whole; i < n; ++i) { out[i] = C::scaled(m.value[codes[i]], scale); }
  } else {
    C::decode(from, out, n);
  }
}

#if XSIMD_WITH_AVX512F
/// A dynamic map's rungs by arithmetic, without a table gather. Within decade i (its c_i
/// values from rung R_i on), the midpoints between the map's values lie on a line: the
/// points of linspace(0.1, 1, c_i + 1) times the decade d_i, so a magnitude x there lies
/// above floor(y) of them, y = (x / d_i - 0.1) c_i / 0.9, clamped to [0, c_i - 1]. The
/// decade is the count of boundaries (the midpoints between decades, exact, from the map)
/// below x: those below x's binade, from a table by its exponent, plus the one inside it
/// (a binade holds one at most). y is computed in float, and the map's values are float
/// roundings of the line, so where y lies within 2^-11 of a whole number the count could be
/// off: those batches take the bucket table instead (about 0.015% of all floats in [0, 1];
/// checked once, 2026-12-04, to agree with the codec's binary search at every float in
/// [0, 1.001]; tests/test_dynamic8.cpp sweeps every 509th and each midpoint's neighbours).
struct rung_tables {
  static constexpr int first_binade = 127 - 24;  ///< 2^-24: every boundary lies above
  alignas(64) std::int32_t below[32];  ///< boundaries below binade first_binade + e
  alignas(64) float inside[32];        ///< the boundary inside it, or +inf
  alignas(64) float slope[16];         ///< by count: c_i / (0.9 d_i); 0 for rung 0 and the last
  alignas(64) float offset[16];        ///< -c_i / 9; 0.5 there (never near a whole number)
  alignas(64) std::int32_t base[16];   ///< R_i; 0, and the last rung
  alignas(64) std::int32_t top[16];    ///< c_i - 1; 0
};
constexpr rung_tables make_rung_tables(codecs::dynamic_map const& m)
{
  rung_tables t{};
  int R[8] = {1}, c[7] = {};
  for (int i = 0; i < 7; ++i) {
    c[i]     = m.is_signed ? 1 << i : 2 << i;
    R[i + 1] = R[i] + c[i];
  }
  if (R[7] != m.rungs) { throw "rung_tables: the map is not 7 decades of 2^i (signed) or 2^(i+1) values"; }
  for (int e = 0; e < 32; ++e) {
    float const lo = std::bit_cast<float>(static_cast<std::uint32_t>(e + rung_tables::first_binade) << 23);
    float const hi = std::bit_cast<float>(static_cast<std::uint32_t>(e + rung_tables::first_binade + 1) << 23);
    t.inside[e]    = std::numeric_limits<float>::infinity();
    for (int i = 0; i < 8; ++i) {
      float const boundary = m.midpoint[R[i] - 1];
      if (boundary < lo) {
        ++t.below[e];
      } else if (boundary < hi) {
        if (t.inside[e] != std::numeric_limits<float>::infinity()) { throw "rung_tables: two boundaries in a binade"; }
        t.inside[e] = boundary;
      }
    }
  }
  constexpr double decade[7] = {1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0};
  for (int k = 0; k < 16; ++k) { t.offset[k] = 0.5f; }
  t.base[8] = m.rungs;
  for (int i = 0; i < 7; ++i) {
    t.slope[i + 1]  = static_cast<float>(c[i] / (0.9 * decade[i]));
    t.offset[i + 1] = static_cast<float>(-c[i] / 9.0);
    t.base[i + 1]   = R[i];
    t.top[i + 1]    = c[i] - 1;
  }
  return t;
}
template <bool Signed>
inline constexpr rung_tables rung_tables_of =
  make_rung_tables(Signed ? codecs::detail::signed_dynamic_map : codecs::detail::unsigned_dynamic_map);

/// The rungs of 16 magnitudes in [0, 1 + a few ulps] (rung_tables), and in `near` the lanes
/// whose estimate may be off by one.
TIERSTATE_ALWAYS_INLINE __m512i estimated_rungs(rung_tables const& t, __m512 ax, __mmask16& near) noexcept
{
  __m512i e = _mm512_sub_epi32(_mm512_srli_epi32(_mm512_castps_si512(ax), 23), _mm512_set1_epi32(rung_tables::first_binade));
  e         = _mm512_min_epi32(_mm512_max_epi32(e, _mm512_setzero_si512()), _mm512_set1_epi32(31));
  __m512i count = _mm512_permutex2var_epi32(_mm512_load_si512(t.below), e, _mm512_load_si512(t.below + 16));
  __m512 const inside = _mm512_permutex2var_ps(_mm512_load_ps(t.inside), e, _mm512_load_ps(t.inside + 16));
  count = _mm512_mask_add_epi32(count, _mm512_cmp_ps_mask(ax, inside, _CMP_GT_OQ), count, _mm512_set1_epi32(1));
  __m512 const y = _mm512_fmadd_ps(ax, _mm512_permutexvar_ps(count, _mm512_load_ps(t.slope)),
                                   _mm512_permutexvar_ps(count, _mm512_load_ps(t.offset)));
  __m512 const whole   = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 const part    = _mm512_sub_ps(y, whole);
  constexpr float slack = 1.0f / 2048;
  near = _mm512_cmp_ps_mask(part, _mm512_set1_ps(slack), _CMP_LT_OQ) |
         _mm512_cmp_ps_mask(part, _mm512_set1_ps(1.0f - slack), _CMP_GT_OQ);
  __m512i const j = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvttps_epi32(whole), _mm512_setzero_si512()),
                                     _mm512_permutexvar_epi32(count, _mm512_load_si512(t.top)));
  return _mm512_add_epi32(j, _mm512_permutexvar_epi32(count, _mm512_load_si512(t.base)));
}
#endif

/// Encodes a block from its first n values (the rest of its codes: the zero code).
template <class C, class A>
TIERSTATE_ALWAYS_INLINE void encode_block(float const* in, std::size_t n, std::byte* to) noexcept
{
  if constexpr (map_codec<C>) {
    using F                 = float_batch<A>;
    using I                 = int_batch<A>;
    constexpr std::size_t N = F::size;
    auto const& m           = C::map();
    std::size_t const whole = n / N * N;

    // The scale (codecs::blockwise8::extremes): the largest and smallest values, any NaN.
    F hi(0.0f), lo(0.0f);
    xsimd::batch_bool<float, A> nan(false);
    for (std::size_t i = 0; i < whole; i += N) {
      F const x = F::load_unaligned(in + i);
      nan       = nan | xsimd::isnan(x);  // (x != x is an ordered compare here: never true)
      hi        = xsimd::max(hi, x);
      lo        = xsimd::min(lo, x);
    }
    typename C::extremes e;  // (xsimd 8.1 has no reduce_max)
#if XSIMD_WITH_AVX512F
    if constexpr (is_avx512<A>) {
      // The lanes' extremes, then extremes::add's rule on them (a zero of either sign, or
      // a NaN lane, which `nan` reports, leaves 0).
      float const reduced[2] = {_mm512_reduce_max_ps(hi), _mm512_reduce_min_ps(lo)};
      e.add(reduced, 2);
    } else
#endif
    {
      alignas(64) float his[N], los[N];
      hi.store_aligned(his);
      lo.store_aligned(los);
      e.add(his, N);
      e.add(los, N);
    }
    e.nan = e.nan || xsimd::any(nan);
    e.add(in + whole, n - whole);
    float const scale = e.scale();
    std::memcpy(to, &scale, sizeof scale);

    auto* codes         = reinterpret_cast<std::uint8_t*>(to + sizeof(float));
    float const inverse = C::inverse_scale(scale);
    if (inverse == 0.0f) {
      std::memset(codes, m.zero_code, C::block);
      return;
    }
    F const inv(inverse);
    I const zero(m.zero_code), first(0), last(codecs::dynamic_map::buckets - 1), base(codecs::dynamic_map::bucket_base);
    I const low16(0xFFFF), low17(0x1FFFF);
    for (std::size_t i = 0; i < whole; i += N) {
      F const x  = F::load_unaligned(in + i) * inv;
      F const ax = xsimd::abs(x);
      auto const bucketed = [&] {
        I const bits = bit_cast<std::int32_t>(ax);
        I const q    = xsimd::min(xsimd::max((bits >> codecs::dynamic_map::bucket_shift) - base, first), last);
        I const e    = gather<A>(m.bucket, q);
        // The rungs below the bucket, + 1 where the bucket's midpoint lies below.
        return I((e >> 17) + xsimd::select((bits & low16) > (e & low17), I(1), first));
      };
      I k;
#if XSIMD_WITH_AVX512F
      if constexpr (is_avx512<A> && std::is_same_v<C, codecs::blockwise8<C::is_signed>>) {
        __mmask16 near;
        k = estimated_rungs(rung_tables_of<C::is_signed>, ax, near);
        if (near != 0) [[unlikely]] { k = bucketed(); }
      } else
#endif
      {
        k = bucketed();
      }
      if constexpr (C::is_signed) {
        auto const negative = bit_cast<std::int32_t>(x) < first;  // the sign bit (-0 encodes as +0 either way)
        store_u8<A>(codes + i, xsimd::select(negative, zero - xsimd::min(k, zero), zero + k));
      } else {
        store_u8<A>(codes + i, k);
      }
    }
    for (std::size_t i = whole; i < C::block; ++i) {
      codes[i] = i < n ? C::code_of(m, in[i] * inverse) : static_cast<std::uint8_t>(m.zero_code);
    }
  } else {
    C::encode(in, n, to);
  }
}

/// Stores w rounded stochastically to bf16 at p[0 .. batch size), lane j the tensor's element
/// index + j with `key`: the bits of codecs::round_stochastic_bf16, lane for lane.
template <class A>
TIERSTATE_ALWAYS_INLINE void store_stochastic(bf16* p, float_batch<A> const& w, std::uint32_t key,
                                              std::size_t index) noexcept
{
  using U                 = xsimd::batch<std::uint32_t, A>;
  constexpr std::size_t N = U::size;
  alignas(64) static constexpr std::uint32_t lane[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  static_assert(N <= 16);
  U x = (U::load_aligned(lane) + U(static_cast<std::uint32_t>(index))) * U(0x9E3779B1u) + U(key);
  x ^= x >> 16;
  x *= U(0x7FEB352Du);
  x ^= x >> 15;
  x *= U(0x846CA68Bu);
  x ^= x >> 16;
  U const b       = bit_cast<std::uint32_t>(w);
  U const rounded = (b + (x & U(0xFFFFu))) >> 16;
  U const nearest = bit_cast<std::uint32_t>(float_to_bf16<A>(w));  // infinities and NaN
  auto const finite = (b & U(0x7F800000u)) != U(0x7F800000u);
  store_u16<A>(reinterpret_cast<std::uint16_t*>(p), bit_cast<std::int32_t>(xsimd::select(finite, rounded, nearest)));
}

}  // namespace tierstate::inline TIERSTATE_ABI::host::detail
