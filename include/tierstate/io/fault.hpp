// SPDX-License-Identifier: Apache-2.0
// fault_plan: planted I/O faults, for tests of what happens when a disk misbehaves.
//
// An engine given a fault_plan (engine_options::faults) asks it about every piece it is about
// to submit. Pieces are counted per operation, from 1, in submission order: the k-th read
// piece and the k-th write piece of the engine's lifetime (a requeued remainder counts as a
// new piece). A planted fault then either
//   - fails the piece with an errno, as the kernel would (EIO, ENOSPC, ...): nothing is
//     transferred;
//   - shortens it to `short_bytes` (rounded down to 4 KiB, at least 0): the kernel really
//     performs the shorter transfer, and the engine must requeue the rest, as it does for a
//     short transfer the device makes; or
//   - hangs it: the piece is taken and never answers, as on a device that has stopped
//     responding. The engine submits, in its place, a read of the piece's length into the
//     piece's buffer from a pipe nobody writes to, so the kernel really holds the buffer and
//     only the engine's timeout (engine_options::timeout) ends the wait. A cancellable hang
//     is cancelled by the io_uring backend as any I/O still queued in the kernel is; an
//     uncancellable one stands for an I/O already at the device, which a cancellation does
//     not reach (the io_uring backend aims its cancellation at nothing, and the kernel
//     answers that it found nothing to cancel). The psync backend can never cancel: for it
//     every hang is uncancellable. Nothing is ever written into the pipe, so nothing lands
//     in a hung piece's buffer; release_hangs() ends every hang at once (end of file: the
//     piece completes having moved nothing), as a device that answers at last.
//
//   auto plan = std::make_shared<io::fault_plan>();
//   plan->fail(io::op::write, 3, EIO);          // the third write piece fails with EIO
//   plan->shorten(io::op::read, 1, 4096);       // the first read piece moves only 4 KiB
//   plan->hang(io::op::read, 2);                // the second read piece never answers
//
// It also fails the io_uring backend's ring calls themselves (fail_ring): io_uring_submit, or
// the wait for a completion, returns an errno without entering the kernel, as a failing or a
// dead ring's calls do. Pieces and ring calls are counted apart.
//
//   plan->fail_ring(io::ring_call::submit, EIO);                        // the next submit
//   plan->fail_ring(io::ring_call::wait, EBADF, io::fault_plan::forever);  // a dead ring
//
// Thread safety: every member may be called from any thread.
#pragma once

#include <tierstate/core/config.hpp>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <system_error>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

namespace tierstate::inline TIERSTATE_ABI::io {

enum class op : std::uint8_t { read, write };

/// The io_uring backend's ring calls a fault_plan can fail: io_uring_submit (and, batched,
/// io_uring_submit_and_wait), and the wait for a completion.
enum class ring_call : std::uint8_t { submit, wait };

class fault_plan {
 public:
  /// What the engine does with one piece.
  struct decision {
    int error          = 0;   ///< nonzero: fail the piece with this errno
    std::size_t length = 0;   ///< bytes to submit (the piece's own length when nothing is planted)
    /// For a hang: read `length` bytes from this descriptor (a pipe nobody writes to) into
    /// the piece's buffer instead of transferring it; -1 otherwise.
    int hang_fd = -1;
    /// For a hang: whether a cancellation reaches it (see the file comment).
    bool cancellable = true;
    /// For a hang: keeps hang_fd open; hold it while the piece may be in the kernel's hands.
    std::shared_ptr<void const> hold;

    /// Nothing planted: the piece as it is.
    [[nodiscard]] static decision as_is(std::size_t length)
    {
      decision d;
      d.length = length;
      return d;
    }
  };

