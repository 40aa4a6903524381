// SPDX-License-Identifier: Apache-2.0
// The handful of operations a rule's update may use beyond + - * /, written once for every
// value type the update runs on.
//
// A rule's `update` is a template over its value type V: float on the host reference path
// and inside device functors, xsimd::batch<float, Arch> in the host kernels. Rules call
// tierstate::math::fma / sqrt / maximum; each forwards to tierstate::math::ops<V>, which this
// header defines for float and kernels/host/detail/simd.hpp defines for xsimd batches. So a
// rule includes neither xsimd nor CUDA headers.
//
// fma is always a single rounding (fused), on every value type and architecture: where
// the instruction set has no FMA, the batch version is computed lane by lane with the C
// library's correctly rounded fmaf. That is what lets results be bit-identical between a
// SIMD body, its tail, the scalar path and the device path.
#pragma once

#include <tierstate/core/config.hpp>

#include <cmath>
#include <cstddef>

namespace tierstate::inline TIERSTATE_ABI::math {

/// Customization point: specialize for a value type to let rules run on it.
template <class V>
struct ops;

template <>
struct ops<float> {
  TIERSTATE_HOST_DEVICE static float fma(float a, float b, float c) noexcept
  {
    return ::fmaf(a, b, c);
  }
  TIERSTATE_HOST_DEVICE static float sqrt(float a) noexcept { return ::sqrtf(a); }
  TIERSTATE_HOST_DEVICE static float maximum(float a, float b) noexcept
  {
    // torch.maximum: a NaN in either operand gives NaN.
    if (a != a) { return a; }
    return (a >= b) ? a : b;
  }
  /// torch.sign: 1, -1, or 0 for a zero of either sign and for NaN (torch's `(0 < a) - (a < 0)`).
  TIERSTATE_HOST_DEVICE static float sign(float a) noexcept
  {
    return a > 0.0f ? 1.0f : (a < 0.0f ? -1.0f : 0.0f);
  }
  /// p[0] (a float holds one value; `lanes` is 1).
  TIERSTATE_HOST_DEVICE static float load(float const* p, std::size_t) noexcept { return *p; }
};

/// a * b + c with one rounding.
template <class V>
TIERSTATE_HOST_DEVICE V fma(V const& a, V const& b, V const& c) noexcept
{
  return ops<V>::fma(a, b, c);
}

/// Correctly rounded square root.
template <class V>
TIERSTATE_HOST_DEVICE V sqrt(V const& a) noexcept
{
  return ops<V>::sqrt(a);
}

/// The values p[0], ..., p[lanes - 1] in V's first lanes, zeros in the rest: nothing past
/// p[lanes - 1] is read.
template <class V>
TIERSTATE_HOST_DEVICE V load(float const* p, std::size_t lanes) noexcept
{
  return ops<V>::load(p, lanes);
}

/// torch.sign, element-wise: 1, -1, or 0 for zeros and NaN.
template <class V>
TIERSTATE_HOST_DEVICE V sign(V const& a) noexcept
{
  return ops<V>::sign(a);
}

/// Element-wise maximum that propagates NaN from either side (torch.maximum).
template <class V>
TIERSTATE_HOST_DEVICE V maximum(V const& a, V const& b) noexcept
{
  return ops<V>::maximum(a, b);
}

}  // namespace tierstate::math
