// SPDX-License-Identifier: Apache-2.0
// Which route a composition's chunks take, chosen by specialization on where the state
// lives, where the update runs and where the params live. One file per route:
//
//   state tier        compute    params        route
//   addressable host  OnHost     host          host_in_place.hpp
//   not addressable   OnHost     host          host_staged.hpp
//   host (any)        OnHost     device        device_params_on_host.hpp
//   Device            OnDevice   device        device_resident.hpp
//   host (any)        OnDevice   device        streamed_to_device.hpp
//
// placement<StateTier, Compute, Transfer> is a composition's route and what the route needs
// made beside the state (staging, an I/O thread, device streams and rings): the optimizer, its
// state store and its step's checks read it and name no tier, compute or transfer trait of
// their own.
#pragma once

#include <tierstate/tiers/tier.hpp>
#include <tierstate/transfer/concept.hpp>
#include <tierstate/transfer/routes/device_params_on_host.hpp>
#include <tierstate/transfer/routes/device_resident.hpp>
#include <tierstate/transfer/routes/host_in_place.hpp>
#include <tierstate/transfer/routes/host_staged.hpp>
#include <tierstate/transfer/routes/streamed_to_device.hpp>

#include <concepts>
#include <cstddef>
#include <type_traits>

namespace tierstate::inline TIERSTATE_ABI::routes {

/// Where a composition's state lives, for choosing its route.
enum class state_home { addressable_host, staged_host, device };

/// Where a route takes the step's gradients (and the params) from.
enum class grad_home { host, device, either };

/// The host staging a route needs made with the state: none, one chunk (the Device tier's:
/// making the master, checkpoints, copy_state), or one chunk per staging buffer.
enum class host_staging { none, one_chunk, per_buffer };

/// The device resources a route needs made with the state (state/detail/device_resources.hpp):
/// none; streams and pinned PCIe rings for the gradients and params (host compute); streams
/// and the non-finite flag (device compute), with a device ring for the state when it is
/// streamed from a host tier.
enum class device_staging { none, pcie_rings, on_device, on_device_streamed };

/// Each combination's route and what it needs: `route<Optimizer>` is the route class, the
/// rest says what the state store (state/store.hpp) makes for it and where the step's checks
/// (step/checks.hpp) find the gradients.
template <state_home Home, bool OnDevice, bool DeviceParams>
struct route_for {
  static_assert(Home != Home,  // always false, once instantiated
                "tierstate::routes::route_for: no route serves this combination of state tier, compute "
                "and params (the table in transfer/routes/route.hpp lists those that exist): state in the "
                "Device tier needs OnDevice compute, and OnDevice compute needs device params.");
};

/// One row of the table: the route class template and what it needs.
template <template <class> class Route, grad_home Grads, host_staging Staging, device_staging Device>
struct route_entry {
  template <class Optimizer>
  using route                             = Route<Optimizer>;
  static constexpr grad_home grads       = Grads;
  static constexpr host_staging staging  = Staging;
  static constexpr device_staging device = Device;
};

/// A host tier's staging for the routes that move chunks out of it: one chunk per staging
/// buffer where the tier is not addressable, none where the route reads it in place.
template <state_home Home>
inline constexpr host_staging staging_of = Home == state_home::staged_host ? host_staging::per_buffer
                                                                            : host_staging::none;

template <>
struct route_for<state_home::addressable_host, false, false>
  : route_entry<host_in_place, grad_home::host, host_staging::none, device_staging::none> {};
template <>
struct route_for<state_home::staged_host, false, false>
  : route_entry<host_staged, grad_home::host, host_staging::per_buffer, device_staging::none> {};
template <state_home Home>
  requires(Home != state_home::device)
struct route_for<Home, false, true>
  : route_entry<device_params_on_host, grad_home::either, staging_of<Home>, device_staging::pcie_rings> {};
template <>
struct route_for<state_home::device, true, true>
  : route_entry<device_resident, grad_home::device, host_staging::one_chunk, device_staging::on_device> {};
template <state_home Home>
  requires(Home != state_home::device)
struct route_for<Home, true, true>
  : route_entry<streamed_to_device, grad_home::device, staging_of<Home>, device_staging::on_device_streamed> {};

/// Where tier T keeps the state.
template <class T>
inline constexpr state_home home_of = device_tier<T>        ? state_home::device
                                      : addressable_tier<T> ? state_home::addressable_host
                                                            : state_home::staged_host;

/// A composition's placement: its route and what the route needs, in numbers. The only place
/// where the tier's kind, the compute and the transfer's traits are looked at; the optimizer,
/// its state store and its step's checks read this.
template <class StateTier, class Compute, class Transfer>
struct placement {
  static_assert(!device_tier<StateTier> || Compute::runs_on_device,
                "tierstate::OffloadedOptimizer: state in the Device tier is updated where it lives: "
                "use OnDevice compute (or PinnedHost / NvmeFile state for OnHost compute).");
  static_assert(!Compute::runs_on_device || device_tier<StateTier> || moves_device_params<Transfer>,
                "tierstate::OffloadedOptimizer: OnDevice compute with state in a host tier streams "
                "each chunk's state to the GPU and back: use the CudaOverlapped<Depth> transfer. (A "
                "transfer of your own streams it when it says params_on_device = true.)");
  /// A refused combination gets a stand-in row, so that the sentence above is all it says.
  using family = std::conditional_t<(!device_tier<StateTier> || Compute::runs_on_device) &&
                                      (!Compute::runs_on_device || device_tier<StateTier> ||
                                       moves_device_params<Transfer>),
                                    route_for<home_of<StateTier>, Compute::runs_on_device,
                                              Compute::runs_on_device || moves_device_params<Transfer>>,
                                    route_entry<host_in_place, grad_home::host, host_staging::none,
                                                device_staging::none>>;
  template <class Optimizer>
  using route = typename family::template route<Optimizer>;

