// SPDX-License-Identifier: Apache-2.0
// The Adam compositions with OnHost compute (one translation unit per rule and compute, so
// they compile in parallel).
#include "shard_impl.hpp"

namespace tierstate_torch {

std::unique_ptr<shard> make_adam_shard(config const& c)
{
  return detail::for_rule<tierstate::Adam, detail::on_host>(c);
}

rule_info adam_info() { return detail::info_of<tierstate::Adam>(); }

}  // namespace tierstate_torch
