// SPDX-License-Identifier: Apache-2.0
// host_step's dispatched kernels, for the level TIERSTATE_HOST_KERNEL_LEVEL names
// (bench/meson.build builds this file once per level).
#include <tierstate/kernels/host/dispatch_unit.hpp>

#include "host_step_kernels.hpp"

TIERSTATE_HOST_KERNEL_UNIT(host_step_portable::kernel_list)
