// SPDX-License-Identifier: Apache-2.0
// tierstate::io_error: every I/O failure, naming path, offset, length, operation and errno.
#pragma once

#include <tierstate/core/config.hpp>

#include <cstdint>
#include <string>
#include <string_view>
#include <system_error>

namespace tierstate::inline TIERSTATE_ABI {

/// An I/O operation that failed. code() holds the errno; what() reads, for example,
/// "tierstate: write of 1048576 bytes at offset 4194304 of /scratch/opt.state failed: No
/// space left on device".
class io_error : public std::system_error {
 public:
  /// `hint`, when given, says what the failure means for the user (put in parentheses).
  io_error(int err, std::string path, std::string_view operation, std::uint64_t offset = 0,
           std::uint64_t length = 0, std::string_view hint = {})
    : std::system_error(err, std::generic_category(), describe(path, operation, offset, length, hint)),
      path_(std::move(path)),
      operation_(operation),
      offset_(offset),
      length_(length)
  {
  }

  [[nodiscard]] std::string const& path() const noexcept { return path_; }
  [[nodiscard]] std::string const& operation() const noexcept { return operation_; }
  [[nodiscard]] std::uint64_t offset() const noexcept { return offset_; }
  [[nodiscard]] std::uint64_t length() const noexcept { return length_; }

 private:
  static std::string describe(std::string const& path, std::string_view operation, std::uint64_t offset,
                              std::uint64_t length, std::string_view hint)
  {
    // Appended piece by piece: GCC 12 warns falsely (-Wrestrict) on "literal" + string.
    std::string text = "tierstate: ";
    text.append(operation).append(" of ");
    if (length != 0) {
      text.append(std::to_string(length)).append(" bytes at offset ").append(std::to_string(offset)).append(" of ");
    }
    text.append(path).append(" failed");
    if (!hint.empty()) { text.append(" (").append(hint).append(")"); }
    return text;
  }

  std::string path_;
  std::string operation_;
  std::uint64_t offset_;
  std::uint64_t length_;
};

}  // namespace tierstate
