// SPDX-License-Identifier: Apache-2.0
// The AdamAmsgrad compositions with OnDevice compute: Thrust's CUDA backend when compiled by nvcc
// (as device_shards_adam_amsgrad.cu, with TIERSTATE_ENABLE_CUDA), its CPP backend on tierstate's
// emulated device otherwise.
#include "device_shards.hpp"

namespace tierstate_torch {

std::unique_ptr<shard> make_adam_amsgrad_device_shard(config const& c)
{
  return detail::for_rule<tierstate::AdamAmsgrad, detail::on_device>(c);
}

}  // namespace tierstate_torch
