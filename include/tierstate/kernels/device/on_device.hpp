// SPDX-License-Identifier: Apache-2.0
// OnDevice: the optimizer's update runs on the device, with the Thrust kernels of
// kernels/device/update.hpp, on the optimizer's compute stream.
//
// Pair it with the Device tier (state on the GPU: no offload) or with CudaOverlapped<Depth>
// and a host tier (PinnedHost, NvmeFile: each chunk's state streamed to the GPU, updated
// there and streamed back). The params and gradients live on the device. Including this
// header needs the device kernels' setup (see kernels/device/update.hpp): nvcc with
// TIERSTATE_ENABLE_CUDA, or a Thrust host backend without it.
#pragma once

#include <tierstate/kernels/device/update.hpp>

namespace tierstate::inline TIERSTATE_ABI {
inline namespace TIERSTATE_DEVICE_ABI {

struct OnDevice {
  static constexpr bool runs_on_device = true;
  template <rule R, precision P>
  static void update_async(device::stream_view s, typename R::coefficients const& k,
                           update_arrays<P, R::slots.size()> const& a, std::size_t n)
  {
    device::update_async<R, P>(s, k, a, n);
  }
  template <storage_type T>
  [[nodiscard]] static bool any_nonfinite(device::stream_view s, T const* x, std::size_t n)
  {
    return device::any_nonfinite(s, x, n);
  }
  template <storage_type T>
  static void mark_nonfinite_async(device::stream_view s, T const* x, std::size_t n, std::uint32_t* flag)
  {
    device::mark_nonfinite_async(s, x, n, flag);
  }
};

}  // namespace TIERSTATE_DEVICE_ABI

}  // namespace tierstate
