// SPDX-License-Identifier: Apache-2.0
// A model's elements shared out among ranks (ZeRO-1's partition of the optimizer state):
// each rank owns one contiguous range of the model's elements taken in registration order,
// cut only at a multiple of `block` elements into a tensor or at a tensor's end. With the
// gradient norm's 4096-element blocks (step/checks.hpp), every rank's block sums are whole
// blocks of one process's, and gathered in rank order they are one process's, in its
// (tensor, block) order: the norm is the same bits. 8-bit state's 256-element blocks never
// straddle a cut. Balanced: each cut is the block boundary nearest to r * total / ranks, so
// a rank owns total / ranks elements to within one block. Deterministic: a function of the
// sizes, the rank count and the block alone.
#pragma once

#include <tierstate/core/config.hpp>
#include <tierstate/core/error.hpp>

#include <cstddef>
#include <span>
#include <string>
#include <vector>

namespace tierstate::inline TIERSTATE_ABI::ranks {

/// Elements [begin, begin + count) of tensor `tensor` (its index in registration order).
struct piece {
  std::size_t tensor = 0;
  std::size_t begin  = 0;
  std::size_t count  = 0;
  bool operator==(piece const&) const = default;
};

struct partition {
  /// Where each rank's range begins in the model's elements, and the total last (ranks + 1).
  std::vector<std::size_t> first;
  /// Each rank's pieces, in registration order (none for a rank of an empty range).
  std::vector<std::vector<piece>> pieces;

  [[nodiscard]] std::size_t ranks() const noexcept { return pieces.size(); }
  [[nodiscard]] std::size_t elements(std::size_t rank) const { return first.at(rank + 1) - first.at(rank); }
};

/// The partition of tensors of these sizes among `ranks` ranks (see above). Refuses no ranks,
/// a block of 0 elements and a block that is not a multiple of 256 (8-bit state's), by name.
[[nodiscard]] inline partition partition_elements(std::span<std::size_t const> sizes, std::size_t ranks,
                                                  std::size_t block = 4096)
{
  if (ranks == 0) { throw invalid_option("ranks", "0", "a partition needs at least one rank"); }
  if (block == 0 || block % 256 != 0) {
    throw invalid_option("block", std::to_string(block), "must be a positive multiple of 256 (8-bit state's blocks)");
  }
  // The places a cut may go, in the model's elements: each tensor's block starts and its end.
  std::vector<std::size_t> cuts{0};
  std::size_t total = 0;
  for (std::size_t const n : sizes) {
    for (std::size_t b = block; b < n; b += block) { cuts.push_back(total + b); }
    total += n;
    if (cuts.back() != total) { cuts.push_back(total); }
  }
  partition p;
  p.first.assign(ranks + 1, total);
  p.first[0] = 0;
  std::size_t at = 0;  // (the targets grow, so the nearest cut does too)
  for (std::size_t r = 1; r < ranks; ++r) {
    // r * total / ranks, exactly (no overflow for any model that fits in memory)
    std::size_t const target = total / ranks * r + total % ranks * r / ranks;
    while (at + 1 < cuts.size() && cuts[at + 1] <= target) { ++at; }
    std::size_t const below = cuts[at];
    std::size_t const above = at + 1 < cuts.size() ? cuts[at + 1] : below;
    p.first[r] = above - target < target - below ? above : below;
  }
  p.pieces.resize(ranks);
  std::size_t start = 0;  // of tensor t
  std::size_t rank  = 0;
  for (std::size_t t = 0; t < sizes.size(); start += sizes[t], ++t) {
    std::size_t const end = start + sizes[t];
    for (std::size_t e = start; e < end;) {
      while (p.first[rank + 1] <= e) { ++rank; }
      std::size_t const stop = std::min(end, p.first[rank + 1]);
      p.pieces[rank].push_back({t, e - start, stop - e});
      e = stop;
    }
  }
  return p;
}

}  // namespace tierstate::ranks
