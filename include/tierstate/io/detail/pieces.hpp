// SPDX-License-Identifier: Apache-2.0
// What both engines share: cutting requests into pieces, and naming a failed piece.
#pragma once

#include <tierstate/io/request.hpp>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace tierstate::io::detail {

struct piece {
  std::size_t request;  ///< index of its request
  std::uint64_t offset;
  std::byte* data;
  std::size_t length;
};

/// The requests cut into pieces of at most `block` bytes, in order.
inline std::vector<piece> cut(std::span<request const> requests, std::size_t block)
{
  std::vector<piece> out;
  for (std::size_t i = 0; i < requests.size(); ++i) {
    auto const& r = requests[i];
    for (std::size_t done = 0; done < r.length; done += block) {
      out.push_back({i, r.offset + done, r.data + done, std::min(block, r.length - done)});
    }
  }
  return out;
}

/// The errno for a transfer that moved nothing: a read at the end of the file, or a write
/// the device would not take.
constexpr int no_progress_error(bool write) noexcept { return write ? EIO : ENODATA; }

/// The first failure of a batch, kept until every piece in flight is done.
struct first_failure {
  int error = 0;
  piece where{};

  void note(int err, piece const& p) noexcept
  {
    if (error == 0) {
      error = err;
      where = p;
    }
  }
  void rethrow(std::span<request const> requests) const
  {
    if (error == 0) { return; }
    auto const& r = requests[where.request];
    throw io_error(error, r.path != nullptr ? *r.path : "(fd " + std::to_string(r.fd) + ")",
                   r.write ? "write" : "read", where.offset, where.length);
  }
};

}  // namespace tierstate::io::detail
