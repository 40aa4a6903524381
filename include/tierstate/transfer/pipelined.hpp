// SPDX-License-Identifier: Apache-2.0
// Pipelined<Depth>: overlaps a tier's reads and writes with compute.
//
// While chunk k is computed, chunks k+1..k+Depth are being read and chunk k-1 written,
// through a fixed ring of Depth + 2 staging buffers of one chunk each: the staging memory is
// (Depth + 2) x chunk bytes whatever the model's size. One I/O thread per optimizer runs the
// reads and writes in order, handing a tier that takes batches (`batched_tier`, as NvmeFile
// does) every queued read and write that does not reuse a buffer still in the batch, so a
// write of chunk k-1 and the read of chunk k+Depth reach the disk together. The same code
// serves any tier that is not addressable; an addressable tier (PinnedHost) is computed in
// place, as with Synchronous.
//
// A step's time approaches max(I/O, compute) instead of their sum once Depth reads cover the
// jitter of the tier; 2 is the default, more helps tiers whose latency varies a lot.
#pragma once

#include <type_traits>

namespace tierstate {

template <unsigned Depth = 2>
struct Pipelined {
  static_assert(Depth >= 1 && Depth <= 64, "tierstate::Pipelined<Depth>: Depth must be in 1..64");
  /// Chunks being read ahead while one is computed.
  static constexpr unsigned depth = Depth;
  /// Staging buffers of one chunk each: Depth being read, one computed, one being written.
  static constexpr unsigned staging_buffers = Depth + 2;
};

template <class T>
struct is_pipelined : std::false_type {};
template <unsigned Depth>
struct is_pipelined<Pipelined<Depth>> : std::true_type {};
template <class T>
inline constexpr bool is_pipelined_v = is_pipelined<T>::value;

}  // namespace tierstate
