// SPDX-License-Identifier: Apache-2.0
// The I/O engines' options and requests (the engines: io/engine.hpp).
#pragma once

#include <tierstate/core/error.hpp>
#include <tierstate/io/error.hpp>
#include <tierstate/io/fault.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

namespace tierstate::io {

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
    if (backend != io::backend::io_uring && backend != io::backend::psync) {
      throw invalid_option("io.backend", detail::to_text(static_cast<unsigned>(backend)),
                           "must be io_uring or psync");
    }
  }
};

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
