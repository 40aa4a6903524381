// SPDX-License-Identifier: Apache-2.0
// A compute that is neither OnHost nor OnDevice: both are named, with their headers.
// expect: tierstate::OffloadedOptimizer: the computes available are OnHost<Arch> (kernels/host/on_host.hpp) and OnDevice (kernels/device/on_device.hpp).
#include <tierstate/tierstate.hpp>

struct OnFpga {};

using Opt = tierstate::OffloadedOptimizer<tierstate::AdamW, tierstate::Bf16Mixed, tierstate::PinnedHost,
                                          tierstate::Synchronous, OnFpga>;
static_assert(sizeof(Opt) > 0);