  /// Staging buffers of one chunk each (the transfer's), for every ring below.
  static constexpr unsigned buffers               = Transfer::staging_buffers;
  /// Chunks the transfer reads ahead.
  static constexpr unsigned depth                 = Transfer::depth;
  static constexpr grad_home grads                = family::grads;
  /// Whether params and gradients may be in device memory.
  static constexpr bool device_params             = family::device != device_staging::none;
  /// Whether the update runs on the device.
  static constexpr bool on_device                 = family::device == device_staging::on_device ||
                                                    family::device == device_staging::on_device_streamed;
  static constexpr device_staging device          = family::device;
  /// Chunks of pinned host staging made with the state.
  static constexpr std::size_t host_staging_chunks = family::staging == host_staging::per_buffer ? buffers
                                                     : family::staging == host_staging::one_chunk ? 1
                                                                                                  : 0;
  /// Whether a step's reads and writes of the tier go through an I/O thread
  /// (transfer/detail/io_worker.hpp): a tier that is not addressable, under a transfer that
  /// reads ahead.
  static constexpr bool io_thread = home_of<StateTier> == state_home::staged_host && Transfer::depth > 0;

  // What the state store asks of the tier beyond the `tier` concept (tiers/tier.hpp):
  /// its bytes are host memory, reached through data();
  static constexpr bool tier_in_host_memory = home_of<StateTier> == state_home::addressable_host;
  /// it takes the staging for registration (register_staging: NvmeFile's fixed buffers);
  static constexpr bool tier_takes_staging = staging_aware_tier<StateTier>;
  /// it checks its options before anything is made (preflight);
  static constexpr bool tier_preflights = preflight_tier<StateTier>;
  /// its I/O engine may retire holding buffers the kernel never gave back (engine().usable()).
  static constexpr bool tier_engine_may_hold = requires(StateTier const& t) {
    { t.engine().usable() } -> std::convertible_to<bool>;
  };
};

/// The route of composition `Optimizer` (an OffloadedOptimizer).
template <class Optimizer>
using route_of = typename Optimizer::placement::template route<Optimizer>;

}  // namespace tierstate::routes
