// SPDX-License-Identifier: Apache-2.0
// A transfer with none of the concept's members: the sentence names the concept and what it asks.
// expect: tierstate::OffloadedOptimizer: Transfer must model tierstate::transfer (transfer/concept.hpp): static constexpr unsigned depth and staging_buffers (more than depth), and a static template schedule(Route&) that drives a route's legs
#include <tierstate/tierstate.hpp>

struct Throttled {};

using Opt = tierstate::OffloadedOptimizer<tierstate::AdamW, tierstate::Bf16Mixed, tierstate::PinnedHost, Throttled>;
static_assert(sizeof(Opt) > 0);
