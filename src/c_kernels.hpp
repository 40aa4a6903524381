// SPDX-License-Identifier: Apache-2.0
// libtierstate_c's host kernels (kernels/host/dispatch.hpp): AdamW with fp32 params, and with
// bf16 params and an fp32 master. c_api_unit.cpp's optimizers run them; c_kernels.cpp defines
// them once per x86-64 level (src/meson.build).
#pragma once

#include <tierstate/kernels/host/dispatch.hpp>
#include <tierstate/tierstate.hpp>

namespace tierstate_c {
using kernels = tierstate::host_kernels<tierstate::host_kernel<tierstate::AdamW, tierstate::Fp32>,
                                        tierstate::host_kernel<tierstate::AdamW, tierstate::Bf16Mixed>>;
}
