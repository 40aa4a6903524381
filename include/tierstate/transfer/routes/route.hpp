// SPDX-License-Identifier: Apache-2.0
// Which route a composition's chunks take, chosen by specialization on where the state
// lives, where the update runs and where the params live. One file per route:
//
//   state tier        compute    params        route
//   not addressable   OnHost     host          host_staged.hpp
//   host (any)        OnHost     device        device_params_on_host.hpp
//   Device            OnDevice   device        device_resident.hpp
//   host (any)        OnDevice   device        streamed_to_device.hpp
//
// An addressable tier with host compute and host params has nothing to move: its step is one
// parallel pass over the tier's memory (detail/optimizer/step_host.inl), not a route.
#pragma once

#include <tierstate/transfer/routes/device_params_on_host.hpp>
#include <tierstate/transfer/routes/device_resident.hpp>
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

}  // namespace tierstate::routes
