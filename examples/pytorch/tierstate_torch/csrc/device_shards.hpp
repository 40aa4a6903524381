// SPDX-License-Identifier: Apache-2.0
// The OnDevice compositions: device params, the state in Device memory (no offload), or
// streamed to the GPU from PinnedHost or NvmeFile by CudaOverlapped<2>.
#pragma once

#include <tierstate/kernels/device/on_device.hpp>

#include "shard_impl.hpp"

namespace tierstate_torch::detail {

struct on_device {
  template <class Rule, class Precision>
  static std::unique_ptr<shard> make(config const& c)
  {
    using namespace tierstate;
    if (c.device_params) {
      if (c.tier == "device") { return std::make_unique<shard_impl<Rule, Precision, Device, CudaOverlapped<2>, OnDevice>>(c); }
      if (c.tier == "pinned") { return std::make_unique<shard_impl<Rule, Precision, PinnedHost, CudaOverlapped<2>, OnDevice>>(c); }
      if (c.tier == "nvme") { return std::make_unique<shard_impl<Rule, Precision, NvmeFile, CudaOverlapped<2>, OnDevice>>(c); }
    }
    refuse_tier(c);
  }
};

}  // namespace tierstate_torch::detail
