// SPDX-License-Identifier: Apache-2.0
// A precision with fp16 state (not one of the state codecs): refused by name.
// expect: tierstate::Precision: State must be float, tierstate::bf16, a codec or tierstate::slot_codecs<C...> of codecs (codecs/codec.hpp: a block codec has name, block (a power of two up to 2048), block_bytes, decode and encode).
#include <tierstate/tierstate.hpp>

using P = tierstate::Precision<tierstate::bf16, tierstate::bf16, float, tierstate::fp16>;
static_assert(sizeof(P) > 0);
