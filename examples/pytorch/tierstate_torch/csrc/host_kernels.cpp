// SPDX-License-Identifier: Apache-2.0
// The host kernels of every OnHost composition (host_kernels.hpp), for the level
// TIERSTATE_HOST_KERNEL_LEVEL names: setup.py compiles this file once per x86-64 level.
#include <tierstate/kernels/host/dispatch_unit.hpp>

#include "host_kernels.hpp"

TIERSTATE_HOST_KERNEL_UNIT(tierstate_torch::kernels::all)
