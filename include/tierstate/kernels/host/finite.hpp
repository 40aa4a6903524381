// SPDX-License-Identifier: Apache-2.0
// Non-finite detection over gradients (GradScaler's found_inf), on the raw bits: an
// exponent of all ones is an infinity or a NaN, in every storage type.
#pragma once

#include <tierstate/core/numeric.hpp>
#include <tierstate/core/thread_pool.hpp>
#include <tierstate/kernels/host/detail/prefetch.hpp>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace tierstate::inline TIERSTATE_ABI::host {

/// Whether any of x[0, n) is infinite or NaN; single-threaded.
///
/// Per block of 4096 elements, the largest magnitude's bits (the bits with the sign cleared,
/// as unsigned integers: an unsigned max, which orders them as the magnitudes, infinity and
/// NaN above every finite value): one AND and one MAX per vector of gradients, so the pass
/// runs at the memory's read bandwidth, not at the compare's; with each page prefetched a
/// few pages ahead (detail::prefetch_ahead), at that bandwidth over 4 KiB pages too.
template <storage_type T>
[[nodiscard]] bool any_nonfinite(T const* x, std::size_t n) noexcept
{
  using bits_t = std::conditional_t<std::is_same_v<T, float>, std::uint32_t, std::uint16_t>;
  constexpr bits_t magnitude = std::is_same_v<T, float> ? bits_t(0x7fffffffu) : bits_t(0x7fffu);
  constexpr bits_t infinity  = std::is_same_v<T, float>  ? bits_t(0x7f800000u)
                               : std::is_same_v<T, bf16> ? bits_t(0x7f80u)
                                                         : bits_t(0x7c00u);
  static_assert(sizeof(T) == sizeof(bits_t));
  auto const* b = reinterpret_cast<unsigned char const*>(x);
  constexpr std::size_t block = 4096;
  for (std::size_t i = 0; i < n; i += block) {
    std::size_t const m = std::min(block, n - i);
    detail::prefetch_ahead(b + i * sizeof(T), m * sizeof(T));
    bits_t largest      = 0;
    for (std::size_t j = 0; j < m; ++j) {  // vectorized by the compiler: no early exit inside
      bits_t v;
      std::memcpy(&v, b + (i + j) * sizeof(T), sizeof(T));
      v       = static_cast<bits_t>(v & magnitude);
      largest = v > largest ? v : largest;
    }
    if (largest >= infinity) { return true; }
  }
  return false;
}

/// The same over the pool's threads.
template <storage_type T>
[[nodiscard]] bool any_nonfinite(thread_pool& pool, T const* x, std::size_t n)
{
  std::atomic<bool> found{false};
  pool.parallel_for(n, 16384, [&](std::size_t b, std::size_t e) {
    if (!found.load(std::memory_order_relaxed) && any_nonfinite(x + b, e - b)) {
      found.store(true, std::memory_order_relaxed);
    }
  });
  return found.load();
}

}  // namespace tierstate::host
