// SPDX-License-Identifier: Apache-2.0
// A user's own transfer, written against the transfer concept only (transfer/concept.hpp):
// Throttled<Depth> sleeps before each chunk's compute and fetches on its own rhythm (just
// before the compute that needs a buffer, not after the retire as Pipelined does). It is not
// derived from any library transfer and nothing in include/ names it. With OnDevice = true
// it says params_on_device, so it takes params and gradients in device memory and drives the
// device routes as CudaOverlapped does. tests/test_user_transfer.cpp runs it over the host
// routes, tests/test_device.cpp over the device routes.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <thread>

namespace tierstate::test {

/// Compute legs the Throttled schedules have run, in this process.
inline std::atomic<std::size_t> throttled_computes{0};

template <unsigned Depth, bool OnDevice = false>
struct Throttled {
  static constexpr unsigned depth            = Depth;
  static constexpr unsigned staging_buffers  = Depth + 2;
  static constexpr bool params_on_device     = OnDevice;

  template <class Route>
  static void schedule(Route& r)
  {
    std::size_t const n = r.chunks();
    std::size_t fetched = 0;  // chunks whose fetch has started
    for (std::size_t j = 0; j < n; ++j) {
      // Chunk f goes into buffer f % (Depth + 2), whose previous chunk (f - Depth - 2 <= j - 2)
      // was retired two iterations ago.
      while (fetched < n && fetched <= j + Depth) {
        r.fetch(fetched, static_cast<unsigned>(fetched % staging_buffers));
        ++fetched;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
      r.compute(j, static_cast<unsigned>(j % staging_buffers));
      ++throttled_computes;
      r.retire(j, static_cast<unsigned>(j % staging_buffers));
    }
    r.finish();
  }
};

}  // namespace tierstate::test
