// SPDX-License-Identifier: Apache-2.0
// OnHost: the optimizer's update runs on the CPU, with the xsimd kernels of
// kernels/host/update.hpp for architecture Arch, on the optimizer's thread pool.
#pragma once

#include <tierstate/kernels/host/update.hpp>

#include <type_traits>

namespace tierstate::inline TIERSTATE_ABI {

template <class Arch = xsimd::default_arch>
struct OnHost {
  using arch = Arch;
  static constexpr bool runs_on_device = false;
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
