// SPDX-License-Identifier: Apache-2.0
// One codec per slot, but AdamW keeps two slots and the precision names one codec: refused
// where the optimizer is made.
// expect: tierstate::OffloadedOptimizer: the precision's slot_codecs<...> names one codec per slot of the rule, in the order of the rule's `slots`; their numbers differ.
#include <tierstate/tierstate.hpp>

using P   = tierstate::Precision<float, float, float, tierstate::slot_codecs<tierstate::codecs::bf16>>;
using Opt = tierstate::OffloadedOptimizer<tierstate::AdamW, P>;
static_assert(sizeof(Opt) > 0);
