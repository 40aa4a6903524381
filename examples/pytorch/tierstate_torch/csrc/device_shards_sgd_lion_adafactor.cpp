// SPDX-License-Identifier: Apache-2.0
// The SGD (momentum 0 and > 0), Lion and Adafactor compositions with OnDevice compute:
// Thrust's CUDA backend when compiled by nvcc (as device_shards_sgd_lion_adafactor.cu, with
// TIERSTATE_ENABLE_CUDA),
// its CPP backend on tierstate's emulated device otherwise.

#include "device_shards.hpp"

namespace tierstate_torch {

std::unique_ptr<shard> make_sgd_device_shard(config const& c)
{
  return detail::for_rule<tierstate::SGD, detail::on_device>(c);
}
std::unique_ptr<shard> make_sgd_momentum_device_shard(config const& c)
{
  return detail::for_rule<tierstate::SGDMomentum, detail::on_device>(c);
}
std::unique_ptr<shard> make_lion_device_shard(config const& c)
{
  return detail::for_rule<tierstate::Lion, detail::on_device>(c);
}
std::unique_ptr<shard> make_adafactor_device_shard(config const& c)
{
  return detail::for_rule<tierstate::Adafactor, detail::on_device>(c);
}

}  // namespace tierstate_torch
