// SPDX-License-Identifier: Apache-2.0
// Where memory lives, and the views the optimizer's API takes.
#pragma once

#include <tierstate/core/config.hpp>

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>

namespace tierstate::inline TIERSTATE_ABI {

/// Where a param or gradient array lives.
enum class location : std::uint8_t {
  host,    ///< memory the CPU addresses (pageable or pinned)
  device,  ///< CUDA device memory
};

[[nodiscard]] constexpr std::string_view location_name(location l) noexcept
{
  return l == location::host ? "host" : "device";
}

/// A tensor as add_tensor takes it and a rule's tensor phase sees it: `batches` matrices of
/// `rows` x `columns`, one after the other, row-major (the columns are its last dimension).
/// A tensor of rank >= 3 is its leading dimensions' product of matrices (torch's Adafactor
/// factors the last two dimensions); a vector (rank 0 or 1, and a tensor added by count) is
/// one row with `vector` set, which a rule may treat otherwise than a 1 x n matrix (torch's
/// Adafactor does). The tensor phase walks total_rows() rows; row r is in matrix r / rows.
struct tensor_shape {
  std::size_t rows    = 1;
  std::size_t columns = 0;
  std::size_t batches = 1;
  bool vector         = false;

  [[nodiscard]] constexpr std::size_t total_rows() const noexcept { return batches * rows; }
  [[nodiscard]] constexpr std::size_t elements() const noexcept { return batches * rows * columns; }
  friend constexpr bool operator==(tensor_shape, tensor_shape) noexcept = default;

  /// A vector of n elements (rank 1).
  [[nodiscard]] static constexpr tensor_shape of_vector(std::size_t n) noexcept { return {1, n, 1, true}; }
  /// A tensor by its dimensions, as torch's `p.shape` lists them: none or one is a vector;
  /// two a matrix; more, the product of the leading ones of matrices; none of its elements
  /// (a dimension of 0), a vector of 0. Refused (std::overflow_error, naming the dimensions)
  /// where the elements overflow a std::size_t.
  [[nodiscard]] static tensor_shape of(std::initializer_list<std::size_t> dims) { return of({dims.begin(), dims.size()}); }
  [[nodiscard]] static tensor_shape of(std::span<std::size_t const> dims)
  {
    std::size_t const rank = dims.size();
    if (rank <= 1) { return of_vector(rank == 0 ? 1 : dims[0]); }
    std::size_t total = 1, batches = 1;
    for (std::size_t d = 0; d < rank; ++d) {
      if (dims[d] != 0 && total > std::numeric_limits<std::size_t>::max() / dims[d]) {
        std::string text;
        for (std::size_t const x : dims) { text += (text.empty() ? "" : " x ") + std::to_string(x); }
        throw std::overflow_error("tensor_shape::of: a tensor of " + text + " has more elements than a std::size_t counts");
      }
      total *= dims[d];
      if (d + 2 < rank) { batches *= dims[d]; }
    }
    if (total == 0) { return of_vector(0); }
    return {dims[rank - 2], dims[rank - 1], batches, false};
  }
};

/// A gradient handed to step(): pointer, element count and where it lives.
template <class T>
struct grad_view {
  T const* data      = nullptr;
  std::size_t size   = 0;
  location where     = location::host;
};

}  // namespace tierstate
