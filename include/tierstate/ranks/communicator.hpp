// SPDX-License-Identifier: Apache-2.0
// What ranks::sharded (ranks/sharded.hpp) needs from a communication library: the handful of
// collectives around a sharded step, over memory the library reaches (host memory for MPI,
// device memory for NCCL). ranks/mpi.hpp and ranks/nccl.hpp are two; a trainer with its own
// transport (a torch ProcessGroup, UCC, a test's threads) writes a third. No header here
// includes a communication library: only the one a user includes does.
//
// Each call is a collective: every rank of the communicator makes the same calls in the
// same order, with the same counts; a call returns once this rank's part is done.
#pragma once

#include <tierstate/core/config.hpp>
#include <tierstate/core/error.hpp>
#include <tierstate/core/numeric.hpp>
#include <tierstate/core/tensor.hpp>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace tierstate::inline TIERSTATE_ABI::ranks {

/// A step (or a save or a load) refused on this rank because another failed: every rank
/// throws, none hangs. The failing rank throws its own error; the others this, naming it.
class rank_failed : public std::runtime_error {
 public:
  rank_failed(std::vector<std::size_t> failed, std::string const& what)
    : std::runtime_error(what), failed_(std::move(failed))
  {
  }
  /// The ranks that failed, ascending.
  [[nodiscard]] std::vector<std::size_t> const& failed_ranks() const noexcept { return failed_; }

 private:
  std::vector<std::size_t> failed_;
};

/// The collectives a sharded step makes, for gradients and params of type T (float, double,
/// bf16 or fp16) in the communicator's memory (memory_of<C>(): host words stay host words).
///   rank(), size()             this rank and the rank count
///   max(words)                 all-reduce, element-wise maximum, of host words, in place
///   gather(mine, all)          all-gather of one host word per rank: all[r] is rank r's
///   gather(mine, all, counts)  all-gather of host doubles, counts[r] from rank r, in rank
///                              order (MPI_Allgatherv)
///   reduce_scatter(send, mine, counts)
///                              the element-wise sum over ranks of `send` (counts' sum
///                              elements), rank r receiving counts[r] of them in rank order
///                              into `mine` (its counts[rank()]): MPI_Reduce_scatter
///   all_gather(buffer, counts) in place: rank r's counts[r] elements sit in `buffer` after
///                              ranks 0..r-1's; each rank receives every other's
/// Element counts may exceed 2^31: an implementation over 32-bit counts splits the call.
template <class C, class T>
concept communicator_for = requires(C& c, std::span<std::uint64_t> words, std::uint64_t word,
                                    std::span<double const> doubles, std::span<double> all,
                                    std::span<std::size_t const> counts, std::span<T const> send,
                                    std::span<T> mine, T* buffer) {
  { c.rank() } -> std::convertible_to<std::size_t>;
  { c.size() } -> std::convertible_to<std::size_t>;
  c.max(words);
  c.gather(word, words);
  c.gather(doubles, all, counts);
  c.reduce_scatter(send, mine, counts);
  c.all_gather(buffer, counts);
};

/// Where a communicator's gradients and params are: its `memory` (location::device for NCCL),
/// else host memory.
template <class C>
[[nodiscard]] consteval location memory_of() noexcept
{
  if constexpr (requires { C::memory; }) {
    return C::memory;
  } else {
    return location::host;
  }
}

namespace detail {

/// The parts, appended: GCC 12 warns falsely (-Wrestrict, bug 105329) on "literal" + string&&.
template <class... Parts>
[[nodiscard]] std::string cat(Parts const&... parts)
{
  std::string s;
  (s.append(std::string_view(parts)), ...);
  return s;
}

/// What a rank says in a status word: 0 when it is well, else its rank + 1 (so that max()
/// names the highest rank that failed).
[[nodiscard]] constexpr std::uint64_t failure_word(std::size_t rank) noexcept { return rank + 1; }

/// The ranks whose gathered status words say they failed.
[[nodiscard]] inline std::vector<std::size_t> failed_in(std::span<std::uint64_t const> words)
{
  std::vector<std::size_t> out;
  for (std::size_t r = 0; r < words.size(); ++r) {
    if (words[r] != 0) { out.push_back(r); }
  }
  return out;
}

/// "rank 1", "ranks 0 and 2", "ranks 0, 1 and 3".
[[nodiscard]] inline std::string rank_list(std::span<std::size_t const> ranks)
{
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    if (i > 0) { s += i + 1 == ranks.size() ? " and " : ", "; }
    s += std::to_string(ranks[i]);
  }
  return s;
}

}  // namespace detail
}  // namespace tierstate::ranks
