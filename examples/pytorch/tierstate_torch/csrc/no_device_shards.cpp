// SPDX-License-Identifier: Apache-2.0
// A build without Thrust: no OnDevice compositions, and a clear error for compute='device'.
#include "shard.hpp"

#include <stdexcept>

namespace tierstate_torch {
namespace {
[[noreturn]] std::unique_ptr<shard> refuse()
{
  throw std::invalid_argument(
    "tierstate_torch: compute='device' needs Thrust, which this build did not find (set "
    "TIERSTATE_THRUST_INCLUDE to the folder holding thrust/, cub/ and cuda/, e.g. the CUDA "
    "toolkit's include/cccl, and rebuild)");
}
}  // namespace

std::unique_ptr<shard> make_adam_device_shard(config const&) { refuse(); }
std::unique_ptr<shard> make_adamw_device_shard(config const&) { refuse(); }
std::unique_ptr<shard> make_adam_amsgrad_device_shard(config const&) { refuse(); }
std::unique_ptr<shard> make_adamw_amsgrad_device_shard(config const&) { refuse(); }
std::unique_ptr<shard> make_sgd_device_shard(config const&) { refuse(); }
std::unique_ptr<shard> make_sgd_momentum_device_shard(config const&) { refuse(); }
std::unique_ptr<shard> make_lion_device_shard(config const&) { refuse(); }
std::unique_ptr<shard> make_adafactor_device_shard(config const&) { refuse(); }
std::unique_ptr<shard> make_adam_device_compact_shard(config const&) { refuse(); }
std::unique_ptr<shard> make_adamw_device_compact_shard(config const&) { refuse(); }
std::unique_ptr<shard> make_lion_device_compact_shard(config const&) { refuse(); }
std::unique_ptr<shard> make_sgd_momentum_device_compact_shard(config const&) { refuse(); }

}  // namespace tierstate_torch
