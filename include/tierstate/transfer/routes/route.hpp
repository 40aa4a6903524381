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
// route_of<Optimizer> is the route of a composition: the optimizer names no tier, compute or
// transfer trait of its own to find it.
#pragma once

#include <tierstate/tiers/tier.hpp>
#include <tierstate/transfer/routes/device_params_on_host.hpp>
#include <tierstate/transfer/routes/device_resident.hpp>
#include <tierstate/transfer/routes/host_in_place.hpp>
#include <tierstate/transfer/routes/host_staged.hpp>
#include <tierstate/transfer/routes/streamed_to_device.hpp>

namespace tierstate::inline TIERSTATE_ABI::routes {

/// Where a composition's state lives, for choosing its route.
enum class state_home { addressable_host, staged_host, device };

template <class Optimizer, state_home Home, bool OnDevice, bool DeviceParams>
struct route_for {
  static_assert(Home != Home,  // always false, once instantiated
                "tierstate::routes::route_for: no route serves this combination of state tier, compute "
                "and params (the table in transfer/routes/route.hpp lists those that exist): state in the "
                "Device tier needs OnDevice compute, and OnDevice compute needs device params.");
};

template <class Optimizer>
struct route_for<Optimizer, state_home::addressable_host, false, false> {
  using type = host_in_place<Optimizer>;
};
template <class Optimizer>
struct route_for<Optimizer, state_home::staged_host, false, false> {
  using type = host_staged<Optimizer>;
};
template <class Optimizer, state_home Home>
  requires(Home != state_home::device)
struct route_for<Optimizer, Home, false, true> {
  using type = device_params_on_host<Optimizer>;
};
template <class Optimizer>
struct route_for<Optimizer, state_home::device, true, true> {
  using type = device_resident<Optimizer>;
};
template <class Optimizer, state_home Home>
  requires(Home != state_home::device)
struct route_for<Optimizer, Home, true, true> {
  using type = streamed_to_device<Optimizer>;
};

/// Where tier T keeps the state.
template <class T>
inline constexpr state_home home_of = device_tier<T>        ? state_home::device
                                      : addressable_tier<T> ? state_home::addressable_host
                                                            : state_home::staged_host;

/// The route of composition `Optimizer` (an OffloadedOptimizer).
template <class Optimizer>
using route_of = typename route_for<Optimizer, home_of<typename Optimizer::tier_type>,
                                    Optimizer::compute_type::runs_on_device, Optimizer::takes_device_params>::type;

}  // namespace tierstate::routes
