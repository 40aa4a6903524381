// SPDX-License-Identifier: Apache-2.0
// What both engines share: cutting requests into pieces, and naming a failed piece.
#pragma once

#include <tierstate/io/request.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace tierstate::inline TIERSTATE_ABI::io::detail {

struct piece {
  std::size_t request;  ///< index of its request
  std::uint64_t offset;
  std::byte* data;
  std::size_t length;
};

/// The piece of at most `block` bytes of `r` (request `index`) that starts `done` bytes in.
inline piece piece_at(request const& r, std::size_t index, std::size_t done, std::size_t block) noexcept
{
  return {index, r.offset + done, r.data + done, std::min(block, r.length - done)};
}

/// Calls f(piece) for each piece of at most `block` bytes of `r` (request `index`), in order.
template <class F>
void for_each_piece(request const& r, std::size_t index, std::size_t block, F&& f)
{
  for (std::size_t done = 0; done < r.length; done += block) { f(piece_at(r, index, done, block)); }
}

/// The requests cut into pieces of at most `block` bytes, in order.
inline std::vector<piece> cut(std::span<request const> requests, std::size_t block)
{
  std::vector<piece> out;
  for (std::size_t i = 0; i < requests.size(); ++i) {
    for_each_piece(requests[i], i, block, [&](piece const& p) { out.push_back(p); });
  }
  return out;
}

/// The errno for a transfer that moved nothing: a read at the end of the file, or a write
/// the device would not take.
constexpr int no_progress_error(bool write) noexcept { return write ? EIO : ENODATA; }

/// How errors name a request's file: its path, or its descriptor.
inline std::string path_of(request const& r)
{
  if (r.path != nullptr) { return *r.path; }
  return std::string("(fd ").append(std::to_string(r.fd)).append(")");
}

/// "200 ms": a timeout, for messages.
inline std::string describe_timeout(std::chrono::milliseconds t)
{
  return std::to_string(t.count()).append(" ms");
}

/// The first failure of a batch, kept until every piece in flight is done.
struct first_failure {
  int error = 0;
  piece where{};
  char const* operation = nullptr;  ///< null: the request's own ("read" or "write")
  std::string hint;                 ///< what the failure means, for the message; may be empty

  void note(int err, piece const& p, char const* op = nullptr, std::string why = {})
  {
    if (error == 0) {
      error     = err;
      where     = p;
      operation = op;
      hint      = std::move(why);
    }
  }
  [[nodiscard]] io_error to_error(std::span<request const> requests) const
  {
    auto const& r = requests[where.request];
    return io_error(error, path_of(r), operation != nullptr ? operation : (r.write ? "write" : "read"),
                    where.offset, where.length, hint);
  }
  void rethrow(std::span<request const> requests) const
  {
    if (error == 0) { return; }
    throw to_error(requests);
  }
};

}  // namespace tierstate::io::detail
