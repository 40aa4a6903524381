// SPDX-License-Identifier: Apache-2.0
// Runtime dispatch of the host kernels: one build that runs on every x86-64 CPU from
// x86-64-v2 on, at the speed of a build for the CPU it runs on.
//
// A program built for plain x86-64 (a wheel, a distribution's package) runs SSE2 kernels
// without FMA, several times slower than a -march=native build. OnHostDispatched<Kernels>
// is a compute policy like OnHost<>, whose update_range runs the kernels of a unit compiled
// for x86-64-v2, v3, v4 (AVX-512) or v4-bf16 (AVX-512 with BF16, VBMI and IFMA: Zen 4,
// Sapphire Rapids and later): the widest the CPU has, or the one TIERSTATE_ARCH names,
// chosen once per process. Everything else (the optimizer, its routes, tiers and
// checks) is compiled once, with the program's own flags.
//
// Kernels lists every (rule, precision) the program's dispatched optimizers use:
//
//   // my_kernels.hpp
//   using my_kernels = tierstate::host_kernels<
//     tierstate::host_kernel<tierstate::AdamW, tierstate::Precision<tierstate::bf16, tierstate::bf16, float, float>>>;
//   // the trainer, built with -march=x86-64
//   tierstate::OffloadedOptimizer<tierstate::AdamW, tierstate::Precision<...>, tierstate::PinnedHost,
//                                 tierstate::Synchronous, tierstate::OnHostDispatched<my_kernels>> opt(...);
//   // my_kernels.cpp, built three times (kernels/host/dispatch_unit.hpp)
//   #include <tierstate/kernels/host/dispatch_unit.hpp>
//   #include "my_kernels.hpp"
//   TIERSTATE_HOST_KERNEL_UNIT(my_kernels)
//
// with -march=x86-64-vN -DTIERSTATE_HOST_KERNEL_LEVEL=N for N = 2, 3, 4, and with
// -march=x86-64-v4 -mavx512bf16 -mavx512vbmi -mavx512ifma -DTIERSTATE_HOST_KERNEL_LEVEL=5
// (the CMake function tierstate_add_host_kernels and Meson's tierstate_kernel_levels do it:
// README "Portable builds"). An optimizer whose (rule, precision) the list lacks does not compile; a program
// without one of the units does not link. Link the program's own objects before the units,
// the narrowest unit first: the standard library's inline functions are not renamed per
// level (core/config.hpp), and a linker keeps the first copy it meets.
//
// The results are bit-identical at every level, and to OnHost<>'s: the kernels fuse their
// multiply-adds everywhere (v2, without an FMA instruction, through the C library's fmaf,
// which is why it is several times slower than v3).
#pragma once

#include <tierstate/core/config.hpp>
#include <tierstate/core/error.hpp>
#include <tierstate/kernels/host/detail/cpu_levels.hpp>
#include <tierstate/kernels/host/on_host.hpp>
#include <tierstate/kernels/host/update.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>


/// What crosses between the program and its kernel units, which are built with different
/// flags and so have different ABI namespaces (core/config.hpp): plain types, and
/// declarations with no body.
#if defined(__GNUC__) || defined(__clang__)
#define TIERSTATE_DISPATCH_HIDDEN __attribute__((visibility("hidden")))
#else
#define TIERSTATE_DISPATCH_HIDDEN
#endif

namespace tierstate::dispatch {

/// One kernel: the rule's coefficients and the update_arrays, as bytes of the caller's types
/// (the same layout as the unit's own: the list's key covers their names and sizes).
using kernel_fn = void (*)(void const* coefficients, void const* arrays, std::size_t begin,
                           std::size_t end) noexcept;

/// The kernels of the list whose key is Key, in its order, compiled for x86-64-vLevel, for
/// x86-64-v4-bf16 (Level 5), or off x86-64 for the unit's flags (Level 0). Defined by
/// TIERSTATE_HOST_KERNEL_UNIT.
/// Hidden: each program or shared library links its own units (a missing one is a link
/// error, not a failure at load), and none can run another's.
template <std::uint64_t Key, int Level>
[[nodiscard]] TIERSTATE_DISPATCH_HIDDEN kernel_fn const* host_kernel_table() noexcept;

}  // namespace tierstate::dispatch

#define TIERSTATE_DISPATCH_STRING2(x) #x
#define TIERSTATE_DISPATCH_STRING(x) TIERSTATE_DISPATCH_STRING2(x)

