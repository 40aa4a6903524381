// SPDX-License-Identifier: Apache-2.0
// The io_uring backend's batches (see io/uring_engine.hpp): the stream (uring_stream.hpp) run
// to completion. The pieces are dealt out round-robin to the rings, and each ring's share is
// a stream of its own, one request per piece (so an error names its piece), driven by a
// thread of its own under batch_policy. A ring that fails withdraws and fails only its own
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
  std::mutex m;
  std::exception_ptr failure;  // the first; but a ring that broke the engine says why
  pool.parallel_for(used, 1, [&](std::size_t b, std::size_t e) {
    for (std::size_t i = b; i < e; ++i) {
      ring_damage damage;
      uring_stream s(c, {&c.rings_[i], 1}, damage, batch_policy);
      std::size_t next = 0;
      for (auto const& r : requests) {
        for_each_piece(r, 0, block, [&](piece const& p) {
          std::size_t const k = next++;
          if (k % used == i) { s.start({r.fd, p.offset, p.data, p.length, r.write, r.path}, k); }
        });
      }
      while (s.active() > 0) {
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
