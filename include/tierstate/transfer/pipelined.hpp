// SPDX-License-Identifier: Apache-2.0
// Pipelined<Depth>: overlaps a tier's reads and writes with compute.
//
// While chunk k is computed, chunks k+1..k+Depth are being read and chunk k-1 written,
// through a fixed ring of Depth + 2 staging buffers of one chunk each: the staging memory is
// (Depth + 2) x chunk bytes whatever the model's size. One I/O thread per optimizer starts
// each read and write as soon as its staging buffer is free (a read into the buffer of chunk
// k-1 waits for k-1's write): a streaming tier (NvmeFile) keeps the disk's queue full across
// chunk boundaries, a batched tier gets runs of jobs on distinct buffers, any other tier
// gets them one by one (transfer/detail/io_worker.hpp). The same code serves any tier that
// is not addressable; an addressable tier (PinnedHost) is computed in place, as with
// Synchronous. A step returns once every write has finished.
//
// A step's time approaches max(I/O, compute) instead of their sum once Depth reads cover the
// jitter of the tier; 2 is the default, more helps tiers whose latency varies a lot.
#pragma once

#include <tierstate/core/config.hpp>

#include <cstddef>
#include <type_traits>

namespace tierstate::inline TIERSTATE_ABI {

template <unsigned Depth = 2>
struct Pipelined {
  static_assert(Depth >= 1 && Depth <= 64,
                "tierstate::Pipelined<Depth> (and CudaOverlapped<Depth>): Depth must be in 1..64");
  /// Chunks being read ahead while one is computed.
  static constexpr unsigned depth = Depth;
  /// Staging buffers of one chunk each: Depth being read, one computed, one being written.
  static constexpr unsigned staging_buffers = Depth + 2;

  /// The j-th chunk uses buffer j % B. Fetches run Depth chunks ahead of the compute: the
  /// (j + Depth + 1)-th is fetched into the buffer of the (j - 1)-th, behind its retire.
  template <class Route>
  static void schedule(Route& r)
  {
    constexpr unsigned B = staging_buffers;
    std::size_t const n  = r.chunks();
    for (std::size_t j = 0; j < n && j <= Depth; ++j) { r.fetch(j, static_cast<unsigned>(j % B)); }
    for (std::size_t j = 0; j < n; ++j) {
      r.compute(j, static_cast<unsigned>(j % B));
      r.retire(j, static_cast<unsigned>(j % B));
      if (j + Depth + 1 < n) { r.fetch(j + Depth + 1, static_cast<unsigned>((j + Depth + 1) % B)); }
    }
    r.finish();
  }
};

template <class T>
struct is_pipelined : std::false_type {};
template <unsigned Depth>
struct is_pipelined<Pipelined<Depth>> : std::true_type {};
template <class T>
inline constexpr bool is_pipelined_v = is_pipelined<T>::value;

}  // namespace tierstate
