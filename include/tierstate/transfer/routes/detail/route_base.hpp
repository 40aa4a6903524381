// SPDX-License-Identifier: Apache-2.0
// What every route holds for one step: the optimizer whose chunks it moves, the step's
// gradients and coefficients, the stats it counts into, and the flag it sets once a chunk's
// params and state start to change (the optimizer calls its state lost if the step then fails).
#pragma once

#include <tierstate/core/stats.hpp>
#include <tierstate/core/tensor.hpp>

#include <algorithm>
#include <cstddef>
#include <span>
#include <vector>

namespace tierstate::inline TIERSTATE_ABI::routes::detail {

template <class Optimizer>
class route_base {
 public:
  using grad_type    = typename Optimizer::grad_type;
  using grads_type   = std::span<grad_view<grad_type> const>;
  using coefficients = std::vector<typename Optimizer::rule_type::coefficients>;

  route_base(Optimizer& o, grads_type grads, coefficients const& c, step_stats& stats, bool& changed)
    : o_(o), grads_(grads), coefficients_(c), stats_(stats), changed_(changed)
  {
  }

  [[nodiscard]] std::size_t chunks() const noexcept { return o_.store_.layout().chunk_count(); }

 protected:
  Optimizer& o_;
  grads_type grads_;
  coefficients const& coefficients_;
  step_stats& stats_;
  bool& changed_;
};

/// Elements per unit of the host threads' work on a chunk: the compute's grain, and whole
/// codec blocks (both powers of two), so no block is split between two threads.
template <class Optimizer>
inline constexpr std::size_t host_grain = std::max<std::size_t>(Optimizer::compute_type::grain, Optimizer::state_block);

}  // namespace tierstate::routes::detail
