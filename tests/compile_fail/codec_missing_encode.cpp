// SPDX-License-Identifier: Apache-2.0
// A block codec that can decode but not encode, given as the state of one slot: refused by
// the precision with the sentence that says what a codec has.
// expect: tierstate::Precision: State must be float, tierstate::bf16, a codec or tierstate::slot_codecs<C...> of codecs (codecs/codec.hpp: a block codec has name, block (a power of two up to 2048), block_bytes, decode and encode).
#include <tierstate/tierstate.hpp>

#include <cstddef>
#include <string_view>

struct DecodeOnly {
  static constexpr std::string_view name   = "decode_only";
  static constexpr std::size_t block       = 64;
  static constexpr std::size_t block_bytes = 68;
  static void decode(std::byte const*, float*, std::size_t) noexcept {}
};

using P = tierstate::Precision<float, float, float, tierstate::slot_codecs<DecodeOnly, tierstate::codecs::fp32>>;
static_assert(sizeof(P) > 0);
