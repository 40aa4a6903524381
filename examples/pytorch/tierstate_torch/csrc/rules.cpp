// SPDX-License-Identifier: Apache-2.0
// The rules the extension has compositions for, chosen by name: one line per rule.
#include "shard.hpp"

#include <array>
#include <stdexcept>
#include <string>
#include <vector>

namespace tierstate_torch {
namespace {

struct rule_entry {
  char const* name;
  rule_info (*info)();
  std::unique_ptr<shard> (*on_host)(config const&);
  std::unique_ptr<shard> (*on_device)(config const&);
  /// The compact precisions (state i8, master "kahan" or "stochastic") with OnHost and with
  /// OnDevice; null where the extension has none for the rule.
  std::unique_ptr<shard> (*compact)(config const&)        = nullptr;
  std::unique_ptr<shard> (*device_compact)(config const&) = nullptr;
};

constexpr std::array<rule_entry, 8> rules{{
  {"adam", adam_info, make_adam_shard, make_adam_device_shard, make_adam_compact_shard,
   make_adam_device_compact_shard},
  {"adamw", adamw_info, make_adamw_shard, make_adamw_device_shard, make_adamw_compact_shard,
   make_adamw_device_compact_shard},
  {"adam_amsgrad", adam_amsgrad_info, make_adam_amsgrad_shard, make_adam_amsgrad_device_shard},
  {"adamw_amsgrad", adamw_amsgrad_info, make_adamw_amsgrad_shard, make_adamw_amsgrad_device_shard},
  {"sgd", sgd_info, make_sgd_shard, make_sgd_device_shard},
  {"sgd_momentum", sgd_momentum_info, make_sgd_momentum_shard, make_sgd_momentum_device_shard,
   make_sgd_momentum_compact_shard, make_sgd_momentum_device_compact_shard},
  {"lion", lion_info, make_lion_shard, make_lion_device_shard, make_lion_compact_shard,
   make_lion_device_compact_shard},
  {"adafactor", adafactor_info, make_adafactor_shard, make_adafactor_device_shard},
}};

rule_entry const& find(std::string const& name)
{
  for (auto const& r : rules) {
    if (name == r.name) { return r; }
  }
  std::string known;
  for (auto const& r : rules) { known.append(known.empty() ? "'" : ", '").append(r.name).append("'"); }
  throw std::invalid_argument("tierstate_torch: no rule '" + name + "' (this build has " + known + ")");
}

}  // namespace

std::vector<std::string> rule_names()
{
  std::vector<std::string> names;
  for (auto const& r : rules) { names.emplace_back(r.name); }
  return names;
}

rule_info rule_table(std::string const& rule) { return find(rule).info(); }

std::unique_ptr<shard> make_shard(config const& c)
{
  auto const& r = find(c.rule);
  if (c.compute != "host" && c.compute != "device") {
    throw std::invalid_argument("tierstate_torch: compute must be 'host' or 'device', not '" + c.compute + "'");
  }
  if (c.state == dtype::i8 || c.master != "fp32") {
    auto const make = c.compute == "device" ? r.device_compact : r.compact;
    if (make == nullptr) {
      std::string const what = c.state == dtype::i8 ? std::string("state_dtype int8") : "master '" + c.master + "'";
      std::string built;
      for (auto const& e : rules) {
        if (e.compact != nullptr) { built.append(built.empty() ? "'" : ", '").append(e.name).append("'"); }
      }
      throw std::invalid_argument("tierstate_torch: " + what + " is built for rules " + built + "; this is rule '" +
                                  c.rule + "'");
    }
    return make(c);
  }
  if (c.compute == "device") { return r.on_device(c); }
  return r.on_host(c);
}

}  // namespace tierstate_torch
