// SPDX-License-Identifier: Apache-2.0
// The shared NvmeFile compositions' code (tests/compositions.hpp).
#define TIERSTATE_TEST_COMPILE_NVME
#include "compositions.hpp"
