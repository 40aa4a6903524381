// SPDX-License-Identifier: Apache-2.0
// PinnedHost's NUMA placement (tiers/pinned_host.hpp: options::numa_node), through libnuma
// where the build has it (TIERSTATE_WITH_NUMA, -lnuma).
#pragma once

#include <tierstate/core/error.hpp>
#include <tierstate/core/notice.hpp>

#include <cstddef>
#include <string>

#if defined(TIERSTATE_WITH_NUMA)
#include <numa.h>
#endif

namespace tierstate::inline TIERSTATE_ABI::detail {

/// Whether PinnedHost places its memory on NUMA node `node`: -1 asks for nothing (false); a
/// node the machine lacks is refused; a build without libnuma, or a kernel without NUMA,
/// tells so once and places nothing (false).
inline bool check_numa_node(int node, char const* option = "PinnedHost.numa_node")
{
  if (node == -1) { return false; }
  if (node < -1) {
    throw invalid_option(option, std::to_string(node), "a NUMA node is >= 0 (-1: no placement)");
  }
#if defined(TIERSTATE_WITH_NUMA)
  if (numa_available() < 0) {
    notify_once("PinnedHost.numa", std::string(option) + " = " + std::to_string(node) +
                                     " is ignored: this kernel has no NUMA support (numa_available)");
    return false;
  }
  if (node > numa_max_node() || numa_bitmask_isbitset(numa_all_nodes_ptr, static_cast<unsigned>(node)) == 0) {
    std::string nodes;
    for (int n = 0; n <= numa_max_node(); ++n) {
      if (numa_bitmask_isbitset(numa_all_nodes_ptr, static_cast<unsigned>(n)) == 0) { continue; }
      if (!nodes.empty()) { nodes += ", "; }
      nodes += std::to_string(n);
    }
    throw invalid_option(option, std::to_string(node), "this machine's NUMA nodes with memory are " + nodes);
  }
  return true;
#else
  notify_once("PinnedHost.numa", std::string(option) + " = " + std::to_string(node) +
                                   " is ignored: tierstate was built without libnuma (install libnuma-dev, define "
                                   "TIERSTATE_WITH_NUMA and link -lnuma)");
  return false;
#endif
}

/// Binds [p, p + bytes) to NUMA node `node` (its pages are then taken there when touched).
inline void place_on_node([[maybe_unused]] void* p, [[maybe_unused]] std::size_t bytes, [[maybe_unused]] int node)
{
#if defined(TIERSTATE_WITH_NUMA)
  numa_tonode_memory(p, bytes, node);
#endif
}

}  // namespace tierstate::detail
