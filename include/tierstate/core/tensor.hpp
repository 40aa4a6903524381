// SPDX-License-Identifier: Apache-2.0
// Where memory lives, and the views the optimizer's API takes.
#pragma once

#include <tierstate/core/config.hpp>

#include <cstddef>
#include <cstdint>
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

/// A tensor as add_tensor takes it and a rule's tensor phase sees it: `rows` x `columns`, row-major (the columns
/// are its last dimension; a tensor registered without a shape is one row).
struct tensor_shape {
  std::size_t rows    = 1;
  std::size_t columns = 0;
  [[nodiscard]] constexpr std::size_t elements() const noexcept { return rows * columns; }
  friend constexpr bool operator==(tensor_shape, tensor_shape) noexcept = default;
};

/// A gradient handed to step(): pointer, element count and where it lives.
template <class T>
struct grad_view {
  T const* data      = nullptr;
  std::size_t size   = 0;
  location where     = location::host;
};

}  // namespace tierstate
