// SPDX-License-Identifier: Apache-2.0
// Synchronous: the simplest transfer. Chunks are visited in layout order; an addressable
// tier's chunk is computed in place, any other tier's chunk is read into a staging buffer,
// computed, and written back before the next chunk starts. Staging memory: one chunk.
#pragma once

#include <tierstate/core/config.hpp>

namespace tierstate::inline TIERSTATE_ABI {

struct Synchronous {
  /// Chunks being read ahead while one is computed.
  static constexpr unsigned depth = 0;
  /// Staging buffers of one chunk each (for tiers that are not addressable).
  static constexpr unsigned staging_buffers = 1;
};

}  // namespace tierstate
