// SPDX-License-Identifier: Apache-2.0
// The host kernels' building blocks over xsimd batches: the math::ops specialization that
// lets rules run on batches, and loads and stores that convert bf16 and fp16 storage to
// and from float batches.
//
// Everything here is a template on the xsimd architecture tag A, and its choices depend on
// A alone (and F16C, which the inline namespace TIERSTATE_ABI names): code for two
// architectures never shares a mangled name. Where an architecture has no instruction for
// a step (no FMA on SSE2, no F16C, an architecture not listed here), a portable path
// computes the same bits.
#pragma once

#include <tierstate/core/config.hpp>
#include <tierstate/core/math.hpp>
#include <tierstate/core/numeric.hpp>
#include <tierstate/kernels/host/detail/xsimd_compat.hpp>

#include <xsimd/xsimd.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if XSIMD_WITH_SSE2
#include <immintrin.h>
#endif

namespace tierstate::inline TIERSTATE_ABI::host {
namespace detail {

template <class A>
using float_batch = xsimd::batch<float, A>;
template <class A>
using int_batch = xsimd::batch<std::int32_t, A>;

template <class A>
inline constexpr bool is_avx512 = std::is_base_of_v<xsimd::avx512f, A>;
template <class A>
inline constexpr bool is_avx2 = !is_avx512<A> && std::is_base_of_v<xsimd::avx2, A>;
// Four-lane SSE architectures (avx derives from sse4_2 but has eight lanes).
template <class A>
inline constexpr bool is_sse = std::is_base_of_v<xsimd::sse2, A> && !std::is_base_of_v<xsimd::avx, A>;
template <class A>
inline constexpr bool has_fma_instruction =
  is_avx512<A> || std::is_base_of_v<xsimd::fma3<xsimd::avx2>, A> ||
  std::is_base_of_v<xsimd::fma3<xsimd::avx>, A> || std::is_base_of_v<xsimd::fma3<xsimd::sse4_2>, A>;
#if defined(__F16C__)
inline constexpr bool has_f16c = true;
#else
inline constexpr bool has_f16c = false;
#endif

/// Applies `f` lane by lane through memory: the portable path for steps an architecture
/// has no instruction for. Same bits as the scalar code, by construction.
template <class A, class F, class... B>
TIERSTATE_ALWAYS_INLINE float_batch<A> lanewise(F f, B const&... in) noexcept
{
  constexpr std::size_t n = float_batch<A>::size;
  alignas(64) float args[sizeof...(B)][n];
  std::size_t k = 0;
  ((in.store_unaligned(args[k++])), ...);
  alignas(64) float out[n];
  for (std::size_t i = 0; i < n; ++i) {
    out[i] = [&]<std::size_t... J>(std::index_sequence<J...>) {
      return f(args[J][i]...);
    }(std::index_sequence_for<B...>{});
  }
  return float_batch<A>::load_unaligned(out);
}

/// Loads n = batch size uint16 values, zero-extended into int32 lanes.
template <class A>
TIERSTATE_ALWAYS_INLINE int_batch<A> load_u16(std::uint16_t const* p) noexcept
{
#if XSIMD_WITH_AVX512F
  if constexpr (is_avx512<A>) {
    return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<__m256i const*>(p)));
  } else
#endif
#if XSIMD_WITH_AVX2
  if constexpr (is_avx2<A>) {
    return _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<__m128i const*>(p)));
  } else
#endif
#if XSIMD_WITH_SSE2
  if constexpr (is_sse<A>) {
    __m128i const v = _mm_loadl_epi64(reinterpret_cast<__m128i const*>(p));
    return _mm_unpacklo_epi16(v, _mm_setzero_si128());
  } else
#endif
  {
    constexpr std::size_t n = int_batch<A>::size;
    alignas(64) std::int32_t wide[n];
    for (std::size_t i = 0; i < n; ++i) { wide[i] = p[i]; }
    return int_batch<A>::load_unaligned(wide);
  }
}

#if XSIMD_WITH_AVX
/// The 16-bit values of one batch (Stream: a non-temporal store, `p` aligned to the batch's
/// bytes; see can_stream_16).
template <bool Stream>
TIERSTATE_ALWAYS_INLINE void put_256(void* p, __m256i const& v) noexcept
{
  if constexpr (Stream) {
    _mm256_stream_si256(static_cast<__m256i*>(p), v);
  } else {
    _mm256_storeu_si256(static_cast<__m256i*>(p), v);
  }
}
#endif
#if XSIMD_WITH_SSE2
template <bool Stream>
TIERSTATE_ALWAYS_INLINE void put_128(void* p, __m128i const& v) noexcept
{
  if constexpr (Stream) {
    _mm_stream_si128(static_cast<__m128i*>(p), v);
  } else {
    _mm_storeu_si128(static_cast<__m128i*>(p), v);
  }
}
#endif

/// Orders the non-temporal stores before the stores that follow (another thread may read the
/// values once it sees those).
TIERSTATE_ALWAYS_INLINE void stream_fence() noexcept
{
#if XSIMD_WITH_SSE2
  _mm_sfence();
#endif
}

