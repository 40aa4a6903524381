// SPDX-License-Identifier: Apache-2.0
// The Adam compositions (one translation unit per rule, so they compile in parallel).
#include "shard_impl.hpp"

namespace tierstate_torch {

std::unique_ptr<shard> make_adam_shard(config const& c)
{
  return detail::for_rule<tierstate::Adam>(c);
}

}  // namespace tierstate_torch
