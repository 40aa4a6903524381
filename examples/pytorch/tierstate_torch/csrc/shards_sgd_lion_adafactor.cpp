// SPDX-License-Identifier: Apache-2.0
// The SGD (momentum 0 and > 0), Lion and Adafactor compositions with OnHost compute, and
// their tables: one translation unit for the four, so that they add one file, not four, to
// the build.

#include "shard_impl.hpp"

namespace tierstate_torch {

std::unique_ptr<shard> make_sgd_shard(config const& c) { return detail::for_rule<tierstate::SGD, detail::on_host>(c); }
std::unique_ptr<shard> make_sgd_momentum_shard(config const& c)
{
  return detail::for_rule<tierstate::SGDMomentum, detail::on_host>(c);
}
std::unique_ptr<shard> make_lion_shard(config const& c) { return detail::for_rule<tierstate::Lion, detail::on_host>(c); }
std::unique_ptr<shard> make_adafactor_shard(config const& c)
{
  return detail::for_rule<tierstate::Adafactor, detail::on_host>(c);
}

rule_info sgd_info() { return detail::info_of<tierstate::SGD>(); }
rule_info sgd_momentum_info() { return detail::info_of<tierstate::SGDMomentum>(); }
rule_info lion_info() { return detail::info_of<tierstate::Lion>(); }
rule_info adafactor_info() { return detail::info_of<tierstate::Adafactor>(); }

}  // namespace tierstate_torch
