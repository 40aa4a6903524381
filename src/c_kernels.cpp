// SPDX-License-Identifier: Apache-2.0
// libtierstate_c's host kernels for the level TIERSTATE_HOST_KERNEL_LEVEL names
// (src/meson.build compiles this file once per level).
#include <tierstate/kernels/host/dispatch_unit.hpp>

#include "c_kernels.hpp"

TIERSTATE_HOST_KERNEL_UNIT(tierstate_c::kernels)
