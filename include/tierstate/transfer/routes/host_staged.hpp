// SPDX-License-Identifier: Apache-2.0
// The host-staged route: state in a tier that is not addressable (NvmeFile, a user's),
// compute on the host, params and gradients in host memory. A chunk's state is read from the
// tier into a staging buffer, updated there by the thread pool, and written back; with a
// transfer of depth > 0 the reads and writes go through the optimizer's I/O thread.
//
// The legs are those of transfer/concept.hpp. The route holds no state of its own beyond one
// step: the optimizer makes one per step and hands it to Transfer::schedule.
#pragma once

#include <tierstate/optimizer.hpp>  // step_stats; it includes this file after the optimizer

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace tierstate::inline TIERSTATE_ABI::routes {

template <class Optimizer>
class host_staged {
  using grad_type    = typename Optimizer::grad_type;
  using coefficients = std::vector<typename Optimizer::rule_type::coefficients>;
  using clock        = std::chrono::steady_clock;
  /// The reads and writes go through the I/O thread (materialize makes it for such transfers).
  static constexpr bool threaded = Optimizer::transfer_type::depth > 0;

 public:
  /// One step's route: `changed` becomes true once a chunk's params and state start to
  /// change (the optimizer then calls its state lost if the step fails).
  host_staged(Optimizer& o, std::span<grad_view<grad_type> const> grads, coefficients const& c,
              step_stats& stats, bool& changed)
    : o_(o), grads_(grads), coefficients_(c), stats_(stats), changed_(changed),
      bytes_(o.layout_->chunk_bytes())
  {
    if constexpr (threaded) { tickets_.resize(o.layout_->chunk_count()); }
  }

  [[nodiscard]] std::size_t chunks() const noexcept { return o_.layout_->chunk_count(); }

  void fetch(std::size_t j, unsigned b)
  {
    std::size_t const offset = o_.chunk_at(j) * bytes_;
    if constexpr (threaded) {
      tickets_[j] = o_.io_->enqueue({offset, o_.staging(b), bytes_, false}, b);
    } else {
      auto const t0 = clock::now();
      o_.tier_->read(offset, std::span<std::byte>(o_.staging(b), bytes_));
      stats_.wait_seconds += seconds_since(t0);
    }
    stats_.tier_bytes_read += bytes_;
  }

  void compute(std::size_t j, unsigned b)
  {
    std::size_t const k = o_.chunk_at(j);
    if constexpr (threaded) {
      auto const t0 = clock::now();
      o_.io_->wait(tickets_[j]);
      stats_.wait_seconds += seconds_since(t0);
    }
    o_.await_chunk(k, stats_);
    changed_ = true;
    std::byte* const chunk = o_.staging(b);
    auto const t0          = clock::now();
    o_.pool_.parallel_for(o_.layout_->chunk_size(k), 64 * host::batch_size<typename Optimizer::arch>,
                          [&](std::size_t begin, std::size_t end) {
                            o_.update_chunk_range(k, chunk, begin, end, grads_, coefficients_);
                          });
    stats_.compute_seconds += seconds_since(t0);
  }

  void retire(std::size_t j, unsigned b)
  {
    std::size_t const offset = o_.chunk_at(j) * bytes_;
    if constexpr (threaded) {
      o_.io_->enqueue({offset, o_.staging(b), bytes_, true}, b);
    } else {
      auto const t0 = clock::now();
      o_.tier_->write(offset, std::span<std::byte const>(o_.staging(b), bytes_));
      stats_.wait_seconds += seconds_since(t0);
    }
    stats_.tier_bytes_written += bytes_;
    ++stats_.chunks;
  }

  void finish()
  {
    if constexpr (threaded) {
      auto const t0 = clock::now();
      o_.io_->wait_all();  // every write, not only the last one queued: they finish out of order
      stats_.wait_seconds += seconds_since(t0);
    }
  }

  /// After a leg threw: no staging buffer is left in the tier's hands.
  void abandon()
  {
    if constexpr (threaded) { o_.io_->drain(); }
  }

 private:
  static double seconds_since(clock::time_point t0) noexcept
  {
    return std::chrono::duration<double>(clock::now() - t0).count();
  }

  Optimizer& o_;
  std::span<grad_view<grad_type> const> grads_;
  coefficients const& coefficients_;
  step_stats& stats_;
  bool& changed_;
  std::size_t bytes_;
  std::vector<std::uint64_t> tickets_;  ///< the j-th fetch's read, when threaded
};

}  // namespace tierstate::routes