/// Whether batches of 16-bit values store non-temporally on A (AVX-512 and AVX2: a batch
/// of them is 32 or 16 bytes, one vector store; SSE's 8 bytes are not).
template <class A>
inline constexpr bool can_stream_16 = is_avx512<A> || is_avx2<A>;

/// Stores int32 lanes, each in [0, 65535], as uint16.
template <class A, bool Stream = false>
TIERSTATE_ALWAYS_INLINE void store_u16(std::uint16_t* p, int_batch<A> const& x) noexcept
{
#if XSIMD_WITH_AVX512F
  if constexpr (is_avx512<A>) {
    put_256<Stream>(p, _mm512_cvtepi32_epi16(x));
  } else
#endif
#if XSIMD_WITH_AVX2
  if constexpr (is_avx2<A>) {
    __m256i const v = x;
    put_128<Stream>(p, _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
  } else
#endif
#if XSIMD_WITH_SSE2
  if constexpr (is_sse<A>) {
    // SSE2 has only a signed saturating pack: sign-extend the low 16 bits first, so every
    // value is in int16 range and the pack is exact.
    __m128i const v = _mm_srai_epi32(_mm_slli_epi32(x, 16), 16);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi32(v, v));
  } else
#endif
  {
    constexpr std::size_t n = int_batch<A>::size;
    alignas(64) std::int32_t wide[n];
    x.store_unaligned(wide);
    for (std::size_t i = 0; i < n; ++i) { p[i] = static_cast<std::uint16_t>(wide[i]); }
  }
}

template <class A>
TIERSTATE_ALWAYS_INLINE float_batch<A> bf16_to_float(int_batch<A> const& h) noexcept
{
  return bit_cast<float>(h << 16);
}

template <class A>
TIERSTATE_ALWAYS_INLINE int_batch<A> float_to_bf16(float_batch<A> const& x) noexcept
{
  // Round to nearest even on the raw bits. The sign rides on top: adding the rounding bias
  // can carry into it only from a NaN, and NaNs take the other branch (quiet bit set, sign
  // and top payload kept). Unsigned lanes make every shift logical.
  using U         = xsimd::batch<std::uint32_t, A>;
  using F         = float_batch<A>;
  U const u       = bit_cast<std::uint32_t>(x);
  U const top     = u >> 16;
  U const rounded = (u + U(0x7fffu) + (top & U(1u))) >> 16;
  F const r       = xsimd::select(x == x, bit_cast<float>(rounded),
                                  bit_cast<float>(top | U(0x0040u)));
  return bit_cast<std::int32_t>(r);
}

template <class A>
TIERSTATE_ALWAYS_INLINE float_batch<A> fp16_to_float_portable(int_batch<A> const& h) noexcept
{
  using I      = int_batch<A>;
  I const sign = (h & I(0x8000)) << 16;
  I const em   = h & I(0x7fff);
  I const normal = (em << 13) + I(0x38000000);
  I const special = (em << 13) | I(0x7f800000) | xsimd::select(em > I(0x7c00), I(0x00400000), I(0));
  I const small = bit_cast<std::int32_t>(xsimd::batch_cast<float>(em) * float_batch<A>(0x1p-24f));
  I const r = xsimd::select(em >= I(0x7c00), special, xsimd::select(em < I(0x0400), small, normal));
  return bit_cast<float>(r | sign);
}

template <class A>
TIERSTATE_ALWAYS_INLINE int_batch<A> float_to_fp16_portable(float_batch<A> const& x) noexcept
{
  using I      = int_batch<A>;
  I const i    = bit_cast<std::int32_t>(x);
  I const sign = (i >> 16) & I(0x8000);
  I const a    = i & I(0x7fffffff);
  // Normal halves: rebias the exponent and round to nearest even in the integer domain.
  I const normal = (a + I(static_cast<std::int32_t>(0xc8000fffu)) + ((a >> 13) & I(1))) >> 13;
  // Subnormal halves (|x| < 2^-14): adding 0.5 leaves an ulp of 2^-24, the half subnormal
  // unit, and the FPU's round-to-nearest-even does the rounding.
  I const small = bit_cast<std::int32_t>(bit_cast<float>(a) + float_batch<A>(0.5f)) -
                  I(0x3f000000);
  I const nan = I(0x7e00) | ((a >> 13) & I(0x3ff));
  I r = xsimd::select(a < I(0x38800000), small, normal);
  r   = xsimd::select(a >= I(0x477ff000), I(0x7c00), r);
  r   = xsimd::select(a > I(0x7f800000), nan, r);
  return r | sign;
}

/// Loads one batch of T (float, bf16 or fp16) as float.
template <class A, class T>
TIERSTATE_ALWAYS_INLINE float_batch<A> load_as_float(T const* p) noexcept
{
  if constexpr (std::is_same_v<T, float>) {
    return float_batch<A>::load_unaligned(p);
  } else if constexpr (std::is_same_v<T, bf16>) {
    return bf16_to_float<A>(load_u16<A>(reinterpret_cast<std::uint16_t const*>(p)));
  } else {
    static_assert(std::is_same_v<T, fp16>);
#if XSIMD_WITH_AVX512F
    if constexpr (is_avx512<A>) {
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<__m256i const*>(p)));
    } else