namespace tierstate::inline TIERSTATE_ABI {

/// One (rule, precision) of a host_kernels list.
template <rule R, precision P>
struct host_kernel {
  using rule_type      = R;
  using precision_type = P;
};

namespace host::dispatch_detail {

/// This unit's ABI namespace as it appears in type names, which the keys leave out.
inline constexpr std::string_view abi_prefix = TIERSTATE_DISPATCH_STRING(TIERSTATE_ABI) "::";

template <class T>
[[nodiscard]] constexpr std::string_view type_name() noexcept
{
  return __PRETTY_FUNCTION__;  // names T in full, with its template arguments
}

[[nodiscard]] constexpr std::uint64_t fnv1a(std::uint64_t h, unsigned char c) noexcept
{
  return (h ^ c) * 0x100000001b3ULL;
}

/// FNV-1a of s without its ABI namespaces: the same in every unit, whatever its flags.
[[nodiscard]] constexpr std::uint64_t hash_name(std::uint64_t h, std::string_view s) noexcept
{
  for (std::size_t i = 0; i < s.size();) {
    if (s[i] == abi_prefix[0] && s.substr(i, abi_prefix.size()) == abi_prefix) {
      i += abi_prefix.size();
    } else {
      h = fnv1a(h, static_cast<unsigned char>(s[i++]));
    }
  }
  return h;
}

[[nodiscard]] constexpr std::uint64_t hash_value(std::uint64_t h, std::uint64_t v) noexcept
{
  for (int i = 0; i < 8; ++i) { h = fnv1a(h, static_cast<unsigned char>(v >> (8 * i))); }
  return h;
}

template <class K>
using arrays_of = update_arrays<typename K::precision_type, K::rule_type::slots.size()>;
template <class K>
using coefficients_of = typename K::rule_type::coefficients;

/// A kernel's key: its rule and precision by name, and the sizes of what is handed over.
template <class K>
inline constexpr std::uint64_t kernel_key = hash_value(
  hash_value(hash_name(0xcbf29ce484222325ULL, type_name<K>()), sizeof(coefficients_of<K>)), sizeof(arrays_of<K>));

template <class K>
inline constexpr bool handed_over_as_bytes =
  std::is_trivially_copyable_v<coefficients_of<K>> && std::is_trivially_copyable_v<arrays_of<K>>;

}  // namespace host::dispatch_detail

/// The kernels an OnHostDispatched program uses (host_kernel<R, P>...), in one list shared by
/// the program and its kernel units.
template <class... K>
struct host_kernels {
  static_assert(sizeof...(K) > 0, "host_kernels: list at least one host_kernel<Rule, Precision>");
  static_assert((host::dispatch_detail::handed_over_as_bytes<K> && ...),
                "host_kernels: a rule's coefficients must be trivially copyable");
  static constexpr std::size_t size = sizeof...(K);
  /// The list's key, the same in the program and in each unit: tierstate's version, and every
  /// kernel's, in order.
  static constexpr std::uint64_t key = [] {
    std::uint64_t h = host::dispatch_detail::hash_value(0xcbf29ce484222325ULL, TIERSTATE_VERSION);
    h               = host::dispatch_detail::hash_value(h, sizeof...(K));
    ((h = host::dispatch_detail::hash_value(h, host::dispatch_detail::kernel_key<K>)), ...);
    return h;
  }();
  /// The index of host_kernel<R, P> in the list, or size when it is not there.
  template <class R, class P>
  static constexpr std::size_t index_of = [] {
    constexpr bool found[] = {std::is_same_v<K, host_kernel<R, P>>...};
    std::size_t i          = 0;
    while (i < sizeof...(K) && !found[i]) { ++i; }
    return i;
  }();
};

/// The level of the kernels OnHostDispatched runs in this process.
struct host_level {
  int level;         ///< 2, 3 or 4 (x86-64-vN), 5 (x86-64-v4-bf16); 0 off x86-64 (the units' own flags)
  char const* name;  ///< "x86-64-v4", ...; "build" off x86-64
};

namespace host::dispatch_detail {

struct level_choice {
  host_level chosen{0, nullptr};
  std::string refusal;  // why no level can be had (chosen.name is then null)
  std::string forced;   // TIERSTATE_ARCH, when set

