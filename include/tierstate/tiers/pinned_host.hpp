// SPDX-License-Identifier: Apache-2.0
// PinnedHost: optimizer state in host memory, the ZeRO-Offload placement.
//
// With CUDA enabled (TIERSTATE_ENABLE_CUDA) the memory comes from cudaHostAlloc, page-locked
// so that copies to and from the GPU run at full PCIe speed; without CUDA it is anonymous,
// page-aligned memory from mmap. Either way it is zero-filled and addressable.
#pragma once

#include <tierstate/core/error.hpp>
#include <tierstate/tiers/tier.hpp>

#include <cerrno>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>

#include <sys/mman.h>

#if defined(TIERSTATE_ENABLE_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace tierstate {
inline namespace TIERSTATE_CUDA_ABI {

class PinnedHost {
 public:
  struct options {};
  static constexpr std::string_view name = "PinnedHost";

  /// Zero-filled, page-aligned memory of `bytes` bytes. Throws std::system_error (ENOMEM
  /// and the like) naming the size when the memory cannot be had.
  explicit PinnedHost(std::size_t bytes, options const& = {}) : size_(bytes)
  {
    if (bytes == 0) { return; }
#if defined(TIERSTATE_ENABLE_CUDA)
    void* p = nullptr;
    cudaError_t const e = cudaHostAlloc(&p, bytes, cudaHostAllocDefault);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();  // clear it: the next CUDA call must not see it
      throw std::system_error(ENOMEM, std::generic_category(),
                              "PinnedHost: cudaHostAlloc of " + std::to_string(bytes) +
                                " bytes failed: " + cudaGetErrorString(e));
    }
    std::memset(p, 0, bytes);
#else
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      throw std::system_error(errno, std::generic_category(),
                              "PinnedHost: cannot allocate " + std::to_string(bytes) + " bytes");
    }
#endif
    data_ = static_cast<std::byte*>(p);
  }
  ~PinnedHost() { release(); }
  PinnedHost(PinnedHost&& o) noexcept
    : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0))
  {
  }
  PinnedHost& operator=(PinnedHost&& o) noexcept
  {
    if (this != &o) {
      release();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  PinnedHost(PinnedHost const&)            = delete;
  PinnedHost& operator=(PinnedHost const&) = delete;

  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] std::byte* data() noexcept { return data_; }

  void read(std::size_t offset, std::span<std::byte> to) const
  {
    check(offset, to.size());
    if (!to.empty()) { std::memcpy(to.data(), data_ + offset, to.size()); }
  }
  void write(std::size_t offset, std::span<std::byte const> from)
  {
    check(offset, from.size());
    if (!from.empty()) { std::memcpy(data_ + offset, from.data(), from.size()); }
  }

 private:
  void release() noexcept
  {
    if (data_ == nullptr) { return; }
#if defined(TIERSTATE_ENABLE_CUDA)
    cudaFreeHost(data_);
#else
    ::munmap(data_, size_);
#endif
    data_ = nullptr;
  }

  void check(std::size_t offset, std::size_t n) const
  {
    TIERSTATE_EXPECTS(offset <= size_ && n <= size_ - offset,
                      "PinnedHost: bytes [" + std::to_string(offset) + ", " +
                        std::to_string(offset + n) + ") are outside its " +
                        std::to_string(size_) + " bytes");
  }

  std::byte* data_  = nullptr;
  std::size_t size_ = 0;
};

static_assert(addressable_tier<PinnedHost>);

}  // namespace TIERSTATE_CUDA_ABI
}  // namespace tierstate
