// SPDX-License-Identifier: Apache-2.0
// The legs every staged route shares: a chunk's state read from its tier into a staging
// buffer, and written back from one. With a transfer of depth > 0 they go through the
// state store's I/O thread (state/store.hpp), otherwise they run in the step's thread.
// The bytes are counted in the step's stats; the time a leg waits, in wait_seconds.
#pragma once

#include <tierstate/core/stats.hpp>
#include <tierstate/core/trace.hpp>
#include <tierstate/tiers/tier.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace tierstate::inline TIERSTATE_ABI::routes::detail {

template <class Optimizer>
class tier_io {
 public:
  /// The reads and writes go through the I/O thread: the state store makes one where the
  /// placement says so (a tier that is not addressable, under a transfer of depth > 0). For
  /// any other tier waiting and draining do nothing (and the routes read and write nothing).
  static constexpr bool threaded = Optimizer::placement::io_thread;

  tier_io(Optimizer& o, step_stats& stats) : o_(o), stats_(stats), bytes_(o.store_.layout().chunk_bytes())
  {
    if constexpr (threaded) { tickets_.resize(o.store_.layout().chunk_count()); }
  }

  /// Starts (threaded) or does the read of the j-th chunk into `to`, staging buffer b.
  void read(std::size_t j, std::byte* to, unsigned b)
  {
    std::size_t const k      = o_.chunk_at(j);
    std::size_t const offset = o_.store_.chunk_offset(k);
    if constexpr (threaded) {
      tickets_[j] = o_.store_.io().enqueue({offset, to, bytes_, false}, b, o_.tracer_, static_cast<std::int64_t>(k));
    } else {
      auto const t0 = std::chrono::steady_clock::now();
      o_.store_.tier().read(offset, std::span<std::byte>(to, bytes_));
      auto const t1 = std::chrono::steady_clock::now();
      stats_.wait_seconds += std::chrono::duration<double>(t1 - t0).count();
      if (auto* t = tierstate::detail::traced(o_.tracer_)) [[unlikely]] {
        t->record(trace_phase::read, static_cast<std::int64_t>(k), bytes_, t0, t1);
      }
    }
    stats_.tier_bytes_read += bytes_;
  }

  /// Blocks until the j-th chunk's read has landed.
  void wait_read(std::size_t j)
  {
    if constexpr (threaded) {
      auto const t0 = std::chrono::steady_clock::now();
      o_.store_.io().wait(tickets_[j]);
      auto const t1 = std::chrono::steady_clock::now();
      stats_.wait_seconds += std::chrono::duration<double>(t1 - t0).count();
      if (auto* t = tierstate::detail::traced(o_.tracer_)) [[unlikely]] {
        t->record(trace_phase::read_wait, static_cast<std::int64_t>(o_.chunk_at(j)), 0, t0, t1);
      }
    }
  }

  /// Starts (threaded) or does the write of the j-th chunk from `from`, staging buffer b.
  /// (A shadowed store's step writes to the chunk's spare place: state/store.hpp.)
  void write(std::size_t j, std::byte* from, unsigned b)
  {
    std::size_t const k      = o_.chunk_at(j);
    std::size_t const offset = o_.store_.write_offset(k);
    if constexpr (threaded) {
      o_.store_.io().enqueue({offset, from, bytes_, true}, b, o_.tracer_, static_cast<std::int64_t>(k));
    } else {
      auto const t0 = std::chrono::steady_clock::now();
      o_.store_.tier().write(offset, std::span<std::byte const>(from, bytes_));
      auto const t1 = std::chrono::steady_clock::now();
      stats_.wait_seconds += std::chrono::duration<double>(t1 - t0).count();
      if (auto* t = tierstate::detail::traced(o_.tracer_)) [[unlikely]] {
        t->record(trace_phase::write, static_cast<std::int64_t>(k), bytes_, t0, t1);
      }
    }
    stats_.tier_bytes_written += bytes_;
  }

  /// Blocks until every write has landed (they finish out of order). Not timed here.
  void wait_all()
  {
    if constexpr (threaded) { o_.store_.io().wait_all(); }
  }

  /// After a leg threw: no staging buffer is left in the tier's hands.
  void drain()
  {
    if constexpr (threaded) { o_.store_.io().drain(); }
  }

 private:
  Optimizer& o_;
  step_stats& stats_;
  std::size_t bytes_;
  std::vector<std::uint64_t> tickets_;  ///< the j-th read's, when threaded
};

}  // namespace tierstate::routes::detail
