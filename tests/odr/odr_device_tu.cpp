// SPDX-License-Identifier: Apache-2.0
// Compiled twice into one program: with Thrust's CPP system and with its OMP system. Both
// instantiate the device kernel and an OnDevice optimizer through the same source text; the
// kernels live in an inline namespace per Thrust system, so neither side can end up running
// the other's code.
#include "odr_tu.hpp"

#include <tierstate/kernels/device/on_device.hpp>
#include <tierstate/tierstate.hpp>

#include <vector>

namespace tierstate::test {

odr_result ODR_FUNCTION()
{
  std::size_t const n = 50'003;
  std::vector<bf16> param(n), grad(n);
  for (std::size_t i = 0; i < n; ++i) {
    param[i] = bf16(0.25f + static_cast<float>(i % 97) * 0.01f);
    grad[i]  = bf16(static_cast<float>(static_cast<int>(i % 101) - 50) * 1e-3f);
  }
  // The emulated device's memory is host memory: these vectors serve as device memory.
  OffloadedOptimizer<AdamW, Bf16Mixed, PinnedHost, CudaOverlapped<2>, OnDevice> opt({}, {.chunk_elements = 8192});
  opt.add_tensor("w", param.data(), n, location::device);
  grad_view<bf16> const g{grad.data(), n, location::device};
  for (int t = 1; t <= 10; ++t) { opt.step({&g, 1}); }
  odr_result r;
  r.arch = device::system_name();
  for (std::size_t i = 0; i < n; ++i) { r.bits.push_back(param[i].bits); }
  return r;
}

}  // namespace tierstate::test
