// SPDX-License-Identifier: Apache-2.0
// OffloadedOptimizer's step states (optimizer.hpp): a streaming step's gate (see
// detail/optimizer/streaming.inl) and the delayed update in the background (delayed.inl).
#pragma once

#include <tierstate/core/device_runtime.hpp>
#include <tierstate/core/stats.hpp>
#include <tierstate/core/tensor.hpp>
#include <tierstate/tiers/pinned_host.hpp>

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace tierstate::inline TIERSTATE_ABI::detail {

/// A streaming step's bookkeeping; its driver thread runs run_step().
template <class Grad, class Coefficients>
struct streaming_state {
  std::mutex m;
  std::condition_variable cv;
  bool active       = false;
  bool abandoned    = false;  ///< the optimizer is being destroyed mid-step
  bool checks       = false;  ///< non-finite check or clipping: wait for every gradient
  bool checked      = false;  ///< those ran
  unsigned micro_batches = 1;
  double grad_scale = 1.0;
  std::chrono::steady_clock::time_point started;
  std::vector<grad_view<Grad>> views;  ///< per tensor; {nullptr, 0}: no gradient
  std::vector<unsigned> arrivals;           ///< per tensor: grad_ready calls so far
  std::vector<char> final_;                 ///< per tensor: gradient final (or absent)
  std::size_t finals = 0;
  std::vector<std::size_t> pending;  ///< per chunk: its tensors not yet final
  std::vector<char> ready;           ///< per chunk
  std::vector<std::size_t> arrival;  ///< chunks in the order they became ready
  std::vector<std::size_t> order;    ///< this step's chunk order
  std::vector<std::unique_ptr<device::event>> grad_events;  ///< per tensor: its gradient's readiness
  std::vector<Coefficients> coefficients;
  step_result result;
  std::exception_ptr error;
  std::thread driver;
  ~streaming_state()
  {
    if (driver.joinable()) {
      {
        std::lock_guard lock(m);
        abandoned = true;
      }
      cv.notify_all();
      driver.join();
    }
  }
};
/// delayed_update: the update in the background, its gradients and its params.
template <class Grad, class Coefficients>
struct delayed_state {
  PinnedHost grads{0};   ///< every tensor's gradient, in layout order
  PinnedHost params{0};  ///< every tensor's params as the update leaves them, in layout order
  std::vector<grad_view<Grad>> views;
  std::vector<Coefficients> coefficients;
  step_result result;
  std::exception_ptr error;
  std::thread worker;
  ~delayed_state()
  {
    if (worker.joinable()) { worker.join(); }
  }
};

}  // namespace tierstate::detail
