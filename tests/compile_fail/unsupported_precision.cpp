// SPDX-License-Identifier: Apache-2.0
// A precision with double params: refused by name.
// expect: tierstate::Precision: Param must be float, tierstate::bf16 or tierstate::fp16.
#include <tierstate/tierstate.hpp>

using P = tierstate::Precision<double, tierstate::bf16, float, float>;
static_assert(sizeof(P) > 0);
