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
#include <string_view>

#if !defined(TIERSTATE_HOST_KERNEL_LEVEL)
#error "a kernel unit is built with -DTIERSTATE_HOST_KERNEL_LEVEL=N and -march=x86-64-vN (N = 2, 3, 4; 5 for x86-64-v4-bf16), or N = 0 off x86-64"
#elif defined(__x86_64__)
// Exactly the level's instruction-set extensions: an extra -m flag (from CFLAGS, CXXFLAGS or a
// target's options) would let the compiler use instructions that the level's CPUs may lack.
// The ABI tag (core/config.hpp) lists the extensions tierstate's code depends on; the others a
// compiler may emit on its own are refused by name.
#if TIERSTATE_HOST_KERNEL_LEVEL == 2
#define TIERSTATE_DISPATCH_UNIT_ISA "x3s45p"
#define TIERSTATE_DISPATCH_UNIT_FLAGS "-march=x86-64-v2"
#elif TIERSTATE_HOST_KERNEL_LEVEL == 3
#define TIERSTATE_DISPATCH_UNIT_ISA "x3s45payfhbcl"
#define TIERSTATE_DISPATCH_UNIT_FLAGS "-march=x86-64-v3"
#elif TIERSTATE_HOST_KERNEL_LEVEL == 4
#define TIERSTATE_DISPATCH_UNIT_ISA "x3s45payfhbclFCBDV"
#define TIERSTATE_DISPATCH_UNIT_FLAGS "-march=x86-64-v4"
#elif TIERSTATE_HOST_KERNEL_LEVEL == 5
#define TIERSTATE_DISPATCH_UNIT_ISA "x3s45payfhbclFCBDVRM"
#define TIERSTATE_DISPATCH_UNIT_FLAGS "-march=x86-64-v4 -mavx512bf16 -mavx512vbmi -mavx512ifma"
#else
#error "TIERSTATE_HOST_KERNEL_LEVEL is 2, 3, 4 or 5 on x86-64"
#endif
#if defined(__AVXVNNI__) || defined(__AVX512VNNI__) || defined(__GFNI__) || defined(__AVX512VBMI2__) || \
  defined(__AVX512BITALG__) || defined(__AVX512VPOPCNTDQ__) || (TIERSTATE_HOST_KERNEL_LEVEL == 2 && defined(__MOVBE__)) || \
  (TIERSTATE_HOST_KERNEL_LEVEL == 4 && defined(__AVX512IFMA__))
#error "a kernel unit is built with its level's -march alone: VNNI, GFNI, VBMI2, BITALG, VPOPCNTDQ (and MOVBE at x86-64-v2, IFMA at x86-64-v4) are beyond its CPUs"
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

#if defined(__x86_64__)
static_assert(std::string_view(TIERSTATE_DISPATCH_STRING(TIERSTATE_ABI_ISA)) == TIERSTATE_DISPATCH_UNIT_ISA,
              "a kernel unit is built with its level's -march alone (" TIERSTATE_DISPATCH_UNIT_FLAGS
              "): another -m flag lets the compiler use instructions that the level's CPUs may lack");
#endif

}  // namespace tierstate::host::dispatch_detail

/// Defines the kernels of the host_kernels list `List` for this unit's level, at namespace
/// scope, once per level in a program.
#define TIERSTATE_HOST_KERNEL_UNIT(List)                                                                 \
  template <>                                                                                           \
  TIERSTATE_DISPATCH_HIDDEN ::tierstate::dispatch::kernel_fn const*                                     \
  tierstate::dispatch::host_kernel_table<List::key, TIERSTATE_HOST_KERNEL_LEVEL>() noexcept           \
  {                                                                                                     \
    return ::tierstate::host::dispatch_detail::unit_table<List>::value.data();                          \
  }
