// SPDX-License-Identifier: Apache-2.0
// A transfer that is none of the library's: the list is named. (Until transfers are a concept
// a user's type can model: then this file names the member it lacks.)
// expect: tierstate::OffloadedOptimizer: the transfers available are Synchronous, Pipelined<Depth> and CudaOverlapped<Depth>.
#include <tierstate/tierstate.hpp>

struct Throttled {};

using Opt = tierstate::OffloadedOptimizer<tierstate::AdamW, tierstate::Bf16Mixed, tierstate::PinnedHost, Throttled>;
static_assert(sizeof(Opt) > 0);
