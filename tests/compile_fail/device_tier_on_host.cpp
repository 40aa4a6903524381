// SPDX-License-Identifier: Apache-2.0
// State in the Device tier, updated by OnHost compute: the state is updated where it lives.
// expect: state in the Device tier is updated where it lives: use OnDevice compute (or PinnedHost / NvmeFile state for OnHost compute).
#include <tierstate/tierstate.hpp>

using namespace tierstate;
using Opt = OffloadedOptimizer<AdamW, Bf16Mixed, Device, CudaOverlapped<2>, OnHost<>>;
static_assert(sizeof(Opt) > 0);
