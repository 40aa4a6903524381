// SPDX-License-Identifier: Apache-2.0
// Synchronous: the simplest transfer. Chunks are visited in layout order; an addressable
// tier's chunk is computed in place, any other tier's chunk is read into a staging buffer,
// computed, and written back before the next chunk starts. Staging memory: one chunk.
#pragma once

namespace tierstate {

struct Synchronous {
  /// Chunks staged at once (for tiers that are not addressable).
  static constexpr unsigned depth = 1;
};

}  // namespace tierstate
