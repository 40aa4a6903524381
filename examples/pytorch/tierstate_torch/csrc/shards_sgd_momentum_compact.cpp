// SPDX-License-Identifier: Apache-2.0
// SGD with momentum's (one 8-bit slot, the momentum buffer) compact compositions with OnHost compute, as shards_adamw_compact.cpp's.
#include "shard_impl.hpp"

namespace tierstate_torch {

std::unique_ptr<shard> make_sgd_momentum_compact_shard(config const& c)
{
  return detail::for_rule_compact<tierstate::SGDMomentum, detail::on_host>(c);
}

}  // namespace tierstate_torch
