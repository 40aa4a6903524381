// SPDX-License-Identifier: Apache-2.0
// A step's checks and clipping (step/checks.hpp does the looking): non-finite gradients
// skip the step or are reported, and the gradient norm folds a clipping factor into the
// coefficients.
#pragma once

namespace tierstate::inline TIERSTATE_ABI {

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
bool OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::check_and_clip(
    std::span<grad_view<grad_type> const> grads, double grad_scale,
                                         std::vector<coefficients_type>& coefficients,
                                         step_result& result, std::optional<bool> host_found)
{
  auto const t0 = std::chrono::steady_clock::now();
  if (opts_.on_nonfinite != nonfinite_policy::ignore) {
    result.found_nonfinite = host_found.value_or(false) || streaming_.kept_nonfinite() ||
                             checks::find_nonfinite(grads, store_.layout(), pool_, store_.device_if_any(),
                                                    host_found.has_value());
    if (opts_.ranks.any_nonfinite) {  // every rank takes the same decision
      result.found_nonfinite = opts_.ranks.any_nonfinite(result.found_nonfinite);
    }
    if (result.found_nonfinite && opts_.on_nonfinite == nonfinite_policy::skip_step) {
      result.stats.check_seconds = detail::seconds_since(t0);
      return false;
    }
  }
  if (opts_.max_grad_norm > 0.0) {
    // torch.nn.utils.clip_grad_norm_: the norm of the unscaled gradients, and a factor
    // max_norm / (norm + 1e-6) when that is below 1, folded into the gradient's multiplier.
    if (opts_.ranks.norm) {  // every rank's gradients' norm
      auto const sums  = checks::gradient_block_sums(grads, pool_, store_.device_if_any(), streaming_.kept_sums());
      result.grad_norm = opts_.ranks.norm(std::span<double const>(sums)) / grad_scale;
    } else {
      result.grad_norm = checks::gradient_norm(grads, pool_, store_.device_if_any(), streaming_.kept_sums()) / grad_scale;
    }
    double const clip  = opts_.max_grad_norm / (result.grad_norm + 1e-6);
    if (!std::isfinite(result.grad_norm)) {
      // An inf or NaN the step goes on with (report, ignore): as clip_grad_norm_ without
      // error_if_nonfinite, a factor of 0 for an inf norm (an inf element then gives NaN), NaN
      // for a NaN one. (No scale expresses these: grad_scale must be finite.)
      for (auto& c : coefficients) {
        if constexpr (requires { c.grad_mul *= 1.0f; }) {
          c.grad_mul *= static_cast<float>(clip);
        } else {
          throw logic_error("max_grad_norm: the gradient norm is " + std::to_string(result.grad_norm) +
                            ", and rule " + std::string(rule_type::name) + "'s coefficients have no grad_mul to clip by");
        }
      }
    } else if (clip < 1.0) {
      coefficients = coefficients_for(grad_scale / clip);
    }
  }
  result.stats.check_seconds = detail::seconds_since(t0);
  return true;
}

}  // namespace tierstate
