// SPDX-License-Identifier: Apache-2.0
// The x86-64 levels of runtime dispatch (kernels/host/dispatch.hpp), and what this CPU lacks of
// each: read from CPUID, and from XCR0 for whether the OS saves the AVX and AVX-512 registers
// (a CPU that has AVX-512 under an OS or hypervisor that does not enable its state cannot run
// it). Every feature each level's -march lets the compiler use is checked.
#pragma once

#include <tierstate/core/config.hpp>

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

namespace tierstate::inline TIERSTATE_ABI::host::detail {

/// One level: its number (TIERSTATE_HOST_KERNEL_LEVEL), its name (TIERSTATE_ARCH's value), and
/// what this CPU lacks of it ("" when it has it all).
struct cpu_level {
  int level;
  char const* name;
  std::string lacks;
};

#if defined(__x86_64__)
/// The levels, widest first.
[[nodiscard]] inline std::array<cpu_level, 4> cpu_levels()
{
  unsigned a = 0, b = 0, c = 0, d = 0;
  unsigned l1c = 0, l7b = 0, l7c = 0, l71a = 0, e1c = 0;
  std::uint64_t xcr0 = 0;
  unsigned const max = __get_cpuid_max(0, nullptr);
  if (max >= 1 && __get_cpuid(1, &a, &b, &c, &d) != 0) { l1c = c; }
  if (max >= 7 && __get_cpuid_count(7, 0, &a, &b, &c, &d) != 0) {
    l7b = b;
    l7c = c;
    if (a >= 1 && __get_cpuid_count(7, 1, &a, &b, &c, &d) != 0) { l71a = a; }
  }
  if (static_cast<unsigned>(__get_cpuid_max(0x80000000u, nullptr)) >= 0x80000001u && __get_cpuid(0x80000001u, &a, &b, &c, &d) != 0) { e1c = c; }
  if ((l1c >> 27 & 1) != 0) {  // OSXSAVE: XGETBV reads XCR0
    unsigned lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    xcr0 = static_cast<std::uint64_t>(hi) << 32 | lo;
  }
  auto bit = [](unsigned r, int i) { return (r >> i & 1) != 0; };
  struct feature {
    char const* name;
    bool present;
  };
  auto lacks = [](std::initializer_list<feature> fs) {
    std::string s;
    for (auto const& f : fs) {
      if (!f.present) { s += (s.empty() ? "" : ", ") + std::string(f.name); }
    }
    return s;
  };
  std::string const v2 = lacks({{"SSE3", bit(l1c, 0)}, {"SSSE3", bit(l1c, 9)}, {"CMPXCHG16B", bit(l1c, 13)},
                                {"SSE4.1", bit(l1c, 19)}, {"SSE4.2", bit(l1c, 20)}, {"POPCNT", bit(l1c, 23)}});
  std::string const v3 = lacks({{"AVX", bit(l1c, 28)}, {"AVX2", bit(l7b, 5)}, {"FMA", bit(l1c, 12)},
                                {"F16C", bit(l1c, 29)}, {"BMI1", bit(l7b, 3)}, {"BMI2", bit(l7b, 8)},
                                {"LZCNT", bit(e1c, 5)}, {"MOVBE", bit(l1c, 22)},
                                {"the OS's AVX state (XCR0)", (xcr0 & 0x6) == 0x6}});
  std::string const v4 = lacks({{"AVX512F", bit(l7b, 16)}, {"AVX512CD", bit(l7b, 28)}, {"AVX512DQ", bit(l7b, 17)},
                                {"AVX512BW", bit(l7b, 30)}, {"AVX512VL", bit(l7b, 31)},
                                {"the OS's AVX-512 state (XCR0)", (xcr0 & 0xe6) == 0xe6}});
  std::string const v5 = lacks({{"AVX512-BF16", bit(l71a, 5)}, {"AVX512-VBMI", bit(l7c, 1)}, {"AVX512-IFMA", bit(l7b, 21)}});
  auto join = [](std::string x, std::string const& y) { return x.empty() ? y : y.empty() ? x : x + ", " + y; };
  return {{{5, "x86-64-v4-bf16", join(join(join(v2, v3), v4), v5)},
           {4, "x86-64-v4", join(join(v2, v3), v4)},
           {3, "x86-64-v3", join(v2, v3)},
           {2, "x86-64-v2", v2}}};
}
#else
/// Off x86-64, one level: the units' own flags.
[[nodiscard]] inline std::array<cpu_level, 1> cpu_levels() { return {{{0, "build", ""}}}; }
#endif

}  // namespace tierstate::host::detail
