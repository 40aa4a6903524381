// SPDX-License-Identifier: Apache-2.0
// OnHost: the optimizer's update runs on the CPU, with the xsimd kernels of
// kernels/host/update.hpp for architecture Arch, on the optimizer's thread pool.
#pragma once

#include <tierstate/kernels/host/update.hpp>

#include <cstddef>
#include <type_traits>

namespace tierstate::inline TIERSTATE_ABI {

template <class Arch = xsimd::default_arch>
struct OnHost {
  using arch = Arch;
  static constexpr bool runs_on_device = false;
  /// Elements per unit of the thread pool's work (64 SIMD batches).
  static constexpr std::size_t grain = 64 * host::batch_size<Arch>;

  /// Updates elements [begin, end) of `a` on the calling thread. The optimizer and its routes
  /// reach the host kernels only through this member and `grain`: a compute of yours that
  /// chooses the architecture at run time (one translation unit per architecture, each
  /// instantiating host::update_range for its own, and a function pointer chosen once with
  /// xsimd::available_architectures()) provides the same two and needs nothing else changed.
  template <rule R, precision P>
  static void update_range(typename R::coefficients const& k, update_arrays<P, R::slots.size()> const& a,
                           std::size_t begin, std::size_t end) noexcept
  {
    host::update_range<R, P, Arch>(k, a, begin, end);
  }
};

namespace detail {
/// The xsimd architecture a compute policy's host work uses (OnDevice: the default one).
template <class C>
struct compute_arch {
  using type = xsimd::default_arch;
};
template <class C>
  requires requires { typename C::arch; }
struct compute_arch<C> {
  using type = typename C::arch;
};
}  // namespace detail

template <class T>
inline constexpr bool is_on_host_v = false;
template <class Arch>
inline constexpr bool is_on_host_v<OnHost<Arch>> = true;

}  // namespace tierstate
