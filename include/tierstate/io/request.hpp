// SPDX-License-Identifier: Apache-2.0
// The I/O engines' options and requests (the engines: io/engine.hpp).
#pragma once

#include <tierstate/core/error.hpp>
#include <tierstate/io/error.hpp>
#include <tierstate/io/fault.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

namespace tierstate::inline TIERSTATE_ABI::io {

enum class backend : std::uint8_t {
  io_uring,  ///< liburing (the default)
  psync,     ///< pread/pwrite on a pool of threads: for where io_uring is forbidden
};

[[nodiscard]] constexpr std::string_view backend_name(backend b) noexcept
{
  return b == backend::io_uring ? "io_uring" : "psync";
}

struct engine_options {
  io::backend backend    = io::backend::io_uring;
  unsigned queue_depth   = 32;                      ///< pieces in flight at once per ring, 1..4096
  std::size_t block_size = std::size_t{1} << 20;     ///< largest piece, a multiple of 4096
  unsigned rings         = 1;                       ///< io_uring rings, 1..64 (io_uring only)
  /// How long one piece may stay in the kernel's hands, unanswered, before it counts as
  /// hung and its request fails with ETIMEDOUT (see io/engine.hpp for what follows); 0: wait
  /// as long as it takes. The default is well above the Linux NVMe and SCSI drivers' own 30 s
  /// command timeout and a controller reset after it, so wherever the kernel can still answer
  /// (EIO), it does so first. At most 24 hours.
  std::chrono::milliseconds timeout{std::chrono::seconds(120)};
  /// Planted faults, for tests (see io/fault.hpp); null in production.
  std::shared_ptr<fault_plan> faults;

  /// Throws tierstate::invalid_option naming the first bad field.
  void validate() const
  {
    if (queue_depth == 0 || queue_depth > 4096) {
      throw invalid_option("io.queue_depth", detail::to_text(queue_depth), "must be in 1..4096");
    }
    if (block_size == 0 || block_size % 4096 != 0) {
      throw invalid_option("io.block_size", detail::to_text(block_size),
                           "must be a positive multiple of 4096");
    }
    if (rings == 0 || rings > 64) {
      throw invalid_option("io.rings", detail::to_text(rings), "must be in 1..64");
    }
    if (timeout.count() < 0 || timeout > std::chrono::hours(24)) {
      throw invalid_option("io.timeout", detail::to_text(static_cast<long long>(timeout.count())) + " ms",
                           "must be 0 (no timeout) or at most 24 hours");
    }
    if (backend != io::backend::io_uring && backend != io::backend::psync) {
      throw invalid_option("io.backend", detail::to_text(static_cast<unsigned>(backend)),
                           "must be io_uring or psync");
    }
  }
};

/// How long a timed-out I/O's cancellation (io_uring), or the rest of the I/O in flight once
/// one has timed out, is waited for before the engine gives up on it: the timeout, within
/// [100 ms, 1 s]. A cancellation the kernel can make answers in microseconds; one that does
/// not answer in a second is not coming.
[[nodiscard]] inline std::chrono::milliseconds cancel_grace(engine_options const& o) noexcept
{
  return std::clamp(o.timeout, std::chrono::milliseconds(100), std::chrono::milliseconds(1000));
}

/// One range of one file to read into or write from memory.
struct request {
  int fd                  = -1;
  std::uint64_t offset    = 0;
  std::byte* data         = nullptr;
  std::size_t length      = 0;
  bool write              = false;
  std::string const* path = nullptr;  ///< for error messages
};

}  // namespace tierstate::io
