// SPDX-License-Identifier: Apache-2.0
// The extension's view of one offloaded_params (state/offloaded_params.hpp): a model's
// weights resting in a tier and brought into a window of buffers layer by layer, for
// tierstate_torch.offload_parameters. A run-time interface, free of torch and pybind, over
// the compositions of param dtype, tier and buffer location (param_store.cpp).
#pragma once

#include "shard.hpp"

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace tierstate_torch {

/// Everything that picks the composition and its options.
struct store_config {
  dtype param           = dtype::f32;  ///< f32, bf16 or f16
  std::string tier      = "pinned";    ///< "pinned" (PinnedHost) or "nvme" (NvmeFile)
  std::string directory;               ///< NvmeFile: where the scratch files go
  unsigned window       = 2;           ///< layers read ahead of the one in use
  std::size_t persistence_threshold = 0;  ///< tensors of fewer elements stay in host memory
  std::size_t write_behind_bytes    = std::size_t{64} << 20;
  bool device_buffers   = false;  ///< the window in device memory (CUDA, or the emulated device)
};

/// What the window did since it was made (offload_stats), and its memory.
struct store_stats {
  std::uint64_t acquires = 0, ready = 0, waited = 0, on_demand = 0, out_of_order = 0, reads = 0;
  std::uint64_t bytes_read = 0, bytes_written = 0, grad_bytes_written = 0, grad_bytes_read = 0;
  double wait_seconds        = 0;
  std::size_t buffer_bytes   = 0;  ///< one buffer's
  std::size_t buffer_count   = 0;
  std::size_t tier_bytes     = 0;
  std::size_t resident_bytes = 0;
};

class param_store {
 public:
  virtual ~param_store() = default;
  virtual std::size_t add_layer(std::string name) = 0;
  virtual std::size_t add_tensor(std::size_t layer, std::string name, std::size_t count) = 0;
  virtual void materialize() = 0;
  /// The layer's tensors' memory (host, or device with device_buffers), in the order they
  /// were added, valid until release().
  virtual std::vector<std::span<std::byte const>> acquire(std::size_t layer) = 0;
  /// `stream`: device buffers are free once the work queued on it so far is done.
  virtual void release(std::size_t layer, std::uintptr_t stream) = 0;
  virtual void end_iteration() = 0;
  /// Elements [offset, offset + bytes / element size) of tensor `t`, host memory.
  virtual void read(std::size_t t, std::size_t offset, std::span<std::byte> to) = 0;
  virtual void write(std::size_t t, std::size_t offset, std::span<std::byte const> from) = 0;
  virtual void flush() = 0;
  [[nodiscard]] virtual std::size_t tensor_size(std::size_t t) const = 0;
  [[nodiscard]] virtual bool resident(std::size_t t) const = 0;
  [[nodiscard]] virtual store_stats stats() const = 0;
  [[nodiscard]] virtual dtype param() const noexcept = 0;
  /// The tierstate::param_source<P> (P: param()'s type) that shard::add_offloaded registers.
  [[nodiscard]] virtual void* source() noexcept = 0;
};

/// Throws std::invalid_argument naming the option for a tier or dtype it does not have, and
/// tierstate's invalid_option for a bad window or directory.
std::unique_ptr<param_store> make_param_store(store_config const& c);

}  // namespace tierstate_torch
