// SPDX-License-Identifier: Apache-2.0
// Device: optimizer state in GPU memory, the placement with no offload at all.
//
// The baseline every offload is measured against: state next to the kernels that update
// it, at the cost of 12 (fp32 master, m, v) or more bytes of GPU memory per parameter. Its
// bytes are addressable only on the device (`device_data()`), so only OnDevice compute
// updates it (in place); read and write copy to and from host memory, as every tier's do,
// for checkpoints and copy_state.
//
// With TIERSTATE_ENABLE_CUDA the memory comes from cudaMallocAsync (stream-ordered, from
// the device's memory pool) where the device supports it, else cudaMalloc, on the current
// device. Without CUDA it is the emulated device's memory (core/device_runtime.hpp): host
// memory, so the compositions that use it run, and are tested, on machines without a GPU.
#pragma once

#include <tierstate/core/device_runtime.hpp>
#include <tierstate/core/error.hpp>
#include <tierstate/tiers/tier.hpp>

#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <utility>

namespace tierstate::inline TIERSTATE_ABI {

class Device {
 public:
  struct options {};
  static constexpr std::string_view name = "Device";

  /// Zero-filled device memory of `bytes` bytes; throws tierstate::cuda_error naming the
  /// size when the device has not that much free.
  explicit Device(std::size_t bytes, options const& = {}) : size_(bytes)
  {
    if (bytes == 0) { return; }
    device::stream_view const s{};
    data_ = static_cast<std::byte*>(device::allocate_async(bytes, s));
    try {
      device::zero_async(data_, bytes, s);
      s.synchronize();
    } catch (...) {
      device::deallocate_async(data_, s);
      throw;
    }
  }
  ~Device() { release(); }
  Device(Device&& o) noexcept : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  Device& operator=(Device&& o) noexcept
  {
    if (this != &o) {
      release();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  Device(Device const&)            = delete;
  Device& operator=(Device const&) = delete;

  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  /// The bytes, as a device pointer: for device kernels and device copies only.
  [[nodiscard]] std::byte* device_data() noexcept { return data_; }

  /// Copies to host memory; waits.
  void read(std::size_t offset, std::span<std::byte> to) const
  {
    check(offset, to.size());
    device::copy(to.data(), data_ + offset, to.size());
  }
  /// Copies from host memory; waits.
  void write(std::size_t offset, std::span<std::byte const> from)
  {
    check(offset, from.size());
    device::copy(data_ + offset, from.data(), from.size());
  }

 private:
  void release() noexcept
  {
    device::stream_view const s{};
    device::deallocate_async(std::exchange(data_, nullptr), s);
  }
  void check(std::size_t offset, std::size_t n) const
  {
    TIERSTATE_EXPECTS(offset <= size_ && n <= size_ - offset,
                      std::string("Device: bytes [")
                        .append(std::to_string(offset))
                        .append(", ")
                        .append(std::to_string(offset + n))
                        .append(") are outside its ")
                        .append(std::to_string(size_))
                        .append(" bytes"));
  }

  std::byte* data_  = nullptr;
  std::size_t size_ = 0;
};

static_assert(device_tier<Device> && !addressable_tier<Device>);

}  // namespace tierstate
