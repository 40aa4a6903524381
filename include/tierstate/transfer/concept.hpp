// SPDX-License-Identifier: Apache-2.0
// The transfer concept: a transfer is a schedule of a route's legs over a step's chunks.
//
// A route is how one chunk travels for the composition's state tier and compute
// (transfer/routes/). The optimizer hands the transfer's `schedule` its route; the schedule
// chooses the order and the overlap of the legs and knows nothing of which route it drives:
//
//   r.chunks()          the chunks of this step, visited as j = 0 .. chunks() - 1 (the route
//                       maps j to a chunk: layout order, or a streaming step's order; the
//                       in-place route's plain step is one unit, a pass over the whole tier)
//   r.fetch(j, b)       start bringing the j-th chunk's state into staging buffer b
//   r.compute(j, b)     wait for that fetch (and, in a streaming step, for the chunk's
//                       gradients), then update the chunk in buffer b
//   r.retire(j, b)      start returning the chunk in buffer b to its tier
//   r.finish()          wait until every retire has landed; the step ends with it
//
// Each chunk is fetched, computed and retired once, in that order, and the chunks are
// computed and retired in the order j = 0, 1, ...; the j-th chunk's buffer b is
// j % staging_buffers, from its fetch to its retire (the device routes bring the next
// chunks' gradients or state forward on their own, into those buffers). A buffer is fetched
// into again only after the chunk in it has been retired: the route orders that fetch behind
// the retire. With `depth` 0 the route runs each leg to completion in the step's thread;
// with `depth` > 0 it hands reads and writes to one I/O thread
// (transfer/detail/io_worker.hpp), which starts each as soon as its buffer is free. If a
// leg throws, the optimizer waits for what is in flight and reports the error: a
// schedule needs no handler of its own.
//
// A user's transfer is any type with these members (tests/throttled.hpp has one);
// a type that lacks one is refused with a sentence that names the concept. One that also
// says `static constexpr bool params_on_device = true` takes params and gradients in device
// memory, as CudaOverlapped does, and drives the device routes.
#pragma once

#include <tierstate/core/config.hpp>

#include <concepts>
#include <cstddef>

namespace tierstate::inline TIERSTATE_ABI {
namespace detail {

/// A route that has the legs and nothing else: what `transfer` checks a schedule against.
struct route_archetype {
  [[nodiscard]] std::size_t chunks() const;
  void fetch(std::size_t j, unsigned buffer);
  void compute(std::size_t j, unsigned buffer);
  void retire(std::size_t j, unsigned buffer);
  void finish();
};

}  // namespace detail

/// A transfer: `depth` (chunks that may be read ahead; 0 runs every leg in the step's
/// thread), `staging_buffers` (buffers of one chunk each, more than `depth`) and a static
/// `template <class Route> void schedule(Route&)` that drives a route's legs.
template <class T>
concept transfer = requires {
  { T::depth } -> std::convertible_to<unsigned>;
  { T::staging_buffers } -> std::convertible_to<unsigned>;
  requires T::staging_buffers > T::depth;
} && requires(detail::route_archetype& r) { T::schedule(r); };

/// Whether a transfer moves params and gradients that live on the device (its optional
/// `static constexpr bool params_on_device`; CudaOverlapped's is true). Such a transfer's
/// schedule drives the device routes (transfer/routes/route.hpp), whose PCIe legs bring each
/// chunk's gradients down and its params back up.
template <class T>
inline constexpr bool moves_device_params = requires {
  requires static_cast<bool>(T::params_on_device);
};

}  // namespace tierstate
