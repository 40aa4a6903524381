// SPDX-License-Identifier: Apache-2.0
// fault_plan: planted I/O faults, for tests of what happens when a disk misbehaves.
//
// An engine given a fault_plan (engine_options::faults) asks it about every piece it is about
// to submit. Pieces are counted per operation, from 1, in submission order: the k-th read
// piece and the k-th write piece of the engine's lifetime (a requeued remainder counts as a
// new piece). A planted fault then either
//   - fails the piece with an errno, as the kernel would (EIO, ENOSPC, ...): nothing is
//     transferred; or
//   - shortens it to `short_bytes` (rounded down to 4 KiB, at least 0): the kernel really
//     performs the shorter transfer, and the engine must requeue the rest, as it does for a
//     short transfer the device makes.
//
//   auto plan = std::make_shared<io::fault_plan>();
//   plan->fail(io::op::write, 3, EIO);          // the third write piece fails with EIO
//   plan->shorten(io::op::read, 1, 4096);       // the first read piece moves only 4 KiB
//
// Thread safety: every member may be called from any thread.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

namespace tierstate::io {

enum class op : std::uint8_t { read, write };

class fault_plan {
 public:
  /// What the engine does with one piece.
  struct decision {
    int error          = 0;   ///< nonzero: fail the piece with this errno
    std::size_t length = 0;   ///< bytes to submit (the piece's own length when nothing is planted)
  };

  /// The `nth` piece of `o` (counting from 1) fails with `error`.
  void fail(op o, std::uint64_t nth, int error)
  {
    std::scoped_lock lock(mutex_);
    planted_.push_back({o, nth, error, 0, false});
  }
  /// Every piece of `o` from the `nth` on fails with `error` (a device that has died).
  void fail_from(op o, std::uint64_t nth, int error)
  {
    std::scoped_lock lock(mutex_);
    planted_.push_back({o, nth, error, 0, true});
  }
  /// The `nth` piece of `o` transfers only `bytes` (rounded down to 4 KiB).
  void shorten(op o, std::uint64_t nth, std::size_t bytes)
  {
    std::scoped_lock lock(mutex_);
    planted_.push_back({o, nth, 0, bytes / 4096 * 4096, false});
  }
  /// Forgets every planted fault (the counts go on).
  void clear()
  {
    std::scoped_lock lock(mutex_);
    planted_.clear();
  }

  /// Pieces seen so far: to find how many I/O positions an operation has.
  [[nodiscard]] std::uint64_t seen(op o) const noexcept { return count_[index(o)].load(); }
  /// Faults applied so far.
  [[nodiscard]] std::uint64_t applied() const noexcept { return applied_.load(); }

  /// Called by engines, once per piece about to be submitted.
  decision next(op o, std::size_t length)
  {
    std::uint64_t const n = ++count_[index(o)];
    std::scoped_lock lock(mutex_);
    for (auto const& f : planted_) {
      if (f.o != o || (f.from ? n < f.nth : n != f.nth)) { continue; }
      ++applied_;
      if (f.error != 0) { return {f.error, 0}; }
      return {0, f.short_bytes < length ? f.short_bytes : length};
    }
    return {0, length};
  }

 private:
  struct planted {
    op o;
    std::uint64_t nth;
    int error;
    std::size_t short_bytes;
    bool from;
  };
  static constexpr std::size_t index(op o) noexcept { return o == op::read ? 0 : 1; }

  std::mutex mutex_;
  std::vector<planted> planted_;
  std::atomic<std::uint64_t> count_[2]{};
  std::atomic<std::uint64_t> applied_{0};
};

}  // namespace tierstate::io
