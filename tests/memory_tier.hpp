// SPDX-License-Identifier: Apache-2.0
// A user's tier for the tests: plain memory behind read and write (not addressable, so the
// optimizer stages its chunks), whose writes fail once a budget runs out (as a full disk's
// would), reads that fail on demand, and a hook each write calls first (to hold it, or fail it). tests/test_optimizer.cpp,
// tests/test_user_transfer.cpp and tests/test_offloaded_params.cpp use it.
#pragma once

#include <cstddef>
#include <cstring>
#include <functional>
#include <span>
#include <stdexcept>
#include <string_view>
#include <vector>

namespace tierstate::test {

class memory_tier {
 public:
  struct options {
    int* writes_left = nullptr;  ///< writes that succeed before they fail; null: never fails
    std::function<void()> before_write;  ///< called by each write first (it may block or throw)
    bool const* fail_reads = nullptr;    ///< reads fail while it points at true
  };
  static constexpr std::string_view name = "memory_tier";
  memory_tier(std::size_t bytes, options const& o) : bytes_(bytes), opts_(o) {}
  [[nodiscard]] std::size_t size() const { return bytes_.size(); }
  void read(std::size_t offset, std::span<std::byte> to) const
  {
    if (opts_.fail_reads != nullptr && *opts_.fail_reads) { throw std::runtime_error("memory_tier: read failed"); }
    std::memcpy(to.data(), bytes_.data() + offset, to.size());
  }
  void write(std::size_t offset, std::span<std::byte const> from)
  {
    if (opts_.before_write) { opts_.before_write(); }
    if (opts_.writes_left != nullptr && (*opts_.writes_left)-- <= 0) {
      throw std::runtime_error("memory_tier: write failed");
    }
    std::memcpy(bytes_.data() + offset, from.data(), from.size());
  }

 private:
  std::vector<std::byte> bytes_;
  options opts_;
};

}  // namespace tierstate::test
