// SPDX-License-Identifier: Apache-2.0
// The one place that knows which xsimd the headers are built against: Debian's 8.1, or the
// 13 and 14 that Conan Center and vcpkg ship. Where their APIs differ, the host kernels call
// what is here; everything else they call in xsimd directly. The version is told from the
// API itself (a declaration's return type), not from a version number.
#pragma once

#include <tierstate/core/config.hpp>

#include <xsimd/xsimd.hpp>

#include <cstdint>
#include <type_traits>
#include <utility>

namespace tierstate::inline TIERSTATE_ABI::host::detail {

/// Whether xsimd::bitwise_cast takes the batch type it returns (xsimd 8: bitwise_cast<batch<T,
/// A>>(x)) rather than its element type (later versions: bitwise_cast<T>(x)). Only the
/// declaration is looked at (decltype instantiates no body): under 8, bitwise_cast<float>
/// returns a float; later, a batch of them.
template <class A>
inline constexpr bool xsimd_cast_takes_batch =
  std::is_same_v<decltype(xsimd::bitwise_cast<float>(std::declval<xsimd::batch<std::int32_t, A> const&>())), float>;

/// The bits of `x` as a batch of `To` (same lanes, same width), under either API.
template <class To, class From, class A>
TIERSTATE_ALWAYS_INLINE xsimd::batch<To, A> bit_cast(xsimd::batch<From, A> const& x) noexcept
{
  if constexpr (xsimd_cast_takes_batch<A>) {
    return xsimd::bitwise_cast<xsimd::batch<To, A>>(x);
  } else {
    return xsimd::bitwise_cast<To>(x);
  }
}

}  // namespace tierstate::host::detail
