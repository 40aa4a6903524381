// SPDX-License-Identifier: Apache-2.0
// The io_uring backend's vocabulary (see io/uring_engine.hpp): a ring and its slots, what a
// completed piece came to, what broke the engine and what it holds, and the messages that
// say so.
#pragma once

#include <tierstate/io/detail/pieces.hpp>
#include <tierstate/io/request.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <liburing.h>

namespace tierstate::inline TIERSTATE_ABI::io::detail {

using uring_clock = std::chrono::steady_clock;
inline constexpr uring_clock::time_point never = uring_clock::time_point::max();
/// user_data of a cancellation: this bit, and the slot of the piece it cancels.
inline constexpr std::uint64_t cancel_tag = std::uint64_t{1} << 63;
/// A cancellation's target that matches no request (a planted uncancellable hang's).
inline constexpr std::uint64_t no_request = cancel_tag - 1;

/// A ring call that failed: its errno and name, or error 0.
struct ring_failure {
  int error             = 0;
  char const* operation = "";
};

/// What made the engine unusable, as later calls report it.
struct broken_state {
  int error             = 0;
  std::string path;
  char const* operation = "";
  std::uint64_t offset  = 0;
  std::uint64_t length  = 0;
  std::string hint;
};

/// A buffer the kernel may still use, and what the engine keeps alive for it.
struct held_piece {
  std::span<std::byte> bytes;
  std::shared_ptr<void const> hold;
};

/// What giving up on I/O leaves behind: what broke the engine (error 0: nothing), and the
/// buffers the kernel may still use. The engine keeps one; a batch's ring thread keeps its
/// own, merged into the engine's once every ring has drained.
struct ring_damage {
  broken_state broken;
  std::vector<held_piece> held;

  void throw_if_broken() const
  {
    if (broken.error == 0) { return; }
    throw io_error(broken.error, broken.path, broken.operation, broken.offset, broken.length, broken.hint);
  }
  /// Adds `other`'s: what broke the engine first stays what broke it.
  void take(ring_damage&& other)
  {
    if (broken.error == 0) { broken = std::move(other.broken); }
    for (auto& h : other.held) { held.push_back(std::move(h)); }
  }
};

struct slot_state {
  piece p{};
  uring_clock::time_point deadline = never;  ///< once taken: when it times out
  uring_clock::time_point give_up  = never;  ///< once cancelled: when to stop waiting for it
  bool busy        = false;  ///< its piece is in the ring (prepared; taken or not)
  bool taken       = false;  ///< the kernel has taken it
  bool cancelled   = false;  ///< a cancellation was sent for it
  bool cancel_out  = false;  ///< that cancellation's own completion is still to come
  bool cancellable = true;   ///< false: a planted hang no cancellation reaches
  std::shared_ptr<void const> hold;  ///< a planted hang's pipe, kept while the kernel may read it
};

struct ring_holder {
  io_uring ring{};
  std::vector<slot_state> slots;      ///< queue_depth of them
  std::vector<unsigned> free;         ///< slots with no piece and no cancellation
  std::deque<std::uint64_t> untaken;  ///< user_data prepared and not yet taken, in ring order
  unsigned in_flight = 0;             ///< busy slots
  unsigned cancels   = 0;             ///< cancellations prepared and not completed
};

/// What a piece that came back from the kernel came to.
enum class piece_outcome : std::uint8_t {
  done,       ///< moved in full
  partial,    ///< moved in part: `rest` is still to move
  failed,     ///< `error`: an errno of its own, or no progress at all
  cancelled,  ///< cancelled at its timeout: the timeout, noted when it was cancelled, is its failure
};
struct piece_result {
  piece_outcome what = piece_outcome::done;
  int error          = 0;
  piece rest{};
};

/// The outcome of piece `st` (of a write or a read) whose completion says `res`.
[[nodiscard]] inline piece_result outcome_of(slot_state const& st, int res, bool write) noexcept
{
  // Whatever a cancelled piece did (-ECANCELED, or its result if it finished meanwhile), its
  // request has already failed with the timeout: its remainder is not wanted.
  if (st.cancelled) { return {piece_outcome::cancelled}; }
  if (res < 0) { return {piece_outcome::failed, -res}; }
  if (res == 0) { return {piece_outcome::failed, no_progress_error(write)}; }
  auto const n = static_cast<std::size_t>(res);
  if (n < st.p.length) {
    return {piece_outcome::partial, 0, {st.p.request, st.p.offset + n, st.p.data + n, st.p.length - n}};
  }
  return {};
}

// --- messages -------------------------------------------------------------------------------
// Built by appending: GCC 12 warns falsely (-Wrestrict) on "literal" + string.

[[nodiscard]] inline std::string timed_out_hint(std::chrono::milliseconds timeout)
{
  return std::string("no answer within ")
    .append(describe_timeout(timeout))
    .append(" (engine_options::timeout); cancelled");
}

[[nodiscard]] inline std::string hung_hint(std::chrono::milliseconds timeout, bool write)
{
  return std::string("no answer within ")
    .append(describe_timeout(timeout))
    .append(" (engine_options::timeout), and its cancellation was not confirmed: the kernel may still ")
    .append(write ? "read this write's" : "write into this read's")
    .append(" buffer, so this engine keeps it (held()) and is unusable; make a new one");
}

[[nodiscard]] inline broken_state hung_state(std::chrono::milliseconds timeout, request const& r, piece const& p)
{
  return {ETIMEDOUT, path_of(r), r.write ? "write" : "read", p.offset, p.length,
          std::string("this engine is unusable: this ")
            .append(r.write ? "write" : "read")
            .append(" got no answer within ")
            .append(describe_timeout(timeout))
            .append(" (engine_options::timeout) and its cancellation was not confirmed, so the kernel may "
                    "still use its buffer (held()); make a new engine")};
}

[[nodiscard]] inline broken_state stuck_state(ring_failure const& f)
{
  return {f.error, "the io_uring", f.operation, 0, 0,
          "a ring failed and could not be drained: the kernel may still use the buffers of its unfinished "
          "I/O (held()); this engine can no longer transfer; make a new one"};
}

/// "the io_uring failed with this read unfinished"
[[nodiscard]] inline std::string unfinished_hint(request const& r)
{
  return std::string("the io_uring failed with this ").append(r.write ? "write" : "read").append(" unfinished");
}

}  // namespace tierstate::io::detail
