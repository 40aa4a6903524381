// SPDX-License-Identifier: Apache-2.0
// A user's transfer that has depth and staging_buffers but no schedule: refused with the
// concept's sentence, not compiled into a step that would never move a chunk.
// expect: tierstate::OffloadedOptimizer: Transfer must model tierstate::transfer (transfer/concept.hpp)
// expect: a static template schedule(Route&) that drives a route's legs
#include <tierstate/tierstate.hpp>

struct NoSchedule {
  static constexpr unsigned depth           = 1;
  static constexpr unsigned staging_buffers = 3;
};
static_assert(!tierstate::transfer<NoSchedule>);

using Opt = tierstate::OffloadedOptimizer<tierstate::AdamW, tierstate::Bf16Mixed, tierstate::NvmeFile, NoSchedule>;
static_assert(sizeof(Opt) > 0);
