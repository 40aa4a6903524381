// SPDX-License-Identifier: Apache-2.0
// A kernel unit of OnHostDispatched (kernels/host/dispatch.hpp): one source file, compiled
// once per level, that defines the kernels of a host_kernels list for that level.
//
//   #include <tierstate/kernels/host/dispatch_unit.hpp>
//   #include "my_kernels.hpp"              // using my_kernels = tierstate::host_kernels<...>;
//   TIERSTATE_HOST_KERNEL_UNIT(my_kernels)
//
// built with -march=x86-64-vN -DTIERSTATE_HOST_KERNEL_LEVEL=N, for N = 2, 3 and 4, and with
// -march=x86-64-v4 -mavx512bf16 -mavx512vbmi -mavx512ifma -DTIERSTATE_HOST_KERNEL_LEVEL=5
// (off x86-64: once, with the program's flags, and N = 0). The flags are checked against the
// level: a unit built wider than its level would run instructions its CPUs may lack.
#pragma once

#include <tierstate/kernels/host/dispatch.hpp>

#include <array>
#include <cstring>

#if !defined(TIERSTATE_HOST_KERNEL_LEVEL)
#error "a kernel unit is built with -DTIERSTATE_HOST_KERNEL_LEVEL=N and -march=x86-64-vN (N = 2, 3, 4; 5 for x86-64-v4-bf16), or N = 0 off x86-64"
#elif defined(__x86_64__)
#if TIERSTATE_HOST_KERNEL_LEVEL == 5
#if !(defined(__AVX512F__) && defined(__AVX512CD__) && defined(__AVX512DQ__) && defined(__AVX512BW__) && \
      defined(__AVX512VL__) && defined(__AVX512BF16__) && defined(__AVX512VBMI__) && defined(__AVX512IFMA__))
#error "TIERSTATE_HOST_KERNEL_LEVEL=5 is built with -march=x86-64-v4 -mavx512bf16 -mavx512vbmi -mavx512ifma"
#endif
#elif TIERSTATE_HOST_KERNEL_LEVEL == 4
#if !(defined(__AVX512F__) && defined(__AVX512CD__) && defined(__AVX512DQ__) && defined(__AVX512BW__) && \
      defined(__AVX512VL__)) || defined(__AVX512BF16__) || defined(__AVX512VBMI__)
#error "TIERSTATE_HOST_KERNEL_LEVEL=4 is built with -march=x86-64-v4 (AVX512F, CD, DQ, BW and VL; no BF16 or VBMI)"
#endif
#elif TIERSTATE_HOST_KERNEL_LEVEL == 3
#if !(defined(__AVX2__) && defined(__FMA__)) || defined(__AVX512F__)
#error "TIERSTATE_HOST_KERNEL_LEVEL=3 is built with -march=x86-64-v3 (AVX2 and FMA, no AVX-512)"
#endif
#elif TIERSTATE_HOST_KERNEL_LEVEL == 2
#if !(defined(__SSE4_2__) && defined(__SSSE3__)) || defined(__AVX__)
#error "TIERSTATE_HOST_KERNEL_LEVEL=2 is built with -march=x86-64-v2 (SSE4.2, no AVX)"
#endif
#else
#error "TIERSTATE_HOST_KERNEL_LEVEL is 2, 3, 4 or 5 on x86-64"
#endif
#elif TIERSTATE_HOST_KERNEL_LEVEL != 0
#error "TIERSTATE_HOST_KERNEL_LEVEL is 0 off x86-64"
#endif

namespace tierstate::inline TIERSTATE_ABI::host::dispatch_detail {

/// Kernel K of a list, for this unit's level: the caller's bytes become this unit's types.
template <class K>
void run_kernel(void const* coefficients, void const* arrays, std::size_t begin, std::size_t end) noexcept
{
  using R = typename K::rule_type;
  using P = typename K::precision_type;
  coefficients_of<K> k;
  arrays_of<K> a;
  std::memcpy(&k, coefficients, sizeof k);
  std::memcpy(&a, arrays, sizeof a);
  host::update_range<R, P>(k, a, begin, end);
}

template <class List>
struct unit_table;
template <class... K>
struct unit_table<host_kernels<K...>> {
  static constexpr std::array<dispatch::kernel_fn, sizeof...(K)> value{&run_kernel<K>...};
};

}  // namespace tierstate::host::dispatch_detail

/// Defines the kernels of the host_kernels list `List` for this unit's level, at namespace
/// scope, once per level in a program.
#define TIERSTATE_HOST_KERNEL_UNIT(List)                                                                 \
  template <>                                                                                           \
  ::tierstate::dispatch::kernel_fn const*                                                               \
  tierstate::dispatch::host_kernel_table<List::key, TIERSTATE_HOST_KERNEL_LEVEL>() noexcept           \
  {                                                                                                     \
    return ::tierstate::host::dispatch_detail::unit_table<List>::value.data();                          \
  }
