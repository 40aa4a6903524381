// SPDX-License-Identifier: Apache-2.0
// The kernels of host_step's portable build: one list, shared by host_step_dispatch.cpp and
// its units (host_step_kernels.cpp, built once per level).
#pragma once

#include <tierstate/kernels/host/dispatch.hpp>
#include <tierstate/tierstate.hpp>

namespace host_step_portable {
using kernel_list = tierstate::host_kernels<tierstate::host_kernel<tierstate::AdamW, tierstate::Fp32>,
                                            tierstate::host_kernel<tierstate::AdamW, tierstate::Bf16Mixed>>;
}
