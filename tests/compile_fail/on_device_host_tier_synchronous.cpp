// SPDX-License-Identifier: Apache-2.0
// OnDevice compute with the state in a host tier and the Synchronous transfer: the state must
// stream to the GPU, which only CudaOverlapped does.
// needs: thrust
// expect: OnDevice compute with state in a host tier streams each chunk's state to the GPU and back: use the CudaOverlapped<Depth> transfer.
#include <tierstate/kernels/device/on_device.hpp>
#include <tierstate/tierstate.hpp>

using namespace tierstate;
using Opt = OffloadedOptimizer<AdamW, Bf16Mixed, PinnedHost, Synchronous, OnDevice>;
static_assert(sizeof(Opt) > 0);
