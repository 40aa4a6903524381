// SPDX-License-Identifier: Apache-2.0
// The state store's device resources (state/store.hpp), for the routes with device params
// (transfer/routes/).
#pragma once

#include <tierstate/core/device_runtime.hpp>
#include <tierstate/tiers/pinned_host.hpp>

#include <cstddef>
#include <cstdint>

namespace tierstate::inline TIERSTATE_ABI::detail {

/// The streams, events and PCIe staging of a step with device params (made with the
/// state): compute runs the device kernels, h2d and d2h carry the copies each way. In[b],
/// computed[b] and out[b] mark, for the chunk in staging buffer b, its arrival, its update
/// and its departure.
template <unsigned Buffers>
struct device_resources {
  static constexpr unsigned buffers = Buffers;
  device::stream compute, h2d, d2h;
  device::event ready;
  device::event in[buffers], computed[buffers], out[buffers];
  PinnedHost grad_stage{0};   ///< OnHost: buffers x chunk_elements gradients
  PinnedHost param_stage{0};  ///< OnHost: buffers x chunk_elements params
  std::byte* state_stage = nullptr;  ///< OnDevice with a host tier: buffers chunks, device memory
  std::size_t state_stage_bytes = 0;
  std::uint32_t* nonfinite_flag = nullptr;  ///< OnDevice: device memory, set by the inf/NaN check
  float* tensor_state = nullptr;  ///< OnDevice, a rule with a tensor phase: every tensor's state, device memory
  ~device_resources()
  {
    try {
      compute.synchronize();
      h2d.synchronize();
      d2h.synchronize();
    } catch (...) {  // a failure was reported by the step it belonged to
    }
    device::deallocate_async(state_stage, compute);
    device::deallocate_async(nonfinite_flag, compute);
    device::deallocate_async(tensor_state, compute);
  }
};

}  // namespace tierstate::detail
