// SPDX-License-Identifier: Apache-2.0
// The io_uring backend (see io/engine.hpp for the contract). Each of `rings` rings keeps
// up to queue_depth pieces in flight. Two ways in, one state machine behind both:
//   start() / progress() / active()
//               streaming: requests are started one at a time and finish one at a time, as
//               their last piece completes, while the rings stay full (the pipelined
//               transfer's I/O thread lives here, so the disk never idles between chunks);
//   submit()    a batch: that machine run to completion. The pieces are dealt out
//               round-robin to the rings; each ring's share is a stream of its own, one
//               request per piece, driven by a thread of its own, which starts no new piece
//               once one has failed and submits and waits in one call
//               (io_uring_submit_and_wait).
// Inside the rings results are -errno values; a failure leaves as an io_error, from submit()
// after every ring has drained (naming the failed piece), or handed to progress()'s callback
// for its request. Streaming and submit() are not mixed: submit() needs active() == 0.
//
// The parts, under io/detail/: uring_state.hpp (a ring's slots, a piece's outcome, what
// broke the engine and what it holds, the messages), uring_core.hpp (the rings: fill,
// submit, wait, reap), uring_cancel.hpp (timeouts, withdrawal, settling after a failure),
// uring_stream.hpp (the state machine: filling, reaping, timeouts, ring failures, giving up,
// and the policy a batch runs it under), uring_batch.hpp (a batch: dealing the pieces out,
// a thread per ring, and merging what each ring's stream ended with).
//
// When a ring itself fails (io_uring_submit, io_uring_submit_and_wait, or the wait for a
// completion, returns an error other than EINTR, EAGAIN or EBUSY), the pieces the kernel has
// not taken are withdrawn from the ring, never to be submitted (their requests are reported
// failed, so they must not run behind the caller's back), and every piece the kernel has
// taken is waited out and its result dropped. The stream that drives the ring then fails
// every request it has active with an io_error naming that call, its errno and the request.
// While streaming (one stream over every ring) each finishes so through its callback, and
// the streaming state is reset; in a batch (a stream per ring, a request per piece) submit()
// throws the ring's first failure, such an error naming an unfinished piece unless a piece
// had failed before, once the other rings have run their shares to the end. The engine goes
// on. A ring that cannot even be waited on leaves the engine broken (below).
//
// Timeouts (engine_options::timeout, see io/engine.hpp): a piece the kernel has held longer
// than the timeout is cancelled (IORING_OP_ASYNC_CANCEL). Its completion then arrives
// (-ECANCELED, or its result if it finished meanwhile) and its request fails with
// ETIMEDOUT; the engine goes on. If no completion arrives within cancel_grace() of the
// cancellation, the kernel may still write into the piece's buffer (or read from it) at any
// later time: the engine gives up on every piece in flight (cancelled too, and waited for as
// long), fails every request, and is broken.
//
// A broken engine never touches a ring again, except to close it when destroyed: start(),
// submit() and register_buffer() throw an io_error that names what broke it. held() lists
// the buffers of the pieces it gave up on: the kernel may use them until it answers, which
// may be never, and even after the engine is destroyed. Their owners must neither free nor
// reuse them (leak them); the engine keeps what it owns of them (a planted hang's pipe).
#pragma once

#include <tierstate/core/thread_pool.hpp>
#include <tierstate/io/detail/uring_batch.hpp>
#include <tierstate/io/detail/uring_core.hpp>
#include <tierstate/io/detail/uring_stream.hpp>
#include <tierstate/io/request.hpp>

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace tierstate::inline TIERSTATE_ABI::io {

class uring_engine {
 public:
  /// Throws tierstate::invalid_option for bad options, and io_error (operation
  /// "io_uring_queue_init") where io_uring is unavailable.
  explicit uring_engine(engine_options const& o = {}) : core_(o), pool_(o.rings), stream_(core_) {}
  uring_engine(uring_engine const&)            = delete;
  uring_engine& operator=(uring_engine const&) = delete;

  [[nodiscard]] engine_options const& options() const noexcept { return core_.options(); }

  /// Registers one region as fixed buffer 0 of every ring (replacing any earlier one).
  /// Returns 0 or the refusing errno (ENOMEM: over RLIMIT_MEMLOCK); on refusal nothing
  /// stays registered and transfers go on unregistered. Throws io_error on a broken engine
  /// (unregistering would wait for the I/O it gave up on).
  int register_buffer(std::span<std::byte> region) { return core_.register_buffer(region); }
  [[nodiscard]] std::span<std::byte> registered() const noexcept { return core_.registered(); }

  /// Whether the engine can still transfer (see the file comment).
  [[nodiscard]] bool usable() const noexcept { return core_.usable(); }
  /// The buffers of the I/O a broken engine gave up on: the kernel may still use them, now
  /// or after the engine is gone. Empty while the engine is usable.
  [[nodiscard]] std::vector<std::span<std::byte>> held() const { return core_.held(); }

  /// Runs a batch to completion (see io/engine.hpp and the file comment).
  void submit(std::span<request const> requests)
  {
    TIERSTATE_EXPECTS(stream_.active() == 0, "uring_engine::submit: streamed requests are still active");
    detail::run_batch(core_, pool_, requests);
  }

  // --- streaming ----------------------------------------------------------------------

  /// Queues `r` under `tag`; it is submitted by the next progress(). Throws io_error once
  /// the engine is broken (see the file comment).
  void start(request const& r, std::uint64_t tag) { stream_.start(r, tag); }

  /// Started requests that have not finished.
  [[nodiscard]] std::size_t active() const noexcept { return stream_.active(); }

  /// Fills the rings, then handles every completion there is, waiting for at least one when
  /// `wait` is set and a piece is in the kernel's hands (never past the moment the next
  /// piece would time out). Calls done(tag, error) once per request as it finishes: error is
  /// null, or an io_error (its first failed piece) as an exception_ptr. When a ring itself
  /// fails, or the engine gives up on an I/O that will not answer, every active request
  /// finishes with an io_error saying so and the streaming state is reset (see the file
  /// comment). Throws only what `done` throws.
  template <class Done>
  void progress(bool wait, Done&& done)
  {
    stream_.progress(wait, done);
  }

 private:
  detail::uring_core core_;  ///< the rings, what broke the engine, what it holds
  thread_pool pool_;         ///< a batch's ring threads
  detail::uring_stream stream_;  ///< over every ring: the streamed requests
};

}  // namespace tierstate::io