  [[nodiscard]] std::string sentence() const
  {
    return forced.empty() ? "tierstate: " + refusal : "TIERSTATE_ARCH = " + forced + " is invalid: " + refusal;
  }
};

[[nodiscard]] inline level_choice choose_level()
{
  char const* forced = std::getenv("TIERSTATE_ARCH");
  bool const any     = forced != nullptr && *forced != '\0';
  auto refuse        = [&](std::string why) {
    level_choice c;
    c.refusal = std::move(why);
    c.forced  = any ? forced : "";
    return c;
  };
  std::string names;
  std::string lowest;  // what the CPU lacks of the narrowest level
  for (auto const& l : detail::cpu_levels()) {
    names += names.empty() ? "" : ", ";
    names += l.name;
    lowest = l.lacks;
    if (any && std::string_view(forced) != l.name) { continue; }
    if (l.lacks.empty()) {
      level_choice c;
      c.chosen = {l.level, l.name};
      return c;
    }
    if (any) {
      return refuse("this CPU cannot run its kernels (it lacks " + l.lacks + "); unset it to use the widest this CPU has");
    }
  }
  if (any) {
    return refuse("the host kernels are built for " + names + "; unset it to use the widest this CPU has");
  }
  return refuse("this CPU runs none of the host kernels' levels (" + names + "): it lacks " + lowest);
}

[[nodiscard]] inline level_choice const& chosen_level()
{
  static level_choice const c = choose_level();  // once per process, like the CPU
  return c;
}

}  // namespace host::dispatch_detail

/// The level OnHostDispatched's kernels run at: TIERSTATE_ARCH's (x86-64-v2, x86-64-v3,
/// x86-64-v4 or x86-64-v4-bf16) when it is set, else the widest this CPU has. Throws tierstate::invalid_option
/// when TIERSTATE_ARCH names a level this CPU cannot run or none at all, std::runtime_error
/// on a CPU below x86-64-v2. A program calls it first to refuse that cleanly (the first
/// dispatched step would otherwise stop the process with the same sentence).
[[nodiscard]] inline host_level dispatched_host_level()
{
  auto const& c = host::dispatch_detail::chosen_level();
  if (c.chosen.name == nullptr) {
    if (!c.forced.empty()) { throw invalid_option("TIERSTATE_ARCH", c.forced, c.refusal); }
    throw std::runtime_error(c.sentence());
  }
  return c.chosen;
}

namespace host::dispatch_detail {

template <class Kernels>
[[nodiscard]] dispatch::kernel_fn const* table_for(host_level l) noexcept
{
  switch (l.level) {
#if defined(__x86_64__)
    case 2: return dispatch::host_kernel_table<Kernels::key, 2>();
    case 3: return dispatch::host_kernel_table<Kernels::key, 3>();
    case 4: return dispatch::host_kernel_table<Kernels::key, 4>();
    case 5: return dispatch::host_kernel_table<Kernels::key, 5>();
#else
    case 0: return dispatch::host_kernel_table<Kernels::key, 0>();
#endif
    default: return nullptr;
  }
}

template <class Kernels>
[[nodiscard]] dispatch::kernel_fn const* table() noexcept
{
  static dispatch::kernel_fn const* const t = [] {
    auto const& c = chosen_level();
    if (c.chosen.name == nullptr) {
      std::fprintf(stderr, "%s\n", c.sentence().c_str());
      std::abort();  // (from a noexcept kernel call: dispatched_host_level() refuses it cleanly)
    }
    return table_for<Kernels>(c.chosen);
  }();
  return t;
}

}  // namespace host::dispatch_detail

/// A compute policy like OnHost<>, whose kernels are chosen at run time among units built
/// for each x86-64 level (see the top of this file).
template <class Kernels>
struct OnHostDispatched {
  using kernels                      = Kernels;
  static constexpr bool runs_on_device = false;
  /// Elements per unit of the thread pool's work: 64 of the widest level's batches (AVX-512),
  /// so that every level splits a range at the same points.
  static constexpr std::size_t grain = 64 * 16;

  template <rule R, precision P>
  static void update_range(typename R::coefficients const& k, update_arrays<P, R::slots.size()> const& a,
                           std::size_t begin, std::size_t end) noexcept
  {
    constexpr std::size_t i = Kernels::template index_of<R, P>;
    static_assert(i < Kernels::size,
                  "OnHostDispatched: the optimizer's host_kernel<Rule, Precision> is not in its host_kernels list");
    host::dispatch_detail::table<Kernels>()[i](&k, &a, begin, end);
  }
};

template <class Kernels>
inline constexpr bool is_on_host_v<OnHostDispatched<Kernels>> = true;

}  // namespace tierstate
