// SPDX-License-Identifier: Apache-2.0
// What a step reports: step_stats (bytes moved, chunks, seconds) and step_result.
#pragma once

#include <tierstate/core/config.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>

namespace tierstate::inline TIERSTATE_ABI {

/// What one step did and cost.
struct step_stats {
  std::uint64_t tier_bytes_read    = 0;  ///< state bytes read from the state tier
  std::uint64_t tier_bytes_written = 0;  ///< state bytes written to the state tier
  std::uint64_t tier_bytes_in_place = 0;  ///< state bytes updated in place in an addressable tier
  std::uint64_t h2d_bytes           = 0;  ///< bytes copied host to device (params, or state)
  std::uint64_t d2h_bytes           = 0;  ///< bytes copied device to host (gradients, or state)
  std::size_t chunks                = 0;
  double check_seconds   = 0;  ///< looking for non-finite gradients
  double compute_seconds = 0;  ///< running the rule
  double wait_seconds    = 0;  ///< waiting for the tier's reads and writes, and for copies
  double grad_wait_seconds = 0;  ///< a streaming step: waiting for gradients to arrive
  double total_seconds   = 0;
};

struct step_result {
  bool found_nonfinite = false;  ///< a gradient held an infinity or NaN (when checked)
  bool skipped         = false;  ///< the step was skipped for it (nonfinite_policy::skip_step)
  bool deferred        = false;  ///< delayed_update: the update was started, not finished; stats
                                 ///< are those of the previous step's update
  std::int64_t step    = 0;      ///< the step count after this call
  double grad_norm     = 0;      ///< with max_grad_norm: the unscaled gradients' 2-norm, before clipping
  step_stats stats;
};

namespace detail {

/// Seconds from t0 to now, for a step's stats.
inline double seconds_since(std::chrono::steady_clock::time_point t0) noexcept
{
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace detail
}  // namespace tierstate
