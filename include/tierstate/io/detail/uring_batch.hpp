// SPDX-License-Identifier: Apache-2.0
// The io_uring backend's batches (see io/uring_engine.hpp): the stream (uring_stream.hpp) run
// to completion. The pieces are dealt out round-robin to the rings, and each ring's share is
// a stream of its own, one request per piece (so an error names its piece), fed as it drains
// and driven by a thread of its own under batch_policy. A ring that fails ends only its own
// share; the others run theirs to the end. What each stream gave up on is merged into the
// engine's, and the first failure is thrown, once every ring has drained.
#pragma once

#include <tierstate/core/thread_pool.hpp>
#include <tierstate/io/detail/pieces.hpp>
#include <tierstate/io/detail/uring_core.hpp>
#include <tierstate/io/detail/uring_state.hpp>
#include <tierstate/io/detail/uring_stream.hpp>
#include <tierstate/io/request.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <mutex>
#include <span>
#include <utility>

namespace tierstate::inline TIERSTATE_ABI::io::detail {

/// One ring's share of a batch: of the pieces of `requests`, in order, every `used`-th,
/// starting at the `ring`-th.
class batch_share {
 public:
  batch_share(std::span<request const> requests, std::size_t block, std::size_t ring, std::size_t used) noexcept
    : requests_(requests), block_(block), used_(used)
  {
    skip(ring);
  }

  [[nodiscard]] bool done() const noexcept { return at_ == requests_.size(); }

  /// The next piece of the share, as a request of its own.
  request next() noexcept
  {
    auto const& r = requests_[at_];
    piece const p = piece_at(r, at_, done_, block_);
    skip(used_);
    return {r.fd, p.offset, p.data, p.length, r.write, r.path};
  }

 private:
  void skip(std::size_t pieces) noexcept
  {
    for (;;) {
      while (at_ < requests_.size() && done_ >= requests_[at_].length) {
        ++at_;
        done_ = 0;
      }
      if (pieces == 0 || done()) { return; }
      done_ += block_;
      --pieces;
    }
  }

  std::span<request const> requests_;
  std::size_t block_;
  std::size_t used_;
  std::size_t at_   = 0;  ///< the request the next piece is of
  std::size_t done_ = 0;  ///< where in it the next piece starts
};

/// Runs `requests` to completion over every ring of `c` (see io/uring_engine.hpp); throws
/// the first failure, once every ring has drained.
inline void run_batch(uring_core& c, thread_pool& pool, std::span<request const> requests)
{
  c.throw_if_broken();
  std::size_t const block = c.opts_.block_size;
  std::size_t pieces      = 0;
  for (auto const& r : requests) { pieces += (r.length + block - 1) / block; }
  if (pieces == 0) { return; }
  std::size_t const used = std::min<std::size_t>(c.rings_.size(), pieces);
  // Pieces started ahead of the ring: enough to refill every slot as it frees, few enough
  // that the stream's bookkeeping stays small and warm, whatever the batch's size.
  std::size_t const ahead = 2 * std::size_t{c.opts_.queue_depth};
  std::mutex m;
  std::exception_ptr failure;  // the first; but a ring that broke the engine says why
  pool.parallel_for(used, 1, [&](std::size_t b, std::size_t e) {
    for (std::size_t i = b; i < e; ++i) {
      ring_damage damage;
      uring_stream s(c, {&c.rings_[i], 1}, damage, batch_policy);
      batch_share todo(requests, block, i, used);
      for (;;) {
        while (!todo.done() && !s.stopped() && s.active() < ahead) { s.start(todo.next(), 0); }
        if (s.active() == 0) { break; }
        s.progress(true, [](std::uint64_t, std::exception_ptr const&) {});  // stop_error() says it
      }
      std::scoped_lock lock(m);
      bool const broke = damage.broken.error != 0 && c.usable();
      if (auto error = s.stop_error(); error && (broke || !failure)) { failure = std::move(error); }
      c.damage_.take(std::move(damage));
    }
  });
  if (failure) { std::rethrow_exception(failure); }
}

}  // namespace tierstate::io::detail
