// SPDX-License-Identifier: Apache-2.0
// Synchronous: the simplest transfer. Chunks are visited in layout order; an addressable
// tier's chunk is computed in place, any other tier's chunk is read into a staging buffer,
// computed, and written back before the next chunk starts. Staging memory: one chunk.
#pragma once

#include <tierstate/core/config.hpp>

#include <cstddef>

namespace tierstate::inline TIERSTATE_ABI {

struct Synchronous {
  /// Chunks being read ahead while one is computed.
  static constexpr unsigned depth = 0;
  /// Staging buffers of one chunk each (for tiers that are not addressable).
  static constexpr unsigned staging_buffers = 1;

  /// Each chunk fetched, computed and retired before the next (transfer/concept.hpp).
  template <class Route>
  static void schedule(Route& r)
  {
    for (std::size_t j = 0; j < r.chunks(); ++j) {
      r.fetch(j, 0);
      r.compute(j, 0);
      r.retire(j, 0);
    }
    r.finish();
  }
};

}  // namespace tierstate
