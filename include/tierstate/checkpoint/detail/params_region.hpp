// SPDX-License-Identifier: Apache-2.0
// A checkpoint's params region (checkpoint/format.hpp, section "parm"): the params of the
// tensors "parm" names, back to back, in blocks of param_block_bytes(chunk bytes).
#pragma once

#include <tierstate/core/config.hpp>

#include <cstddef>
#include <cstdint>
#include <span>

namespace tierstate::inline TIERSTATE_ABI::checkpoint::detail {

/// The region's block: the chunk's bytes, or 1 MiB where chunks hold nothing (a rule
/// without slots, with fp32 params: SGD, Adafactor).
[[nodiscard]] constexpr std::size_t param_block_bytes(std::size_t chunk_bytes) noexcept
{
  return chunk_bytes > 0 ? chunk_bytes : std::size_t{1} << 20;
}

/// Blocks of `block` bytes that tensors of `counts` elements of `element` bytes take.
[[nodiscard]] constexpr std::uint64_t param_blocks(std::span<std::uint64_t const> counts, std::size_t element,
                                                   std::size_t block) noexcept
{
  std::uint64_t bytes = 0;
  for (auto const n : counts) { bytes += n * element; }
  return bytes == 0 ? 0 : (bytes + block - 1) / block;
}

/// Walks block `j` (of `block` bytes at `data`): `move(i, offset, at, n)` for each run of
/// tensor i's elements [offset, offset + n) that falls in it, starting at byte `at` of it.
template <class Move>
void walk_param_block(std::span<std::uint64_t const> counts, std::size_t element, std::uint64_t j, std::size_t block,
                      std::byte* data, Move&& move)
{
  std::uint64_t const per_block = block / element;
  std::uint64_t const lo = j * per_block, hi = lo + per_block;
  std::uint64_t at = 0;  // the region's element where tensor i starts
  for (std::size_t i = 0; i < counts.size() && at < hi; ++i) {
    std::uint64_t const b = at > lo ? at : lo, e = at + counts[i] < hi ? at + counts[i] : hi;
    if (b < e) { move(i, static_cast<std::size_t>(b - at), data + (b - lo) * element, static_cast<std::size_t>(e - b)); }
    at += counts[i];
  }
}

}  // namespace tierstate::checkpoint::detail
