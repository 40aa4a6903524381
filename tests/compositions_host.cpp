// SPDX-License-Identifier: Apache-2.0
// The shared PinnedHost compositions' code (tests/compositions.hpp).
#define TIERSTATE_TEST_COMPILE_HOST
#include "compositions.hpp"