#endif
#if XSIMD_WITH_AVX && defined(__F16C__)
    if constexpr (std::is_base_of_v<xsimd::avx, A>) {
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<__m128i const*>(p)));
    } else
#endif
#if XSIMD_WITH_SSE2 && defined(__F16C__)
    if constexpr (is_sse<A>) {
      return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<__m128i const*>(p)));
    } else
#endif
    {
      return fp16_to_float_portable<A>(load_u16<A>(reinterpret_cast<std::uint16_t const*>(p)));
    }
  }
}

/// Stores one float batch as T, rounding to nearest even. Stream (16-bit T where
/// can_stream_16<A>; `p` aligned to the batch's bytes): a non-temporal store, past the caches
/// without reading the line first, for values that are written and not read again soon;
/// the caller fences (_mm_sfence) before another thread may read them.
template <class A, class T, bool Stream = false>
TIERSTATE_ALWAYS_INLINE void store_rounded(T* p, float_batch<A> const& x) noexcept
{
  static_assert(!Stream || (sizeof(T) == 2 && can_stream_16<A>));
  if constexpr (std::is_same_v<T, float>) {
    x.store_unaligned(p);
  } else if constexpr (std::is_same_v<T, bf16>) {
#if XSIMD_WITH_AVX512DQ && defined(__AVX512BF16__)
    if constexpr (std::is_base_of_v<xsimd::avx512dq, A>) {
      // vcvtneps2bf16 rounds to nearest even and quiets NaN as float_to_bf16 does, but
      // flushes subnormal inputs to zero: batches with a subnormal lane (rare: fpclass
      // category 0x20) take the portable path, so the bits never depend on the instruction.
      __m512 const v = x;
      if (_mm512_fpclass_ps_mask(v, 0x20) == 0) [[likely]] {
        put_256<Stream>(p, (__m256i)_mm512_cvtneps_pbh(v));
        return;
      }
    }
#endif
    store_u16<A, Stream>(reinterpret_cast<std::uint16_t*>(p), float_to_bf16<A>(x));
  } else {
    static_assert(std::is_same_v<T, fp16>);
    constexpr int round = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
#if XSIMD_WITH_AVX512F
    if constexpr (is_avx512<A>) {
      put_256<Stream>(p, _mm512_cvtps_ph(x, round));
    } else
#endif
#if XSIMD_WITH_AVX && defined(__F16C__)
    if constexpr (std::is_base_of_v<xsimd::avx, A>) {
      put_128<Stream>(p, _mm256_cvtps_ph(x, round));
    } else
#endif
#if XSIMD_WITH_SSE2 && defined(__F16C__)
    if constexpr (is_sse<A>) {
      _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_cvtps_ph(x, round));
    } else
#endif
    {
      (void)round;
      store_u16<A, Stream>(reinterpret_cast<std::uint16_t*>(p), float_to_fp16_portable<A>(x));
    }
  }
}

}  // namespace detail
}  // namespace tierstate::host

namespace tierstate::inline TIERSTATE_ABI::math {

/// Rules run on xsimd float batches through these.
template <class A>
struct ops<xsimd::batch<float, A>> {
  using V = xsimd::batch<float, A>;

  TIERSTATE_ALWAYS_INLINE static V fma(V const& a, V const& b, V const& c) noexcept
  {
#if XSIMD_WITH_AVX512F
    if constexpr (host::detail::is_avx512<A>) {
      return _mm512_fmadd_ps(a, b, c);  // xsimd 8.1's avx512 fma is an unfused a * b + c
    } else
#endif
    if constexpr (host::detail::has_fma_instruction<A>) {
      return xsimd::fma(a, b, c);
    } else {
      return host::detail::lanewise<A>([](float x, float y, float z) { return std::fma(x, y, z); },
                                       a, b, c);
    }
  }

  TIERSTATE_ALWAYS_INLINE static V sqrt(V const& a) noexcept { return xsimd::sqrt(a); }

  TIERSTATE_ALWAYS_INLINE static V maximum(V const& a, V const& b) noexcept
  {
    // Ordered comparisons only: xsimd 8.1's != is ordered on AVX-512 (false for NaN).
    return xsimd::select(a == a, xsimd::select(a >= b, a, b), a);
  }

  TIERSTATE_ALWAYS_INLINE static V sign(V const& a) noexcept
  {
    // Ordered comparisons: a NaN lane is neither > 0 nor < 0, so it gives 0, as torch.sign.
    return xsimd::select(a > V(0.0f), V(1.0f), xsimd::select(a < V(0.0f), V(-1.0f), V(0.0f)));
  }

  TIERSTATE_ALWAYS_INLINE static V load(float const* p, std::size_t lanes) noexcept
  {
    if (lanes >= V::size) [[likely]] { return V::load_unaligned(p); }
    alignas(64) float padded[V::size] = {};
    std::memcpy(padded, p, lanes * sizeof(float));
    return V::load_aligned(padded);
  }
};

}  // namespace tierstate::math
