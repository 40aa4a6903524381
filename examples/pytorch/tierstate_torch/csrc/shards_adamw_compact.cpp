// SPDX-License-Identifier: Apache-2.0
// AdamW's compact compositions with OnHost compute (8-bit moments; bf16 params with a Kahan
// compensation slot or stochastic rounding in place of the fp32 master): a translation unit
// of their own, so that they compile beside shards_adamw.cpp.
#include "shard_impl.hpp"

namespace tierstate_torch {

std::unique_ptr<shard> make_adamw_compact_shard(config const& c)
{
  return detail::for_rule_compact<tierstate::AdamW, detail::on_host>(c);
}

}  // namespace tierstate_torch
