// SPDX-License-Identifier: Apache-2.0
// The device compositions of the composition matrix (matrix.hpp), by name and as type
// lists. They need Thrust: the tests that include this header build with a Thrust host
// backend (THRUST_DEVICE_SYSTEM) or with nvcc.
#pragma once

#include "matrix.hpp"

#include <tierstate/kernels/device/on_device.hpp>

namespace tierstate::test::matrix {

/// No offload: state, compute, params and gradients on the device.
template <class P, unsigned D = 2>
using DeviceResident = OffloadedOptimizer<AdamW, P, Device, CudaOverlapped<D>, OnDevice>;
/// ZeRO-Offload: state in pinned host RAM, the rule on the host, params on the device.
template <class P, unsigned D = 2>
using ZeroOffload = OffloadedOptimizer<AdamW, P, PinnedHost, CudaOverlapped<D>, OnHost<>>;
/// ZeRO-Infinity's optimizer offload: the same with the state on NVMe.
template <class P, unsigned D = 2>
using ZeroInfinity = OffloadedOptimizer<AdamW, P, NvmeFile, CudaOverlapped<D>, OnHost<>>;
/// The state streamed from a host tier to the device, the rule on the device.
template <class P, class Tier = PinnedHost, unsigned D = 2>
using Streamed = OffloadedOptimizer<AdamW, P, Tier, CudaOverlapped<D>, OnDevice>;

/// The four device compositions with bf16 params (the refusal twins).
using device_compositions =
  pick<std::tuple<DeviceResident<Bf16Mixed>, ZeroOffload<Bf16Mixed>, Streamed<Bf16Mixed>, Streamed<Bf16Mixed, NvmeFile>>,
       std::tuple<ZeroOffload<Bf16Mixed>, Streamed<Bf16Mixed, NvmeFile>>>;

/// The device compositions of the streaming-step comparison.
using device_streaming_compositions =
  pick<std::tuple<DeviceResident<Bf16Mixed>, ZeroOffload<Bf16Mixed>, ZeroInfinity<Bf16Mixed>, Streamed<Bf16Mixed>,
                  Streamed<Bf16Mixed, NvmeFile>, ZeroOffload<Fp32>>,
       std::tuple<ZeroOffload<Bf16Mixed>, Streamed<Bf16Mixed, NvmeFile>>>;

/// The device compositions of the non-finite gradient test.
using device_nonfinite_compositions = pick<std::tuple<DeviceResident<Bf16Mixed>, ZeroOffload<Bf16Mixed>, Streamed<Bf16Mixed>>,
                                           std::tuple<ZeroOffload<Bf16Mixed>, Streamed<Bf16Mixed>>>;

/// The device compositions whose state is on NVMe (the I/O error tests).
using device_nvme_compositions = std::tuple<Streamed<Bf16Mixed, NvmeFile>, ZeroInfinity<Bf16Mixed>>;

}  // namespace tierstate::test::matrix
