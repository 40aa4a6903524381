// SPDX-License-Identifier: Apache-2.0
// The streaming step (begin_step, grad_ready, finish_step) over the streaming gate
// (step/streaming_gate.hpp), and what the routes ask of it: the chunk at each position of a
// step's order, and when it may go.
#pragma once

namespace tierstate::inline TIERSTATE_ABI {

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
std::size_t OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::chunk_at(std::size_t j) const noexcept
{
  return streaming_.chunk_at(j);
}

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::await_chunk(std::size_t k, step_stats& stats)
{
  streaming_.await(
    k, store_.pieces(k), stats,
    [this](std::span<grad_view<grad_type> const> views, double grad_scale,
           std::vector<coefficients_type>& coefficients, step_result& result, std::optional<bool> host_found) {
      if constexpr (keeps_grads_in_sources) {  // kept gradients written behind: a failure refuses the step here, unchanged
        for (std::size_t t = 0; t < tensors_.size(); ++t) {
          if (streaming_.stashed(t)) { tensors_[t].source->wait_grad(tensors_[t].source_tensor); }
        }
      }
      if (!check_and_clip(views, grad_scale, coefficients, result, host_found)) { return false; }
      reduce_tensors(views, coefficients);
      return true;
    },
    [this](grad_view<grad_type> const& g) -> std::optional<bool> {  // a gradient just handed over
      if (opts_.on_nonfinite == nonfinite_policy::ignore) { return std::nullopt; }
      return checks::host_nonfinite(g, pool_);
    },
    [dev = store_.device_if_any()](device::event& e) {  // the streams that read a device gradient wait for it
      if constexpr (placement::device_params) {
        dev->d2h.wait(e);
        dev->compute.wait(e);
      } else {
        (void)dev, (void)e;
      }
    });
}

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
bool OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::chunk_is_ready(std::size_t k)
{
  return streaming_.ready_now(k);
}

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::check_not_streaming(char const* call) const
{
  if (in_step()) {
    throw logic_error(std::string(call).append(": a streaming step is in progress (begin_step without finish_step)"));
  }
}

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::begin_step(double grad_scale, unsigned micro_batches)
{
  detail::gate_entry const gate(gate_, "begin_step");
  check_not_streaming("begin_step");
  if (opts_.delayed_update) {
    throw logic_error("begin_step: streaming steps and delayed_update do not combine (the delayed "
                      "update already runs during the next forward and backward): call step()");
  }
  store_.check_not_lost("begin_step");
  if (micro_batches == 0) { throw invalid_option("micro_batches", "0", "must be >= 1"); }
  if (tensors_.empty()) { throw logic_error("begin_step: no tensor is registered: add_tensor first"); }
  auto coefficients = coefficients_for(grad_scale);  // refused values change nothing
  detail::flush_sources(sources_);  // (as step(): an earlier param write's failure is a refusal)
  rounding_step_ = step_ + 1;
  materialize();
  std::vector<std::size_t> pending(store_.layout().chunk_count());
  for (std::size_t k = 0; k < pending.size(); ++k) { pending[k] = store_.pieces(k).size(); }
  // Clipping, a rule's tensor phase and the non-finite check need every gradient before the
  // first update; on a shadowed state the check does not (its update is kept only if the
  // check passes): it runs after the update (late).
  bool const looks  = opts_.on_nonfinite != nonfinite_policy::ignore;
  bool const checks = opts_.max_grad_norm > 0.0 || has_tensor_phase<rule_type> || (looks && !store_.shadowed());
  bool const late   = looks && store_.shadowed();
  if constexpr (keeps_grads_in_sources && placement::device_params) {  // the keeper's ring: two of the largest
    std::size_t largest = 0;
    for (std::size_t t = 0; t < tensors_.size(); ++t) { largest = std::max(largest, keeps_gradient(t) ? tensors_[t].count : 0); }
    keeper_.size_for(largest);
  }
  streaming_.begin(store_.layout(), std::move(pending), checks, late, micro_batches, grad_scale, std::move(coefficients),
                   [this] { drive_streaming_step(); });
}

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::grad_ready(tensor_id t, grad_view<grad_type> g, device::stream_view ready)
{
  if (t >= tensors_.size()) {
    throw logic_error("grad_ready: there is no tensor " + std::to_string(t) + " (" +
                      std::to_string(tensors_.size()) + " registered)");
  }
  auto const& e  = tensors_[t];
  auto const who = "grad_ready: the gradient of tensor " + std::to_string(t) + " ('" + e.name + "')";
  checks::check_view(who, g, e);
  // An offloaded tensor's final gradient goes to its source (ZeRO-3's order), looked at first
  // for what the checks need: the trainer's memory is free once this returns (host), or for
  // the work queued on `ready` next (device: copied down and kept behind, by the keeper).
  bool const stash = g.data != nullptr && keeps_gradient(t);
  using kept = typename decltype(streaming_)::kept;
  streaming_.hand_over(t, g, who, ready, stash, [&](grad_view<grad_type> const& v) -> std::optional<kept> {
    if constexpr (keeps_grads_in_sources) {
      auto keep = [this, t](std::span<grad_type const> h) {  // looked at for the checks, then to the source
        kept k;
        if (opts_.on_nonfinite != nonfinite_policy::ignore) { k.nonfinite = host::any_nonfinite(h.data(), h.size()); }
        if (opts_.max_grad_norm > 0.0) { k.sums = checks::block_sums(h.data(), h.size()); }
        tensors_[t].source->write_grad(tensors_[t].source_tensor, h);
        return k;
      };
      if constexpr (placement::device_params) {
        if (v.where == location::device) {  // copied down on `ready` and kept behind (step/grad_keeper.hpp)
          keeper_.submit(v.data, v.size, ready, [this, t, n = v.size, keep](std::span<grad_type const> h, std::exception_ptr failed) {
            try {
              if (failed) { std::rethrow_exception(failed); }
              streaming_.kept_behind(t, n, keep(h));
            } catch (...) {
              streaming_.keep_failed(t, std::current_exception());
            }
          });
          return std::nullopt;
        }
      }
      return keep({v.data, v.size});
    } else {
      return kept{};
    }
  });
}

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
bool OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::keeps_gradient(tensor_id t) const
{
  if constexpr (keeps_grads_in_sources) {
    return t < tensors_.size() && tensors_[t].source != nullptr && tensors_[t].source->keeps_grads();
  } else {
    (void)t;
    return false;
  }
}

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
step_result OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::finish_step()
{
  detail::gate_entry const gate(gate_, "finish_step");
  if (!in_step()) { throw logic_error("finish_step: no streaming step is in progress (call begin_step)"); }
  step_result r = streaming_.finish();
  io_watch_.observe(r.stats, StateTier::name);
  return r;
}

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::drive_streaming_step()
{
  detail::trace_scope const traced_step(tracer_, trace_phase::step);  // (from begin_step to the last write)
  auto& result = streaming_.result();
  try {
    // A shadowed state: the update goes to its spare places, kept if the step passes its
    // checks and completes (a step that fails part way is then refused with nothing changed).
    store_.begin_shadow();
    run_step(streaming_.views(), streaming_.coefficients(), result);
    if (streaming_.late() &&
        !streaming_.check_late([this](std::span<grad_view<grad_type> const> views, double grad_scale,
                                      std::vector<coefficients_type>& coefficients, step_result& r,
                                      std::optional<bool> looked) {
          return check_and_clip(views, grad_scale, coefficients, r, looked);
        })) {
      undo_shadowed_step(nullptr);
      throw detail::skip_step_signal{};
    }
    store_.commit_shadow();
    count_step(streaming_.views());
    result.step = step_;
  } catch (detail::skip_step_signal const&) {
    store_.abort_shadow();  // (skipped by checks that wait: before any update)
    result.skipped = true;
    result.step    = step_;
  } catch (...) {
    auto failure = std::current_exception();
    if (store_.shadowing()) {  // the state as it was: a refusal, unless the params cannot be restored
      try {
        undo_shadowed_step(failure);
      } catch (...) {  // (lost: undo_shadowed_step said why)
      }
    }
    streaming_.fail(std::move(failure));
  }
}

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::undo_shadowed_step(std::exception_ptr failure)
{
  // A shadowed step that will not be kept: its state is forgotten, and the params it wrote
  // (those of the tensors with a gradient) are written again from the master it left alone.
  // If that fails, the params are part updated: the state is lost.
  // Only tensors whose gradient was final can have been updated; backward may still be handing
  // over others (a step that failed part way).
  store_.abort_shadow();
  try {
    std::vector<char> const only = streaming_.final_with_gradient();
    step_stats ignored;
    for (std::size_t k = 0; k < store_.layout().chunk_count(); ++k) {
      store_.with_chunk(k, false, ignored, [&](std::byte const* chunk) { store_.params_from_master(k, chunk, tensors_, only); });
    }
    detail::flush_sources(sources_);
  } catch (...) {
    std::string what = "an exception that is not a std::exception";
    try {
      throw;
    } catch (std::exception const& e) {
      what = e.what();
    } catch (...) {
    }
    if (failure) {
      try {
        std::rethrow_exception(failure);
      } catch (std::exception const& f) {
        what = std::string(f.what()) + "; then restoring the params it had written failed: " + what;
      } catch (...) {
      }
    }
    store_.mark_lost(std::move(what));
    throw;
  }
}

}  // namespace tierstate
