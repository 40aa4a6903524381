// SPDX-License-Identifier: Apache-2.0
// The AdamWAmsgrad compositions with OnHost compute (one translation unit per rule and compute, so
// they compile in parallel).
#include "shard_impl.hpp"

namespace tierstate_torch {

std::unique_ptr<shard> make_adamw_amsgrad_shard(config const& c)
{
  return detail::for_rule<tierstate::AdamWAmsgrad, detail::on_host>(c);
}

rule_info adamw_amsgrad_info() { return detail::info_of<tierstate::AdamWAmsgrad>(); }

}  // namespace tierstate_torch
