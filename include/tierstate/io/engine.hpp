// SPDX-License-Identifier: Apache-2.0
// The I/O engine: batched reads and writes of large, aligned ranges of files.
//
// A batch of requests is cut into pieces of at most block_size bytes, kept queue_depth deep
// in flight, and run to completion. A short read or write is requeued for its remainder; a
// transfer that makes no progress (a read at the end of the file: state files are
// preallocated, so this means the file was cut short behind the library's back) fails
// instead of being retried forever. The first failure becomes a tierstate::io_error naming
// path, offset, length, operation and errno, thrown after every piece in flight has
// completed, so the kernel holds no buffer of the batch when submit() returns or throws
// (but see "A disk that never answers").
//
// A disk that never answers. A piece the kernel has held for engine_options::timeout
// (default 120 s; 0: no timeout) without an answer counts as hung:
//   - its request fails with an io_error ETIMEDOUT naming path, offset, length and
//     operation ("read" or "write"); no further piece of the batch (or, streaming, of that
//     request) is submitted; what the other pieces did stays done, as after any failure;
//   - the io_uring backend cancels it. Once the kernel confirms (the piece completes, as
//     -ECANCELED or with its result), the kernel holds none of its memory and the engine goes
//     on: the failure is an ordinary one (nothing changed, or the known part the other
//     pieces did), and the call may be retried;
//   - if the cancellation is not confirmed within cancel_grace() (the timeout, within
//     [100 ms, 1 s]), or the backend is psync (a pread cannot be cancelled), the kernel may
//     still write into the piece's buffer (a read) or read from it (a write), at any later
//     time, even after the engine is gone. The engine gives up on every piece in flight
//     (cancelled and waited for as long), fails every request, and is broken for good: every
//     later submit(), start() and register_buffer() throws an io_error with ETIMEDOUT saying
//     so; usable() is false, and held() lists the buffers the kernel may still use. Their
//     owners must neither free nor reuse them: leak them, rather than let a late transfer
//     land in memory that has been handed out again. A late write may still reach the file.
// A call that meets a hung piece returns within about timeout + cancel_grace() of that
// piece's submission. Cancellation is its own outcome inside the engine and never an error
// by itself: it is reported as the timeout that caused it.
//
// Two backends, chosen by the user, never silently:
//   io_uring  (the default) liburing rings; `rings` rings, each with its own thread during a
//             batch. Where io_uring is unavailable (ENOSYS: the kernel lacks it; EPERM: a
//             seccomp filter or kernel.io_uring_disabled forbids it) construction fails with
//             an io_error that says so and names the psync backend.
//   psync     pread/pwrite on queue_depth threads: slower, works everywhere.
//
// Thread safety: one thread at a time per engine.
#pragma once

#include <tierstate/io/psync_engine.hpp>
#include <tierstate/io/request.hpp>
#include <tierstate/io/uring_engine.hpp>

#include <cstdint>
#include <exception>
#include <optional>
#include <span>
#include <utility>
#include <vector>

namespace tierstate::inline TIERSTATE_ABI::io {

/// The backend the options name, behind one interface.
class engine {
 public:
  explicit engine(engine_options const& o = {})
  {
    o.validate();
    if (o.backend == backend::io_uring) {
      uring_.emplace(o);
    } else {
      psync_.emplace(o);
    }
  }

  [[nodiscard]] engine_options const& options() const noexcept
  {
    return uring_ ? uring_->options() : psync_->options();
  }

  /// Runs every request to completion (see the file comment).
  void submit(std::span<request const> requests)
  {
    if (uring_) {
      uring_->submit(requests);
    } else {
      psync_->submit(requests);
    }
  }

  /// Streaming (see io/uring_engine.hpp): start requests one at a time, and let progress()
  /// report each as it finishes. The psync backend runs what was started as one batch in
  /// progress().
  void start(request const& r, std::uint64_t tag)
  {
    if (uring_) {
      uring_->start(r, tag);
    } else {
      psync_->throw_if_broken();
      started_.push_back({r, tag});
    }
  }
  [[nodiscard]] std::size_t active() const noexcept { return uring_ ? uring_->active() : started_.size(); }
  template <class Done>
  void progress(bool wait, Done&& done)
  {
    if (uring_) {
      uring_->progress(wait, done);
      return;
    }
    if (started_.empty()) { return; }
    std::vector<request> batch;
    for (auto const& s : started_) { batch.push_back(s.first); }
    std::exception_ptr error;
    try {
      psync_->submit(batch);
    } catch (...) {
      error = std::current_exception();  // which request failed is not kept: all of them report it
    }
    auto const finished = std::exchange(started_, {});
    for (auto const& s : finished) { done(s.second, error); }
  }

  /// Registers [region] as a fixed buffer, so transfers inside it skip the per-I/O page
  /// pinning. Returns 0, or the errno that refused it (ENOMEM: RLIMIT_MEMLOCK is too small);
  /// transfers work either way. The psync backend has nothing to register and returns 0.
  /// Throws io_error once the engine is broken.
  int register_buffer(std::span<std::byte> region)
  {
    if (uring_) { return uring_->register_buffer(region); }
    psync_->throw_if_broken();
    return 0;
  }
  /// The region registered, or an empty span.
  [[nodiscard]] std::span<std::byte> registered() const noexcept
  {
    return uring_ ? uring_->registered() : std::span<std::byte>{};
  }

  /// False once the engine has given up on an I/O that did not answer (see the file
  /// comment): every later call throws.
  [[nodiscard]] bool usable() const noexcept { return uring_ ? uring_->usable() : psync_->usable(); }
  /// The buffers of the I/O a broken engine gave up on, which the kernel may still use: not
  /// to be freed or reused, ever. Empty while usable().
  [[nodiscard]] std::vector<std::span<std::byte>> held() const { return uring_ ? uring_->held() : psync_->held(); }

 private:
  std::optional<uring_engine> uring_;
  std::optional<psync_engine> psync_;
  std::vector<std::pair<request, std::uint64_t>> started_;  ///< psync's streamed requests
};

}  // namespace tierstate::io
