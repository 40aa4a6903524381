// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>

namespace tierstate::inline TIERSTATE_ABI {
namespace detail {

inline double seconds_since(std::chrono::steady_clock::time_point t0) noexcept
{
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

/// Thrown inside a streaming step's driver when the checks say skip; never leaves it.
struct skip_step_signal {};

/// Sum of v in a fixed pairwise order (the halves of each range, recursively).
inline double pairwise_sum(double const* v, std::size_t n) noexcept
{
  if (n == 0) { return 0.0; }
  if (n == 1) { return v[0]; }
  std::size_t const h = n / 2;
  return pairwise_sum(v, h) + pairwise_sum(v + h, n - h);
}

}  // namespace detail

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::OffloadedOptimizer(
    hyperparameters const& defaults, options const& opts)
  : opts_(opts), pool_(opts.threads)
{
  Rule::validate(defaults);
  if (opts.chunk_elements == 0 || opts.chunk_elements % layout::element_granularity != 0) {
    throw invalid_option("chunk_elements", detail::to_text(opts.chunk_elements),
                         "must be a positive multiple of 2048, so every slot array of a chunk "
                         "is a whole number of 4 KiB blocks");
  }
  if (!(opts.max_grad_norm >= 0.0) || !std::isfinite(opts.max_grad_norm)) {
    throw invalid_option("max_grad_norm", detail::to_text(opts.max_grad_norm),
                         "must be finite and >= 0 (0: no clipping)");
  }
  if (on_device_ && opts.delayed_update) {
    throw invalid_option("delayed_update", "true",
                         "the delayed parameter update runs the update on the host: use OnHost compute");
  }
  if (on_device_ && opts.max_grad_norm > 0.0) {
    throw invalid_option("max_grad_norm", detail::to_text(opts.max_grad_norm),
                         "clipping with OnDevice compute is not supported yet (the norm would need a "
                         "device reduction); clip in the framework, or compute on the host");
  }
  if constexpr (preflight_tier<StateTier>) { StateTier::preflight(opts.tier); }
  groups_.push_back(defaults);
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
auto OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::add_tensor(std::string name,
    param_type* param, std::size_t count,
                                     location where) -> tensor_id
{
  detail::gate_entry const gate(gate_, "add_tensor");
  auto const who = "add_tensor('" + name + "')";
  if (layout_) {
    throw logic_error(who + ": the state already exists (after the first step or copy_state), "
                            "so the set of tensors is fixed");
  }
  if (name.empty()) { throw logic_error("add_tensor: the tensor name is empty"); }
  if (param == nullptr && count > 0) {
    throw logic_error(who + ": param is a null pointer for " + std::to_string(count) + " elements");
  }
  if constexpr (!device_params_) {
    if (where != location::host) {
      throw logic_error(who + ": the param lives on the device; this composition keeps params on "
                              "the host (use the CudaOverlapped transfer, or OnDevice compute)");
    }
  }
  if constexpr (on_device_) {
    if (where != location::device) {
      throw logic_error(who + ": the param lives on the host; OnDevice compute updates params on "
                              "the device (register device memory with location::device)");
    }
  }
#if defined(TIERSTATE_ENABLE_CUDA)
  if (count > 0 && (where == location::device) != device::is_device_pointer(param)) {
    throw logic_error(who + ": registered as " + std::string(location_name(where)) +
                      " memory, but the CUDA runtime says the pointer is " +
                      (where == location::device ? "not device memory" : "device memory"));
  }
#endif
  if (index_.find(std::string_view(name)) != index_.end()) {
    throw logic_error(who + ": a tensor of that name is already registered");
  }
  std::size_t const id = tensors_.size();
  auto const [it, inserted] = index_.emplace(name, id);
  try {
    tensors_.push_back({std::move(name), param, count, 0, where});
  } catch (...) {
    index_.erase(it);  // a refused call leaves the registry as it was
    throw;
  }
  return id;
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
auto OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::add_group(hyperparameters const& h,
                                    std::vector<std::string> const& tensor_names) -> group_id
{
  detail::gate_entry const gate(gate_, "add_group");
  Rule::validate(h);
  if (tensor_names.empty()) { throw logic_error("add_group: the group names no tensor"); }
  std::vector<std::size_t> members;
  members.reserve(tensor_names.size());
  for (auto const& n : tensor_names) {
    std::size_t const t = find_tensor(n, "add_group");
    if (tensors_[t].group != 0) {
      throw logic_error("add_group: tensor '" + n + "' is already in group " +
                        std::to_string(tensors_[t].group) + "; a tensor belongs to one group");
    }
    members.push_back(t);
  }
  {
    std::vector<std::size_t> sorted = members;
    std::sort(sorted.begin(), sorted.end());
    auto const twice = std::adjacent_find(sorted.begin(), sorted.end());
    if (twice != sorted.end()) {
      throw logic_error("add_group: tensor '" + tensors_[*twice].name + "' is named twice");
    }
  }
  groups_.push_back(h);
  for (std::size_t const t : members) { tensors_[t].group = groups_.size() - 1; }
  return groups_.size() - 1;
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::set_hyperparameters(group_id g,
    hyperparameters const& h)
{
  detail::gate_entry const gate(gate_, "set_hyperparameters");
  check_not_streaming("set_hyperparameters");
  if (g >= groups_.size()) {
    throw logic_error("set_hyperparameters: there is no group " + std::to_string(g) + " (" +
                      std::to_string(groups_.size()) + " groups)");
  }
  Rule::validate(h);
  groups_[g] = h;
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
auto OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::get_hyperparameters(
    group_id g) const -> hyperparameters const&
{
  if (g >= groups_.size()) {
    throw logic_error("get_hyperparameters: there is no group " + std::to_string(g));
  }
  return groups_[g];
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
auto OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::group_of(
    std::string_view tensor) const -> group_id
{
  return tensors_[find_tensor(tensor, "group_of")].group;
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
std::size_t OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::find_tensor(
    std::string_view name, char const* caller) const
{
  if (auto const it = index_.find(name); it != index_.end()) { return it->second; }
  throw logic_error(std::string(caller) + ": no tensor named '" + std::string(name) +
                    "' is registered");
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
layout OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::make_layout() const
{
  if (tensors_.empty()) { throw logic_error("no tensor is registered: add_tensor first"); }
  std::vector<tensor_extent> extents;
  for (auto const& t : tensors_) { extents.push_back({t.name, 0, t.count}); }
  std::vector<slot> slots;
  std::vector<std::size_t> bytes;
  if constexpr (Precision::has_master) {
    slots.push_back(slot::master);
    bytes.push_back(sizeof(float));
  }
  for (slot const s : Rule::slots) {
    slots.push_back(s);
    bytes.push_back(sizeof(state_type));
  }
  // A model smaller than one chunk gets one chunk of its own size (rounded up to the 4 KiB
  // granularity), not a mostly empty chunk of the requested size.
  std::size_t total = 0;
  for (auto const& t : tensors_) { total += t.count; }
  std::size_t const g     = layout::element_granularity;
  std::size_t const chunk = std::min(opts_.chunk_elements, std::max(g, (total + g - 1) / g * g));
  return layout(std::move(extents), chunk, std::move(slots), std::move(bytes));
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::materialize()
{
  materialize(true);
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::materialize(bool fill_master)
{
  if (layout_) { return; }
  layout lay = make_layout();

  // Each tensor cut at chunk boundaries.
  std::vector<piece> pieces;
  std::vector<std::size_t> chunk_pieces(lay.chunk_count() + 1, 0);
  std::size_t const ce = lay.chunk_elements();
  for (std::size_t t = 0; t < tensors_.size(); ++t) {
    std::size_t e         = lay.tensors()[t].offset;
    std::size_t const end = e + tensors_[t].count;
    while (e < end) {
      std::size_t const k = e / ce;
      std::size_t const n = std::min(end, (k + 1) * ce) - e;
      pieces.push_back({t, e - lay.tensors()[t].offset, e % ce, n});
      ++chunk_pieces[k + 1];
      e += n;
    }
  }
  for (std::size_t k = 0; k < lay.chunk_count(); ++k) { chunk_pieces[k + 1] += chunk_pieces[k]; }

  StateTier tier(lay.total_bytes(), opts_.tier);
  std::optional<PinnedHost> staging;
  if constexpr (device_tier<StateTier>) {
    staging.emplace(lay.chunk_bytes());  // for making the master, checkpoints and copy_state
  } else if constexpr (!addressable_tier<StateTier>) {
    staging.emplace(Transfer::staging_buffers * lay.chunk_bytes());
  }
  std::unique_ptr<device_resources> dev;
  if constexpr (device_params_) {
    dev = std::make_unique<device_resources>();
    std::size_t const B = Transfer::staging_buffers;
    if constexpr (!on_device_) {
      dev->grad_stage  = PinnedHost(B * lay.chunk_elements() * sizeof(grad_type));
      dev->param_stage = PinnedHost(B * lay.chunk_elements() * sizeof(param_type));
    } else {
      dev->nonfinite_flag =
        static_cast<std::uint32_t*>(device::allocate_async(sizeof(std::uint32_t), dev->compute));
      if constexpr (!device_tier<StateTier>) {
        dev->state_stage_bytes = B * lay.chunk_bytes();
        dev->state_stage =
          static_cast<std::byte*>(device::allocate_async(dev->state_stage_bytes, dev->compute));
      }
      dev->compute.synchronize();
    }
  }

  layout_ = std::move(lay);
  tier_.emplace(std::move(tier));
  staging_      = std::move(staging);
  pieces_       = std::move(pieces);
  chunk_pieces_ = std::move(chunk_pieces);
  if constexpr (staging_aware_tier<StateTier>) {
    (void)tier_->register_staging({staging_->data(), staging_->size()});  // refusal is announced
  }
  dev_ = std::move(dev);
  if constexpr (!addressable_tier<StateTier> && !device_tier<StateTier> &&
                (is_pipelined_v<Transfer> || is_cuda_overlapped_v<Transfer>)) {
    io_ = std::make_unique<detail::io_worker<StateTier>>(*tier_);
  }

  // The master starts as the params are now; the slots start at zero (the tier's fill).
  // If the tier fails on the way, the optimizer goes back to having no state, so the next
  // call starts over instead of stepping on a half-made master.
  if constexpr (Precision::has_master) {
    if (!fill_master) { return; }
    try {
      step_stats ignored;
      std::vector<param_type> params;  // device params, copied to the host
      for (std::size_t k = 0; k < layout_->chunk_count(); ++k) {
        with_chunk(k, true, ignored, [&](std::byte* chunk) {
          auto* master = reinterpret_cast<float*>(chunk + layout_->slot_offset(0));
          for (std::size_t p = chunk_pieces_[k]; p < chunk_pieces_[k + 1]; ++p) {
            auto const& pc        = pieces_[p];
            param_type const* src = tensors_[pc.tensor].param + pc.tensor_begin;
            if (tensors_[pc.tensor].where == location::device) {
              params.resize(pc.count);
              read_params(pc.tensor, pc.tensor_begin, pc.count, params.data());
              src = params.data();
            }
            for (std::size_t i = 0; i < pc.count; ++i) {
              master[pc.chunk_begin + i] = convert<float>(src[i]);
            }
          }
        });
      }
    } catch (...) {
      discard_state();
      throw;
    }
  }
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::discard_state() noexcept
{
  keep_held_staging();
  dev_.reset();
  io_.reset();
  tier_.reset();
  layout_.reset();
  pieces_.clear();
  chunk_pieces_.clear();
  staging_.reset();
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
template <class F>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::with_chunk(std::size_t k,
    bool write_back, step_stats& stats, F&& f)
{
  std::size_t const bytes  = layout_->chunk_bytes();
  std::size_t const offset = k * bytes;
  if constexpr (addressable_tier<StateTier>) {
    f(tier_->data() + offset);
    stats.tier_bytes_in_place += bytes;
  } else {
    auto t0 = std::chrono::steady_clock::now();
    tier_->read(offset, std::span<std::byte>(staging(0), bytes));
    stats.tier_bytes_read += bytes;
    stats.wait_seconds += detail::seconds_since(t0);
    f(staging(0));
    if (write_back) {
      t0 = std::chrono::steady_clock::now();
      tier_->write(offset, std::span<std::byte const>(staging(0), bytes));
      stats.tier_bytes_written += bytes;
      stats.wait_seconds += detail::seconds_since(t0);
    }
  }
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::check_grads(
    std::span<grad_view<grad_type> const> grads) const
{
  if (tensors_.empty()) { throw logic_error("step: no tensor is registered: add_tensor first"); }
  if (grads.size() != tensors_.size()) {
    throw logic_error("step: " + std::to_string(grads.size()) + " gradient views for " +
                      std::to_string(tensors_.size()) +
                      " registered tensors (one per tensor, in registration order)");
  }
  for (std::size_t t = 0; t < grads.size(); ++t) {
    auto const& g = grads[t];
    auto const& e = tensors_[t];
    auto const who = "step: the gradient of tensor " + std::to_string(t) + " ('" + e.name + "')";
    if (g.data == nullptr && g.size == 0) { continue; }  // no gradient: the tensor is left as it is
    if (g.size != e.count) {
      throw logic_error(who + " has " + std::to_string(g.size) + " elements; the tensor has " +
                        std::to_string(e.count));
    }
    if constexpr (on_device_) {
      if (g.where != location::device) {
        throw logic_error(who + " is on the host; OnDevice compute reads gradients on the device");
      }
    } else if constexpr (!device_params_) {
      if (g.where != location::host) {
        throw logic_error(who + " is on the device; this composition reads gradients on the host "
                                "(use the CudaOverlapped transfer, or OnDevice compute)");
      }
    }
    if (g.data == nullptr && g.size > 0) { throw logic_error(who + " is a null pointer"); }
  }
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::update_chunk_range(std::size_t k,
    std::byte* chunk, std::size_t b, std::size_t e,
                                             std::span<grad_view<grad_type> const> grads,
                                             std::vector<typename Rule::coefficients> const& coefficients,
                                             grad_type const* grad_stage, param_type* param_stage)
{
  using arrays_t = update_arrays<Precision, Rule::slot_count>;
  constexpr std::size_t first_rule_slot = Precision::has_master ? 1 : 0;
  float* master = nullptr;
  if constexpr (Precision::has_master) {
    master = reinterpret_cast<float*>(chunk + layout_->slot_offset(0));
  }
  std::array<state_type*, Rule::slot_count> state{};
  for (std::size_t j = 0; j < Rule::slot_count; ++j) {
    state[j] = reinterpret_cast<state_type*>(chunk + layout_->slot_offset(first_rule_slot + j));
  }
  // The pieces (tensor parts) of chunk k that overlap [b, e), each with its tensor's group.
  for (std::size_t p = chunk_pieces_[k]; p < chunk_pieces_[k + 1]; ++p) {
    auto const& pc       = pieces_[p];
    std::size_t const lo = std::max(b, pc.chunk_begin);
    std::size_t const hi = std::min(e, pc.chunk_begin + pc.count);
    if (lo >= hi) { continue; }
    if (grads[pc.tensor].data == nullptr) { continue; }  // no gradient
    std::size_t const tofs = pc.tensor_begin + (lo - pc.chunk_begin);
    auto const& tensor     = tensors_[pc.tensor];
    arrays_t a;
    a.param  = update_params_on_device(pc.tensor) ? param_stage + lo : update_params(pc.tensor) + tofs;
    a.grad   = grads[pc.tensor].where == location::device ? grad_stage + lo : grads[pc.tensor].data + tofs;
    a.master = master != nullptr ? master + lo : nullptr;
    for (std::size_t j = 0; j < Rule::slot_count; ++j) { a.state[j] = state[j] + lo; }
    host::update_range<Rule, Precision, arch>(coefficients[tensor.group], a, 0, hi - lo);
  }
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
step_result OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::step(
    std::span<grad_view<grad_type> const> grads, double grad_scale,
                                     device::stream_view ready)
{
  detail::gate_entry const gate(gate_, "step");
  auto const t_start = std::chrono::steady_clock::now();
  check_not_streaming("step");
  if (opts_.delayed_update) { return step_delayed(grads, grad_scale, ready); }
  check_not_lost("step");
  check_grads(grads);
  // Every group's coefficients first: a refused hyper-parameter or scale changes nothing.
  auto coefficients = coefficients_for(grad_scale);
  materialize();

  if constexpr (device_params_) {
    // Device gradients are read after the work queued on `ready` so far.
    dev_->ready.record(ready);
    dev_->compute.wait(dev_->ready);
    dev_->d2h.wait(dev_->ready);
    dev_->h2d.wait(dev_->ready);
  }
  step_result result;
  if (!check_and_clip(grads, grad_scale, coefficients, result)) {
    result.skipped             = true;
    result.step                = step_;
    result.stats.total_seconds = detail::seconds_since(t_start);
    return result;
  }
  run_step(grads, coefficients, result);
  result.step                = ++step_;
  result.stats.total_seconds = detail::seconds_since(t_start);
  return result;
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
auto OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::coefficients_for(
    double grad_scale) const
  -> std::vector<typename Rule::coefficients>
{
  std::vector<typename Rule::coefficients> coefficients;
  coefficients.reserve(groups_.size());
  for (auto const& h : groups_) { coefficients.push_back(Rule::coefficients_for(h, step_ + 1, grad_scale)); }
  return coefficients;
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
bool OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::check_and_clip(
    std::span<grad_view<grad_type> const> grads, double grad_scale,
                                         std::vector<typename Rule::coefficients>& coefficients,
                                         step_result& result)
{
  auto const t0 = std::chrono::steady_clock::now();
  if (opts_.on_nonfinite != nonfinite_policy::ignore) {
    result.found_nonfinite = find_nonfinite(grads);
    if (result.found_nonfinite && opts_.on_nonfinite == nonfinite_policy::skip_step) {
      result.stats.check_seconds = detail::seconds_since(t0);
      return false;
    }
  }
  if (opts_.max_grad_norm > 0.0) {
    // torch.nn.utils.clip_grad_norm_: the norm of the unscaled gradients, and a factor
    // max_norm / (norm + 1e-6) when that is below 1, folded into the gradient's multiplier.
    result.grad_norm   = gradient_norm(grads) / grad_scale;
    double const clip  = opts_.max_grad_norm / (result.grad_norm + 1e-6);
    if (clip < 1.0) { coefficients = coefficients_for(grad_scale / clip); }
  }
  result.stats.check_seconds = detail::seconds_since(t0);
  return true;
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::run_step(
    std::span<grad_view<grad_type> const> grads,
                                   std::vector<typename Rule::coefficients>& coefficients,
                                   step_result& result)
{
  std::size_t const ce    = layout_->chunk_elements();
  std::size_t const grain = 64 * host::batch_size<arch>;
  if constexpr (device_params_) {
    bool changed = false;  // whether a chunk's params and state began to change
    try {
      if constexpr (device_tier<StateTier>) {
        step_device_resident(grads, coefficients, result.stats, changed);
      } else if constexpr (on_device_) {
        step_streamed_to_device(grads, coefficients, result.stats, changed);
      } else {
        step_overlapped_host(grads, coefficients, result.stats, changed);
      }
    } catch (std::exception const& e) {
      if (changed) { lost_ = e.what(); }
      throw;
    } catch (...) {
      if (changed) { lost_ = "an exception that is not a std::exception"; }
      throw;
    }
  } else if constexpr (addressable_tier<StateTier>) {
    if (streaming_ && streaming_->active) {
      // A streaming step: chunk by chunk in the step's order, each once its gradients are in.
      for (std::size_t j = 0; j < layout_->chunk_count(); ++j) {
        std::size_t const k = chunk_at(j);
        await_chunk(k, result.stats);
        auto const t0 = std::chrono::steady_clock::now();
        std::byte* chunk = tier_->data() + k * layout_->chunk_bytes();
        pool_.parallel_for(layout_->chunk_size(k), grain, [&](std::size_t b, std::size_t e) {
          update_chunk_range(k, chunk, b, e, grads, coefficients);
        });
        result.stats.compute_seconds += detail::seconds_since(t0);
        ++result.stats.chunks;
      }
      result.stats.tier_bytes_in_place = layout_->total_bytes();
      return;
    }
    // In place: one parallel pass over all elements; a thread's range may cross chunks.
    auto const t0 = std::chrono::steady_clock::now();
    pool_.parallel_for(layout_->total_elements(), grain, [&](std::size_t b, std::size_t e) {
      for (std::size_t k = b / ce; k * ce < e; ++k) {
        std::byte* chunk = tier_->data() + k * layout_->chunk_bytes();
        update_chunk_range(k, chunk, std::max(b, k * ce) - k * ce, std::min(e, (k + 1) * ce) - k * ce,
                           grads, coefficients);
      }
    });
    result.stats.compute_seconds = detail::seconds_since(t0);
    result.stats.chunks          = layout_->chunk_count();
    result.stats.tier_bytes_in_place = layout_->total_bytes();
  } else {
    bool changed = false;  // whether a chunk's params and state began to change
    try {
      if constexpr (is_pipelined_v<Transfer>) {
        step_pipelined(grads, coefficients, result.stats, changed);
      } else {
        step_staged(grads, coefficients, result.stats, changed);
      }
    } catch (std::exception const& e) {
      if (changed) { lost_ = e.what(); }
      throw;
    } catch (...) {
      if (changed) { lost_ = "an exception that is not a std::exception"; }
      throw;
    }
  }
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::step_staged(
    std::span<grad_view<grad_type> const> grads,
                                      std::vector<typename Rule::coefficients> const& coefficients,
                                      step_stats& stats, bool& changed)
{
  // Each chunk read, updated by all threads, written back, before the next is read.
  std::size_t const grain = 64 * host::batch_size<arch>;
  for (std::size_t j = 0; j < layout_->chunk_count(); ++j) {
    std::size_t const k = chunk_at(j);
    with_chunk(k, true, stats, [&](std::byte* chunk) {
      await_chunk(k, stats);
      changed       = true;
      auto const t0 = std::chrono::steady_clock::now();
      pool_.parallel_for(layout_->chunk_size(k), grain, [&](std::size_t b, std::size_t e) {
        update_chunk_range(k, chunk, b, e, grads, coefficients);
      });
      stats.compute_seconds += detail::seconds_since(t0);
    });
    ++stats.chunks;
  }
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::step_pipelined(
    std::span<grad_view<grad_type> const> grads,
                                         std::vector<typename Rule::coefficients> const& coefficients,
                                         step_stats& stats, bool& changed)
{
  // The j-th chunk of the step's order uses staging buffer j % B. Reads run Depth chunks
  // ahead of the compute; the (j + Depth + 1)-th is read into the buffer of the (j - 1)-th,
  // queued after its write (the I/O thread never batches two jobs on one buffer, so the
  // write finishes first).
  constexpr unsigned B     = Transfer::staging_buffers;
  std::size_t const n      = layout_->chunk_count();
  std::size_t const bytes  = layout_->chunk_bytes();
  std::size_t const grain  = 64 * host::batch_size<arch>;
  std::vector<std::uint64_t> read_ticket(n);
  auto read = [&](std::size_t j) {
    read_ticket[j] = io_->enqueue({chunk_at(j) * bytes, staging(j % B), bytes, false}, static_cast<unsigned>(j % B));
    stats.tier_bytes_read += bytes;
  };
  try {
    for (std::size_t j = 0; j < std::min<std::size_t>(n, Transfer::depth + 1); ++j) { read(j); }
    for (std::size_t j = 0; j < n; ++j) {
      std::size_t const k = chunk_at(j);
      auto t0 = std::chrono::steady_clock::now();
      io_->wait(read_ticket[j]);
      stats.wait_seconds += detail::seconds_since(t0);
      await_chunk(k, stats);

      changed         = true;
      std::byte* const chunk = staging(j % B);
      t0 = std::chrono::steady_clock::now();
      pool_.parallel_for(layout_->chunk_size(k), grain, [&](std::size_t b, std::size_t e) {
        update_chunk_range(k, chunk, b, e, grads, coefficients);
      });
      stats.compute_seconds += detail::seconds_since(t0);

      io_->enqueue({k * bytes, chunk, bytes, true}, static_cast<unsigned>(j % B));
      stats.tier_bytes_written += bytes;
      ++stats.chunks;
      if (j + Transfer::depth + 1 < n) { read(j + Transfer::depth + 1); }
    }
    auto const t0 = std::chrono::steady_clock::now();
    io_->wait_all();  // every write, not only the last one queued: they finish out of order
    stats.wait_seconds += detail::seconds_since(t0);
  } catch (...) {
    io_->drain();  // no staging buffer in the tier's hands when the exception leaves
    throw;
  }
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::read_params(std::size_t t,
    std::size_t begin, std::size_t count,
                                      param_type* to) const
{
  param_type const* from = tensors_[t].param + begin;
  if (tensors_[t].where == location::device) {
    device::copy(to, from, count * sizeof(param_type));
  } else {
    std::copy(from, from + count, to);
  }
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
bool OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::find_nonfinite(
    std::span<grad_view<grad_type> const> grads)
{
  // Host gradients: one parallel pass over all of them, as laid out.
  auto const& ext = layout_->tensors();
  std::atomic<bool> found{false};
  pool_.parallel_for(layout_->total_elements(), 16384, [&](std::size_t b, std::size_t e) {
    auto t = static_cast<std::size_t>(
      std::upper_bound(ext.begin(), ext.end(), b,
                       [](std::size_t x, tensor_extent const& te) { return x < te.offset + te.count; }) -
      ext.begin());
    for (; t < ext.size() && ext[t].offset < e && !found.load(std::memory_order_relaxed); ++t) {
      if (grads[t].where != location::host || grads[t].data == nullptr) { continue; }
      std::size_t const lo = std::max(b, ext[t].offset);
      std::size_t const hi = std::min(e, ext[t].offset + ext[t].count);
      if (lo < hi && host::any_nonfinite(grads[t].data + (lo - ext[t].offset), hi - lo)) {
        found.store(true, std::memory_order_relaxed);
      }
    }
  });
  if constexpr (device_params_) {
    // Device gradients: on the device for OnDevice, every tensor marking one flag, then one
    // wait for it; else copied, a chunk's worth at a time, into the PCIe staging and looked
    // at there.
    if constexpr (on_device_) {
      if (found.load()) { return true; }
      device::stream_view const s(dev_->compute);
      device::zero_async(dev_->nonfinite_flag, sizeof(std::uint32_t), s);
      for (auto const& g : grads) {
        if (g.where == location::device && g.data != nullptr) {
          Compute::mark_nonfinite_async(s, g.data, g.size, dev_->nonfinite_flag);
        }
      }
      std::uint32_t flag = 0;
      device::copy_async(&flag, dev_->nonfinite_flag, sizeof flag, s);
      s.synchronize();
      return flag != 0;
    } else {
      std::size_t const ce = layout_->chunk_elements();
      auto* stage          = reinterpret_cast<grad_type*>(dev_->grad_stage.data());
      for (std::size_t t = 0; t < grads.size() && !found.load(); ++t) {
        auto const& g = grads[t];
        if (g.where != location::device || g.data == nullptr) { continue; }
        for (std::size_t i = 0; i < g.size && !found.load(); i += ce) {
          std::size_t const m = std::min(ce, g.size - i);
          device::copy_async(stage, g.data + i, m * sizeof(grad_type), dev_->d2h);
          dev_->d2h.synchronize();
          if (host::any_nonfinite(pool_, stage, m)) { found = true; }
        }
      }
    }
  }
  return found.load();
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::launch_chunk(std::size_t k,
    std::byte* chunk,
                                       std::span<grad_view<grad_type> const> grads,
                                       std::vector<typename Rule::coefficients> const& coefficients)
{
  if constexpr (on_device_) {
    using arrays_t = update_arrays<Precision, Rule::slot_count>;
    constexpr std::size_t first_rule_slot = Precision::has_master ? 1 : 0;
    for (std::size_t p = chunk_pieces_[k]; p < chunk_pieces_[k + 1]; ++p) {
      auto const& pc     = pieces_[p];
      auto const& tensor = tensors_[pc.tensor];
      if (grads[pc.tensor].data == nullptr) { continue; }  // no gradient
      arrays_t a;
      a.param = tensor.param + pc.tensor_begin;
      a.grad  = grads[pc.tensor].data + pc.tensor_begin;
      if constexpr (Precision::has_master) {
        a.master = reinterpret_cast<float*>(chunk + layout_->slot_offset(0)) + pc.chunk_begin;
      }
      for (std::size_t j = 0; j < Rule::slot_count; ++j) {
        a.state[j] = reinterpret_cast<state_type*>(chunk + layout_->slot_offset(first_rule_slot + j)) +
                     pc.chunk_begin;
      }
      Compute::template update_async<Rule, Precision>(dev_->compute, coefficients[tensor.group], a,
                                                      pc.count);
    }
  } else {
    (void)k, (void)chunk, (void)grads, (void)coefficients;
  }
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::step_device_resident(
    std::span<grad_view<grad_type> const> grads,
                                               std::vector<typename Rule::coefficients> const& coefficients,
                                               step_stats& stats, bool& changed)
{
  // Every chunk updated in place on the device, in one stream: nothing crosses PCIe.
  auto& d = *dev_;
  try {
    if constexpr (device_tier<StateTier>) {
      auto const t0 = std::chrono::steady_clock::now();
      for (std::size_t j = 0; j < layout_->chunk_count(); ++j) {
        std::size_t const k = chunk_at(j);
        await_chunk(k, stats);
        changed = true;
        launch_chunk(k, tier_->device_data() + k * layout_->chunk_bytes(), grads, coefficients);
        ++stats.chunks;
      }
      d.compute.synchronize();
      stats.compute_seconds += detail::seconds_since(t0);
      stats.tier_bytes_in_place += layout_->total_bytes();
    }
  } catch (...) {
    try {
      d.compute.synchronize();
    } catch (...) {  // the first failure is the one reported
    }
    throw;
  }
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::step_overlapped_host(
    std::span<grad_view<grad_type> const> grads,
                                               std::vector<typename Rule::coefficients> const& coefficients,
                                               step_stats& stats, bool& changed)
{
  // The j-th chunk of the step's order uses buffer j % B of each staging ring. While it is
  // computed on the host, the gradients of the next Depth chunks come device to host (d2h
  // stream), the previous chunk's params go host to device (h2d stream), and a tier that is
  // not addressable reads ahead and writes behind as with Pipelined. in[b] marks a chunk's
  // gradients landed; out[b] its params gone, after which buffer b may take the chunk B
  // positions on. In a streaming step a chunk's gradients are copied only once they are
  // final: the reads ahead are issued as usual, the copies when the chunk is ready.
  constexpr unsigned B      = Transfer::staging_buffers;
  constexpr bool staged     = !addressable_tier<StateTier>;
  auto& d                   = *dev_;
  std::size_t const n       = layout_->chunk_count();
  std::size_t const bytes   = layout_->chunk_bytes();
  std::size_t const ce      = layout_->chunk_elements();
  std::size_t const grain   = 64 * host::batch_size<arch>;
  auto* const grad_ring     = reinterpret_cast<grad_type*>(d.grad_stage.data());
  auto* const param_ring    = reinterpret_cast<param_type*>(d.param_stage.data());
  bool const streaming      = in_step();
  std::vector<std::uint64_t> read_ticket(n);
  std::vector<char> copied(n, 0);

  auto read_ahead = [&](std::size_t j) {
    if constexpr (staged) {
      unsigned const b = static_cast<unsigned>(j % B);
      read_ticket[j]   = io_->enqueue({chunk_at(j) * bytes, staging(b), bytes, false}, b);
      stats.tier_bytes_read += bytes;
    }
  };
  auto copy_down = [&](std::size_t j) {  // chunk at position j: its gradients to the host
    unsigned const b    = static_cast<unsigned>(j % B);
    std::size_t const k = chunk_at(j);
    if (j >= B) { d.out[b].synchronize(); }  // position j - B's params have left this buffer
    for (std::size_t p = chunk_pieces_[k]; p < chunk_pieces_[k + 1]; ++p) {
      auto const& pc = pieces_[p];
      auto const& g  = grads[pc.tensor];
      if (g.data == nullptr) { continue; }  // no gradient
      if (g.where == location::device) {
        device::copy_async(grad_ring + b * ce + pc.chunk_begin, g.data + pc.tensor_begin,
                           pc.count * sizeof(grad_type), d.d2h);
        stats.d2h_bytes += pc.count * sizeof(grad_type);
      }
      if constexpr (!Precision::has_master) {  // the param is its own master: it comes too
        auto const& t = tensors_[pc.tensor];
        if (update_params_on_device(pc.tensor)) {
          device::copy_async(param_ring + b * ce + pc.chunk_begin, t.param + pc.tensor_begin,
                             pc.count * sizeof(param_type), d.d2h);
          stats.d2h_bytes += pc.count * sizeof(param_type);
        }
      }
    }
    d.in[b].record(d.d2h);
    copied[j] = 1;
  };
  auto fetch = [&](std::size_t j) {
    read_ahead(j);
    if (!streaming) { copy_down(j); }
  };

  try {
    for (std::size_t j = 0; j < std::min<std::size_t>(n, Transfer::depth + 1); ++j) { fetch(j); }
    for (std::size_t j = 0; j < n; ++j) {
      unsigned const b    = static_cast<unsigned>(j % B);
      std::size_t const k = chunk_at(j);
      if (copied[j] == 0) {
        await_chunk(k, stats);
        copy_down(j);
      }
      auto t0 = std::chrono::steady_clock::now();
      if constexpr (staged) { io_->wait(read_ticket[j]); }
      d.in[b].synchronize();
      stats.wait_seconds += detail::seconds_since(t0);

      changed = true;
      std::byte* chunk;
      if constexpr (staged) {
        chunk = staging(b);
      } else {
        chunk = tier_->data() + k * bytes;
      }
      t0 = std::chrono::steady_clock::now();
      pool_.parallel_for(layout_->chunk_size(k), grain, [&](std::size_t lo, std::size_t hi) {
        update_chunk_range(k, chunk, lo, hi, grads, coefficients, grad_ring + b * ce, param_ring + b * ce);
      });
      stats.compute_seconds += detail::seconds_since(t0);

      if constexpr (staged) {
        io_->enqueue({k * bytes, chunk, bytes, true}, b);
        stats.tier_bytes_written += bytes;
      } else {
        stats.tier_bytes_in_place += bytes;
      }
      for (std::size_t p = chunk_pieces_[k]; p < chunk_pieces_[k + 1]; ++p) {
        auto const& pc = pieces_[p];
        auto const& t  = tensors_[pc.tensor];
        if (update_params_on_device(pc.tensor) && grads[pc.tensor].data != nullptr) {
          device::copy_async(t.param + pc.tensor_begin, param_ring + b * ce + pc.chunk_begin,
                             pc.count * sizeof(param_type), d.h2d);
          stats.h2d_bytes += pc.count * sizeof(param_type);
        }
      }
      d.out[b].record(d.h2d);
      ++stats.chunks;
      if (j + Transfer::depth + 1 < n) { fetch(j + Transfer::depth + 1); }
      if (streaming) {  // the gradients of the chunks ahead that are final by now start down
        for (std::size_t a = j + 1; a < std::min(n, j + Transfer::depth + 2); ++a) {
          if (copied[a] != 0) { continue; }
          if (!chunk_is_ready(chunk_at(a))) { break; }
          await_chunk(chunk_at(a), stats);
          copy_down(a);
        }
      }
    }
    auto const t0 = std::chrono::steady_clock::now();
    if constexpr (staged) { io_->wait_all(); }
    d.h2d.synchronize();
    d.d2h.synchronize();
    stats.wait_seconds += detail::seconds_since(t0);
  } catch (...) {
    if constexpr (staged) { io_->drain(); }
    try {
      d.d2h.synchronize();
      d.h2d.synchronize();
    } catch (...) {  // the first failure is the one reported
    }
    throw;
  }
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::step_streamed_to_device(
    std::span<grad_view<grad_type> const> grads,
                                                  std::vector<typename Rule::coefficients> const& coefficients,
                                                  step_stats& stats, bool& changed)
{
  // Chunk k uses buffer k % B of the device staging ring (and of the pinned ring, for a tier
  // that is not addressable). While chunk k is updated on the compute stream, chunk k+1's
  // state goes host to device (h2d) and chunk k-1's comes back (d2h); NvmeFile reads run
  // Depth chunks ahead of the h2d copies, and a chunk is written once its d2h copy landed.
  // in[b]: state arrived; computed[b]: updated; out[b]: gone back, buffer b free.
  constexpr unsigned B    = Transfer::staging_buffers;
  constexpr bool staged   = !addressable_tier<StateTier>;
  auto& d                 = *dev_;
  std::size_t const n     = layout_->chunk_count();
  std::size_t const bytes = layout_->chunk_bytes();
  std::vector<std::uint64_t> read_ticket(n);

  // (j is a position in the step's order; chunk_at(j) the chunk there.)
  auto device_chunk = [&](std::size_t j) { return d.state_stage + (j % B) * bytes; };
  auto host_chunk   = [&](std::size_t j) -> std::byte* {
    if constexpr (staged) {
      return staging(static_cast<unsigned>(j % B));
    } else {
      return tier_->data() + chunk_at(j) * bytes;
    }
  };
  auto read = [&](std::size_t j) {
    if constexpr (staged) {
      read_ticket[j] = io_->enqueue({chunk_at(j) * bytes, host_chunk(j), bytes, false}, static_cast<unsigned>(j % B));
      stats.tier_bytes_read += bytes;
    }
  };
  auto upload = [&](std::size_t j) {
    unsigned const b = static_cast<unsigned>(j % B);
    if constexpr (staged) {
      auto const t0 = std::chrono::steady_clock::now();
      io_->wait(read_ticket[j]);
      stats.wait_seconds += detail::seconds_since(t0);
    }
    d.h2d.wait(d.out[b]);  // chunk j - B has left the device buffer
    device::copy_async(device_chunk(j), host_chunk(j), bytes, d.h2d);
    d.in[b].record(d.h2d);
    stats.h2d_bytes += bytes;
  };
  auto write_back = [&](std::size_t j) {  // after chunk j's state is back on the host
    if constexpr (staged) {
      unsigned const b = static_cast<unsigned>(j % B);
      auto const t0    = std::chrono::steady_clock::now();
      d.out[b].synchronize();
      stats.wait_seconds += detail::seconds_since(t0);
      io_->enqueue({chunk_at(j) * bytes, host_chunk(j), bytes, true}, b);
      stats.tier_bytes_written += bytes;
    }
  };

  try {
    for (std::size_t j = 0; j < std::min<std::size_t>(n, Transfer::depth + 1); ++j) { read(j); }
    if (n > 0) { upload(0); }
    for (std::size_t j = 0; j < n; ++j) {
      unsigned const b = static_cast<unsigned>(j % B);
      if (j + 1 < n) { upload(j + 1); }
      await_chunk(chunk_at(j), stats);
      d.compute.wait(d.in[b]);
      changed = true;
      launch_chunk(chunk_at(j), device_chunk(j), grads, coefficients);
      d.computed[b].record(d.compute);
      d.d2h.wait(d.computed[b]);
      device::copy_async(host_chunk(j), device_chunk(j), bytes, d.d2h);
      d.out[b].record(d.d2h);
      stats.d2h_bytes += bytes;
      if constexpr (!staged) { stats.tier_bytes_in_place += bytes; }
      ++stats.chunks;
      if (j >= 1) { write_back(j - 1); }
      if (j + Transfer::depth + 1 < n) { read(j + Transfer::depth + 1); }
    }
    auto const t0 = std::chrono::steady_clock::now();
    if (n > 0) { write_back(n - 1); }
    if constexpr (staged) { io_->wait_all(); }
    d.compute.synchronize();
    d.h2d.synchronize();
    d.d2h.synchronize();
    stats.wait_seconds += detail::seconds_since(t0);
  } catch (...) {
    try {
      d.compute.synchronize();
      d.h2d.synchronize();
      d.d2h.synchronize();
    } catch (...) {  // the first failure is the one reported
    }
    if constexpr (staged) { io_->drain(); }
    throw;
  }
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
double OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::gradient_norm(
    std::span<grad_view<grad_type> const> grads)
{
  // Sums of squares over blocks of 4096 elements of each tensor (in double, in element
  // order), then all blocks combined pairwise in (tensor, block) order: nothing depends on
  // the chunking, the threads or the order the gradients came in.
  constexpr std::size_t block = 4096;
  std::vector<std::size_t> first(grads.size() + 1, 0);
  for (std::size_t t = 0; t < grads.size(); ++t) {
    std::size_t const n = grads[t].data == nullptr ? 0 : grads[t].size;
    first[t + 1]        = first[t] + (n + block - 1) / block;
  }
  std::vector<double> sums(first.back(), 0.0);
  auto sum_block = [](grad_type const* g, std::size_t n) {
    double s = 0.0;
    for (std::size_t i = 0; i < n; ++i) {
      double const x = static_cast<double>(convert<float>(g[i]));
      s += x * x;
    }
    return s;
  };
  for (std::size_t t = 0; t < grads.size(); ++t) {
    auto const& g = grads[t];
    if (g.data == nullptr || g.size == 0) { continue; }
    std::size_t const blocks = first[t + 1] - first[t];
    if (g.where == location::host) {
      pool_.parallel_for(blocks, 1, [&](std::size_t b, std::size_t e) {
        for (std::size_t i = b; i < e; ++i) {
          sums[first[t] + i] = sum_block(g.data + i * block, std::min(block, g.size - i * block));
        }
      });
    } else if constexpr (device_params_ && !on_device_) {
      // Copied a ring's worth of whole blocks at a time into the PCIe staging.
      std::size_t const per = std::max<std::size_t>(1, dev_->grad_stage.size() / sizeof(grad_type) / block);
      auto* stage           = reinterpret_cast<grad_type*>(dev_->grad_stage.data());
      for (std::size_t i = 0; i < blocks; i += per) {
        std::size_t const m = std::min(per, blocks - i);
        std::size_t const elements = std::min(m * block, g.size - i * block);
        device::copy_async(stage, g.data + i * block, elements * sizeof(grad_type), dev_->d2h);
        dev_->d2h.synchronize();
        pool_.parallel_for(m, 1, [&](std::size_t b, std::size_t e) {
          for (std::size_t j = b; j < e; ++j) {
            sums[first[t] + i + j] = sum_block(stage + j * block, std::min(block, elements - j * block));
          }
        });
      }
    } else {
      throw logic_error("max_grad_norm: the norm of device gradients needs OnHost compute");
    }
  }
  return std::sqrt(detail::pairwise_sum(sums.data(), sums.size()));
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::await_chunk(std::size_t k,
    step_stats& stats)
{
  if (!(streaming_ && streaming_->active)) { return; }
  auto& st      = *streaming_;
  auto const t0 = std::chrono::steady_clock::now();
  std::unique_lock lock(st.m);
  if (st.checks && !st.checked) {
    st.cv.wait(lock, [&] { return st.abandoned || st.finals == tensors_.size(); });
    if (st.abandoned) { throw logic_error("the optimizer was destroyed during a streaming step"); }
    st.checked = true;
    lock.unlock();
    stats.grad_wait_seconds += detail::seconds_since(t0);
    if constexpr (device_params_) {  // every gradient's device work first
      for (std::size_t t = 0; t < tensors_.size(); ++t) {
        if (st.views[t].where == location::device && st.views[t].data != nullptr) {
          dev_->d2h.wait(*st.grad_events[t]);
          dev_->compute.wait(*st.grad_events[t]);
        }
      }
    }
    if (!check_and_clip(st.views, st.grad_scale, st.coefficients, st.result)) {
      throw detail::skip_step_signal{};
    }
    return;
  }
  st.cv.wait(lock, [&] { return st.abandoned || st.ready[k] != 0; });
  if (st.abandoned) { throw logic_error("the optimizer was destroyed during a streaming step"); }
  lock.unlock();
  stats.grad_wait_seconds += detail::seconds_since(t0);
  if constexpr (device_params_) {  // the device work that made these gradients comes first
    for (std::size_t p = chunk_pieces_[k]; p < chunk_pieces_[k + 1]; ++p) {
      std::size_t const t = pieces_[p].tensor;
      if (st.views[t].where == location::device && st.views[t].data != nullptr) {
        dev_->d2h.wait(*st.grad_events[t]);
        dev_->compute.wait(*st.grad_events[t]);
      }
    }
  }
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
bool OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::chunk_is_ready(std::size_t k)
{
  auto& st = *streaming_;
  std::lock_guard lock(st.m);
  return st.ready[k] != 0 && (!st.checks || st.checked);
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::check_not_streaming(
    char const* call) const
{
  if (in_step()) {
    throw logic_error(std::string(call).append(": a streaming step is in progress (begin_step without finish_step)"));
  }
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::begin_step(double grad_scale,
    unsigned micro_batches)
{
  detail::gate_entry const gate(gate_, "begin_step");
  check_not_streaming("begin_step");
  if (opts_.delayed_update) {
    throw logic_error("begin_step: streaming steps and delayed_update do not combine (the delayed "
                      "update already runs during the next forward and backward): call step()");
  }
  check_not_lost("begin_step");
  if (micro_batches == 0) { throw invalid_option("micro_batches", "0", "must be >= 1"); }
  if (tensors_.empty()) { throw logic_error("begin_step: no tensor is registered: add_tensor first"); }
  auto coefficients = coefficients_for(grad_scale);  // refused values change nothing
  materialize();
  if (!streaming_) { streaming_ = std::make_unique<streaming_state>(); }
  auto& st            = *streaming_;
  std::size_t const n = layout_->chunk_count();
  std::size_t const T = tensors_.size();
  st.started          = std::chrono::steady_clock::now();
  st.abandoned        = false;
  st.checks  = opts_.on_nonfinite != nonfinite_policy::ignore || opts_.max_grad_norm > 0.0;
  st.checked = false;
  st.micro_batches = micro_batches;
  st.grad_scale    = grad_scale;
  st.views.assign(T, grad_view<grad_type>{});
  st.arrivals.assign(T, 0);
  st.final_.assign(T, 0);
  st.finals = 0;
  st.pending.resize(n);
  for (std::size_t k = 0; k < n; ++k) { st.pending[k] = chunk_pieces_[k + 1] - chunk_pieces_[k]; }
  st.ready.assign(n, 0);
  st.arrival.clear();
  st.arrival.reserve(n);
  if (next_order_.size() == n) {
    st.order = next_order_;
  } else {  // backward's order: the last registered tensors' chunks first
    st.order.resize(n);
    for (std::size_t j = 0; j < n; ++j) { st.order[j] = n - 1 - j; }
  }
  if constexpr (device_params_) {
    while (st.grad_events.size() < T) { st.grad_events.push_back(std::make_unique<device::event>()); }
  }
  st.coefficients = std::move(coefficients);
  st.result       = step_result{};
  st.error        = nullptr;
  for (std::size_t t = 0; t < T; ++t) {
    if (tensors_[t].count == 0) {
      st.final_[t] = 1;
      ++st.finals;
    }
  }
  st.active = true;
  try {
    st.driver = std::thread([this] { drive_streaming_step(); });
  } catch (...) {
    st.active = false;
    throw;
  }
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::grad_ready(tensor_id t,
    grad_view<grad_type> g, device::stream_view ready)
{
  if (t >= tensors_.size()) {
    throw logic_error("grad_ready: there is no tensor " + std::to_string(t) + " (" +
                      std::to_string(tensors_.size()) + " registered)");
  }
  auto const& e  = tensors_[t];
  auto const who = "grad_ready: the gradient of tensor " + std::to_string(t) + " ('" + e.name + "')";
  if (g.size != e.count) {
    throw logic_error(who + " has " + std::to_string(g.size) + " elements; the tensor has " +
                      std::to_string(e.count));
  }
  if constexpr (on_device_) {
    if (g.where != location::device) {
      throw logic_error(who + " is on the host; OnDevice compute reads gradients on the device");
    }
  } else if constexpr (!device_params_) {
    if (g.where != location::host) {
      throw logic_error(who + " is on the device; this composition reads gradients on the host "
                              "(use the CudaOverlapped transfer, or OnDevice compute)");
    }
  }
  if (g.data == nullptr && g.size > 0) { throw logic_error(who + " is a null pointer"); }
  if (!streaming_) { throw logic_error("grad_ready: no streaming step is in progress (call begin_step)"); }
  auto& st = *streaming_;
  {
    std::lock_guard lock(st.m);
    if (!st.active) { throw logic_error("grad_ready: no streaming step is in progress (call begin_step)"); }
    if (e.count == 0) { return; }  // nothing to update: an empty tensor is final from begin_step on
    if (st.final_[t] != 0) {
      throw logic_error(who + " was already handed over " + std::to_string(st.arrivals[t]) +
                        " time(s), and micro_batches is " + std::to_string(st.micro_batches));
    }
    st.views[t] = g;
    if constexpr (device_params_) {
      // The gradient is final after the work queued on `ready` so far.
      if (g.where == location::device) { st.grad_events[t]->record(ready); }
    }
    if (++st.arrivals[t] == st.micro_batches) { mark_final(t); }
  }
  st.cv.notify_all();
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::mark_final(std::size_t t)
{
  auto& st     = *streaming_;
  st.final_[t] = 1;
  ++st.finals;
  std::size_t const ce    = layout_->chunk_elements();
  std::size_t const first = layout_->tensors()[t].offset / ce;
  std::size_t const last  = (layout_->tensors()[t].offset + tensors_[t].count - 1) / ce;
  for (std::size_t k = first; k <= last; ++k) {
    if (--st.pending[k] == 0) {  // its last tensor: the chunk may go
      st.ready[k] = 1;
      st.arrival.push_back(k);
    }
  }
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
step_result OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::finish_step()
{
  detail::gate_entry const gate(gate_, "finish_step");
  if (!in_step()) { throw logic_error("finish_step: no streaming step is in progress (call begin_step)"); }
  auto& st = *streaming_;
  {
    // Every tensor not handed over has no gradient this step.
    std::lock_guard lock(st.m);
    for (std::size_t t = 0; t < tensors_.size(); ++t) {
      if (st.final_[t] != 0) { continue; }
      st.views[t] = grad_view<grad_type>{};
      mark_final(t);
    }
  }
  st.cv.notify_all();
  st.driver.join();
  {
    std::lock_guard lock(st.m);
    st.active = false;
  }
  next_order_ = st.arrival;  // the next step follows the order this one's chunks came in
  if (st.error) { std::rethrow_exception(st.error); }
  step_result r         = st.result;
  r.stats.total_seconds = detail::seconds_since(st.started);
  return r;
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::drive_streaming_step()
{
  auto& st = *streaming_;
  try {
    run_step(st.views, st.coefficients, st.result);
    st.result.step = ++step_;
  } catch (detail::skip_step_signal const&) {
    st.result.skipped = true;
    st.result.step    = step_;
  } catch (...) {
    st.error = std::current_exception();
  }
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
step_result OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::flush()
{
  detail::gate_entry const gate(gate_, "flush");
  if (!delayed_ || !delayed_->worker.joinable()) { return {}; }
  auto& dl = *delayed_;
  dl.worker.join();
  if (dl.error) { std::rethrow_exception(std::exchange(dl.error, nullptr)); }
  // The update's params into the model.
  auto const* params = reinterpret_cast<param_type const*>(dl.params.data());
  for (std::size_t t = 0; t < tensors_.size(); ++t) {
    auto const& e          = tensors_[t];
    param_type const* from = params + layout_->tensors()[t].offset;
    if (e.where == location::device) {
      device::copy(e.param, from, e.count * sizeof(param_type));
    } else {
      std::copy(from, from + e.count, e.param);
    }
  }
  return dl.result;
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
step_result OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::step_delayed(
    std::span<grad_view<grad_type> const> grads,
                                              double grad_scale, device::stream_view ready)
{
  auto const t_start = std::chrono::steady_clock::now();
  check_grads(grads);
  step_result const previous = flush();  // also the first place a failed update is reported
  check_not_lost("step");
  auto coefficients = coefficients_for(grad_scale);
  materialize();
  std::size_t const total = layout_->total_elements();
  if (!delayed_) {
    auto dl    = std::make_unique<delayed_state>();
    dl.get()->grads  = PinnedHost(total * sizeof(grad_type));
    dl.get()->params = PinnedHost(total * sizeof(param_type));
    auto* params = reinterpret_cast<param_type*>(dl->params.data());
    for (std::size_t t = 0; t < tensors_.size(); ++t) {
      read_params(t, 0, tensors_[t].count, params + layout_->tensors()[t].offset);
    }
    dl->views.resize(tensors_.size());
    delayed_ = std::move(dl);
  }
  auto& dl = *delayed_;
  // The gradients into the optimizer's own buffer: the caller may reuse theirs at once.
  auto* own = reinterpret_cast<grad_type*>(dl.grads.data());
  if constexpr (device_params_) {
    dev_->ready.record(ready);
    dev_->d2h.wait(dev_->ready);
  } else {
    (void)ready;
  }
  // Host gradients are copied by the pool, in pieces of at most 16 Ki elements (a copy
  // of a model's gradients is memory-bound: one thread does not saturate the memory).
  struct host_copy {
    grad_type const* from;
    grad_type* to;
    std::size_t n;
  };
  std::vector<host_copy> pieces;
  constexpr std::size_t piece_elements = std::size_t{1} << 14;
  for (std::size_t t = 0; t < tensors_.size(); ++t) {
    auto const& g = grads[t];
    if (g.data == nullptr) {
      dl.views[t] = {};
      continue;
    }
    grad_type* to = own + layout_->tensors()[t].offset;
    if (g.where == location::device) {
      if constexpr (device_params_) { device::copy_async(to, g.data, g.size * sizeof(grad_type), dev_->d2h); }
    } else {
      for (std::size_t b = 0; b < g.size; b += piece_elements) {
        pieces.push_back({g.data + b, to + b, std::min(piece_elements, g.size - b)});
      }
    }
    dl.views[t] = {to, g.size, location::host};
  }
  pool_.parallel_for(pieces.size(), 1, [&](std::size_t b, std::size_t e) {
    for (std::size_t i = b; i < e; ++i) { std::copy_n(pieces[i].from, pieces[i].n, pieces[i].to); }
  });
  if constexpr (device_params_) { dev_->d2h.synchronize(); }

  step_result r;
  r.deferred = true;
  r.stats    = previous.stats;
  if (!check_and_clip(dl.views, grad_scale, coefficients, r)) {
    r.skipped = true;
    r.step    = step_;
    r.stats.total_seconds = detail::seconds_since(t_start);
    return r;
  }
  r.step          = ++step_;  // counted when started: a failure loses the state anyway
  dl.coefficients = std::move(coefficients);
  dl.result       = step_result{};
  dl.result.step  = step_;
  dl.worker       = std::thread([this] {
    auto& d          = *delayed_;
    auto const start = std::chrono::steady_clock::now();
    try {
      run_step(d.views, d.coefficients, d.result);
    } catch (...) {
      d.error = std::current_exception();
    }
    d.result.stats.total_seconds = detail::seconds_since(start);
  });
  return r;
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::check_not_lost(char const* call) const
{
  if (!lost_.empty()) { throw tierstate::state_lost(call, lost_); }
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::copy_state(std::string_view tensor,
    slot s, std::span<float> to)
{
  detail::gate_entry const gate(gate_, "copy_state");
  check_not_streaming("copy_state");
  flush();
  check_not_lost("copy_state");
  std::size_t const t = find_tensor(tensor, "copy_state");
  if (to.size() != tensors_[t].count) {  // checked before the state is made: a refusal changes nothing
    throw logic_error("copy_state('" + tensors_[t].name + "'): the span has " + std::to_string(to.size()) +
                      " elements; the tensor has " + std::to_string(tensors_[t].count));
  }
  check_slot(s, "copy_state");
  materialize();
  std::size_t const si = layout_->slot_index(s);
  auto const& ext      = layout_->tensors()[t];
  std::size_t const eb = layout_->slot_element_bytes(si);
  std::vector<std::byte> buf;
  std::size_t done = 0;
  while (done < ext.count) {
    std::size_t const e = ext.offset + done;
    std::size_t const n = std::min(ext.count - done, layout_->chunk_elements() - e % layout_->chunk_elements());
    buf.resize(n * eb);
    tier_->read(layout_->byte_offset(si, e), buf);
    for (std::size_t i = 0; i < n; ++i) {
      if (eb == sizeof(float)) {
        std::memcpy(&to[done + i], buf.data() + i * eb, sizeof(float));
      } else {
        state_type v;
        std::memcpy(&v, buf.data() + i * eb, sizeof(v));
        to[done + i] = convert<float>(v);
      }
    }
    done += n;
  }
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::check_slot(slot s,
    char const* call) const
{
  bool const kept = (Precision::has_master && s == slot::master) ||
                    std::find(Rule::slots.begin(), Rule::slots.end(), s) != Rule::slots.end();
  if (!kept) {
    throw logic_error(std::string(call) + ": this optimizer keeps no slot " + std::string(slot_name(s)) +
                      (s == slot::master ? " (fp32 params are their own master)" : ""));
  }
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::set_step_count(std::int64_t n)
{
  detail::gate_entry const gate(gate_, "set_step_count");
  check_not_streaming("set_step_count");
  if (n < 0) { throw invalid_option("step_count", detail::to_text(n), "the step count must be >= 0"); }
  flush();
  step_ = n;
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::write_state(std::string_view tensor,
    slot s, std::span<float const> from)
{
  detail::gate_entry const gate(gate_, "write_state");
  check_not_streaming("write_state");
  flush();
  check_not_lost("write_state");
  std::size_t const t = find_tensor(tensor, "write_state");
  if (from.size() != tensors_[t].count) {  // checked before the state is made: a refusal changes nothing
    throw logic_error("write_state('" + tensors_[t].name + "'): the span has " + std::to_string(from.size()) +
                      " elements; the tensor has " + std::to_string(tensors_[t].count));
  }
  check_slot(s, "write_state");
  materialize();
  std::size_t const si = layout_->slot_index(s);
  auto const& ext      = layout_->tensors()[t];
  std::size_t const eb = layout_->slot_element_bytes(si);
  std::vector<std::byte> buf;
  std::size_t done = 0;
  while (done < ext.count) {
    std::size_t const e = ext.offset + done;
    std::size_t const n = std::min(ext.count - done, layout_->chunk_elements() - e % layout_->chunk_elements());
    buf.resize(n * eb);
    for (std::size_t i = 0; i < n; ++i) {
      if (eb == sizeof(float)) {
        std::memcpy(buf.data() + i * eb, &from[done + i], sizeof(float));
      } else {
        state_type const v = convert<state_type>(from[done + i]);
        std::memcpy(buf.data() + i * eb, &v, sizeof(v));
      }
    }
    try {
      tier_->write(layout_->byte_offset(si, e), buf);
    } catch (std::exception const& x) {
      lost_ = x.what();  // a failed write may have landed in part
      throw;
    }
    done += n;
  }
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
layout const& OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::state_layout()
{
  detail::gate_entry const gate(gate_, "state_layout");
  materialize();
  return *layout_;
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
StateTier& OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::state_tier()
{
  detail::gate_entry const gate(gate_, "state_tier");
  materialize();
  return *tier_;
}

}  // namespace tierstate