  fault_plan() = default;
  fault_plan(fault_plan const&)            = delete;
  fault_plan& operator=(fault_plan const&) = delete;
  ~fault_plan() { release_hangs(); }

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
  /// The `nth` piece of `o` is taken and never answers (see the file comment). Throws
  /// std::system_error when the pipe cannot be made.
  void hang(op o, std::uint64_t nth, bool cancellable = true)
  {
    std::scoped_lock lock(mutex_);
    if (write_end_ < 0) {  // the first hang, or the first since release_hangs()
      int p[2];
      if (::pipe2(p, O_CLOEXEC) != 0) { throw std::system_error(errno, std::generic_category(), "fault_plan::hang: pipe2"); }
      pipe_      = std::make_shared<read_end>(p[0]);
      write_end_ = p[1];
    }
    planted_.push_back({o, nth, 0, 0, false, true, cancellable});
  }
  /// Ends every hang planted so far: their pieces complete, having moved nothing (end of
  /// file), and so do hung pieces reached later, until hang() is called again (it makes a
  /// new pipe, for every hang not yet reached). Also
  /// done when the plan is destroyed; an engine thread stuck in a planted hang keeps the plan
  /// alive, so a test that leaves one behind calls this to let it go.
  void release_hangs() noexcept
  {
    std::scoped_lock lock(mutex_);
    if (write_end_ >= 0) { ::close(std::exchange(write_end_, -1)); }
  }
  /// fail_ring's `times` for a ring that has died: every call from then on fails.
  static constexpr unsigned forever = ~0u;

  /// The next `times` calls of `call` (streamed or batched, on any of the engine's rings)
  /// return -`error` without entering the kernel; what they would have submitted is left
  /// prepared in the ring, not taken. Replaces what was planted for `call` before;
  /// fail_ring(call, 0, 0) plants nothing. Only the io_uring backend has rings: the psync
  /// backend never asks.
  void fail_ring(ring_call call, int error, unsigned times = 1) noexcept
  {
    auto& r = rings_[ring_index(call)];
    r.error.store(error, std::memory_order_relaxed);
    r.times.store(error != 0 ? times : 0, std::memory_order_release);
  }

  /// Forgets every planted fault, ring calls' included (the counts go on).
  void clear()
  {
    std::scoped_lock lock(mutex_);
    planted_.clear();
    fail_ring(ring_call::submit, 0, 0);
    fail_ring(ring_call::wait, 0, 0);
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
      decision d;
      if (f.error != 0) {
        d.error = f.error;
      } else if (f.hang) {
        d.length      = length;
        d.hang_fd     = pipe_->fd;
        d.cancellable = f.cancellable;
        d.hold        = pipe_;
      } else {
        d.length = f.short_bytes < length ? f.short_bytes : length;
      }
      return d;
    }
    return decision::as_is(length);
  }

  /// Called by the io_uring engine before each ring call: the errno fail_ring() planted for
  /// it (and one call fewer to fail), or 0.
  [[nodiscard]] int ring_failure(ring_call call) noexcept
  {
    auto& r    = rings_[ring_index(call)];
    unsigned t = r.times.load(std::memory_order_acquire);
    while (t != 0) {
      if (t == forever || r.times.compare_exchange_weak(t, t - 1, std::memory_order_acq_rel)) {
        return r.error.load(std::memory_order_relaxed);
      }
    }
    return 0;
  }

 private:
  struct planted {
    op o;
    std::uint64_t nth;
    int error;
    std::size_t short_bytes;
    bool from;
    bool hang        = false;
    bool cancellable = true;
  };
  /// The pipe's read end, closed when the last hung piece holding it lets go.
  struct read_end {
    int fd;
    explicit read_end(int f) : fd(f) {}
    read_end(read_end const&)            = delete;
    read_end& operator=(read_end const&) = delete;
    ~read_end() { ::close(fd); }
  };
  /// What fail_ring() planted for one ring call.
  struct ring_fault {
    std::atomic<int> error{0};
    std::atomic<unsigned> times{0};
  };
  static constexpr std::size_t index(op o) noexcept { return o == op::read ? 0 : 1; }
  static constexpr std::size_t ring_index(ring_call c) noexcept { return c == ring_call::submit ? 0 : 1; }

  std::mutex mutex_;
  std::vector<planted> planted_;
  std::shared_ptr<read_end> pipe_;  ///< for hangs; null until hang()
  int write_end_ = -1;              ///< never written to; closed by release_hangs()
  std::atomic<std::uint64_t> count_[2]{};
  std::atomic<std::uint64_t> applied_{0};
  ring_fault rings_[2];
};

}  // namespace tierstate::io
