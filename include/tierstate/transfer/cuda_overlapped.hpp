// SPDX-License-Identifier: Apache-2.0
// CudaOverlapped<Depth>: a step whose params and gradients live on the GPU, with every copy
// over PCIe (and every NVMe read and write) overlapped with compute, chunk by chunk.
//
// With OnHost compute (ZeRO-Offload; ZeRO-Infinity's optimizer offload with NvmeFile):
// chunk k's gradients are copied device to pinned host on one stream while chunk k-1 is
// computed, the updated params go back pinned host to device on another stream while chunk
// k+1 is computed, and the state is updated in place (PinnedHost) or read Depth chunks ahead
// and written behind through the pinned staging ring (NvmeFile, as Pipelined<Depth>). With
// OnDevice compute and a host tier: chunk k+1's state is copied host to device while chunk
// k is updated on the device and chunk k-1's state copied back, on three streams ordered by
// events; NvmeFile reads run Depth chunks ahead of those copies. With the Device tier and
// OnDevice there is nothing to move: the chunks are updated in place on the device.
//
// Staging, fixed whatever the model's size, with B = Depth + 2 buffers of one chunk each:
// OnHost: B x chunk_elements x (sizeof grad + sizeof param) of pinned host memory, plus B
// chunks of state for a tier that is not addressable; OnDevice: B chunks of state in device
// memory, plus B pinned chunks for a tier that is not addressable. step() returns when every
// copy has landed.
#pragma once

#include <tierstate/core/config.hpp>
#include <tierstate/transfer/pipelined.hpp>

#include <type_traits>

namespace tierstate::inline TIERSTATE_ABI {

/// The pipelined schedule (Pipelined<Depth>'s: its depth, staging_buffers and schedule) over
/// the device routes: what sets it apart is that params and gradients live on the device.
template <unsigned Depth = 2>
struct CudaOverlapped : Pipelined<Depth> {
  /// Params and gradients live on the device (transfer/concept.hpp's moves_device_params).
  static constexpr bool params_on_device = true;
};

template <class T>
struct is_cuda_overlapped : std::false_type {};
template <unsigned Depth>
struct is_cuda_overlapped<CudaOverlapped<Depth>> : std::true_type {};
template <class T>
inline constexpr bool is_cuda_overlapped_v = is_cuda_overlapped<T>::value;

}  // namespace tierstate
