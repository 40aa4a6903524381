// SPDX-License-Identifier: Apache-2.0
// Lion's (one 8-bit slot, its momentum) compact compositions with OnHost compute, as shards_adamw_compact.cpp's.
#include "shard_impl.hpp"

namespace tierstate_torch {

std::unique_ptr<shard> make_lion_compact_shard(config const& c)
{
  return detail::for_rule_compact<tierstate::Lion, detail::on_host>(c);
}

}  // namespace tierstate_torch
