// SPDX-License-Identifier: Apache-2.0
// The AdamW compositions with OnHost compute (one translation unit per rule and compute, so
// they compile in parallel).
#include "shard_impl.hpp"

namespace tierstate_torch {

std::unique_ptr<shard> make_adamw_shard(config const& c)
{
  return detail::for_rule<tierstate::AdamW, detail::on_host>(c);
}

rule_info adamw_info() { return detail::info_of<tierstate::AdamW>(); }

bool device_is_emulated() noexcept { return tierstate::device::is_emulated; }

bool has_device_params() noexcept
{
#if defined(TIERSTATE_TORCH_DEVICE_PARAMS)
  return true;
#else
  return false;
#endif
}

std::string host_kernel_level()
{
#if defined(TIERSTATE_TORCH_DISPATCH)
  return tierstate::dispatched_host_level().name;
#else
  return std::string("native ") + tierstate::host::arch_name();
#endif
}

}  // namespace tierstate_torch
