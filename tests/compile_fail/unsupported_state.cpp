// SPDX-License-Identifier: Apache-2.0
// A precision with fp16 state (not one of the state codecs): refused by name.
// expect: tierstate::Precision: State must be float or tierstate::bf16.
#include <tierstate/tierstate.hpp>

using P = tierstate::Precision<tierstate::bf16, tierstate::bf16, float, tierstate::fp16>;
static_assert(sizeof(P) > 0);
