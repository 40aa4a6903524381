// SPDX-License-Identifier: Apache-2.0
// test_dispatch's kernels, for the level TIERSTATE_HOST_KERNEL_LEVEL names (tests/meson.build
// compiles this file once per level).
#include <tierstate/kernels/host/dispatch_unit.hpp>

#include "kernels.hpp"

TIERSTATE_HOST_KERNEL_UNIT(dispatch_test::kernels)
