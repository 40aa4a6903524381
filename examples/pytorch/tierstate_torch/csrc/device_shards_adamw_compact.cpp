// SPDX-License-Identifier: Apache-2.0
// AdamW's compact compositions with OnDevice compute (8-bit moments; bf16 params with a Kahan
// compensation slot or stochastic rounding in place of the fp32 master): Thrust's CUDA
// backend when compiled by nvcc (as device_shards_adamw_compact.cu), its CPP backend on
// tierstate's emulated device otherwise.
#include "device_shards.hpp"

namespace tierstate_torch {

std::unique_ptr<shard> make_adamw_device_compact_shard(config const& c)
{
  return detail::for_rule_compact<tierstate::AdamW, detail::on_device>(c);
}

}  // namespace tierstate_torch
