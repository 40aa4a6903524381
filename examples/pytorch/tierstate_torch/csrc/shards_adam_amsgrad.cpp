// SPDX-License-Identifier: Apache-2.0
// The AdamAmsgrad compositions with OnHost compute (one translation unit per rule and compute, so
// they compile in parallel).
#include "shard_impl.hpp"

namespace tierstate_torch {

std::unique_ptr<shard> make_adam_amsgrad_shard(config const& c)
{
  return detail::for_rule<tierstate::AdamAmsgrad, detail::on_host>(c);
}

rule_info adam_amsgrad_info() { return detail::info_of<tierstate::AdamAmsgrad>(); }

}  // namespace tierstate_torch
