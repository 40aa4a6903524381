// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>

namespace tierstate {
namespace detail {

inline double seconds_since(std::chrono::steady_clock::time_point t0) noexcept
{
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace detail

#define TIERSTATE_OPTIMIZER_TEMPLATE \
  template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
#define TIERSTATE_OPTIMIZER OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>

TIERSTATE_OPTIMIZER_TEMPLATE
TIERSTATE_OPTIMIZER::OffloadedOptimizer(hyperparameters const& defaults, options const& opts)
  : opts_(opts), pool_(opts.threads)
{
  Rule::validate(defaults);
  if (opts.chunk_elements == 0 || opts.chunk_elements % layout::element_granularity != 0) {
    throw invalid_option("chunk_elements", detail::to_text(opts.chunk_elements),
                         "must be a positive multiple of 2048, so every slot array of a chunk "
                         "is a whole number of 4 KiB blocks");
  }
  groups_.push_back(defaults);
}

TIERSTATE_OPTIMIZER_TEMPLATE
auto TIERSTATE_OPTIMIZER::add_tensor(std::string name, param_type* param, std::size_t count,
                                     location where) -> tensor_id
{
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
  for (auto const& t : tensors_) {
    if (t.name == name) { throw logic_error(who + ": a tensor of that name is already registered"); }
  }
  tensors_.push_back({std::move(name), param, count, 0, where});
  return tensors_.size() - 1;
}

TIERSTATE_OPTIMIZER_TEMPLATE
auto TIERSTATE_OPTIMIZER::add_group(hyperparameters const& h,
                                    std::vector<std::string> const& tensor_names) -> group_id
{
  Rule::validate(h);
  if (tensor_names.empty()) { throw logic_error("add_group: the group names no tensor"); }
  std::vector<std::size_t> members;
  for (auto const& n : tensor_names) {
    std::size_t const t = find_tensor(n, "add_group");
    if (tensors_[t].group != 0) {
      throw logic_error("add_group: tensor '" + n + "' is already in group " +
                        std::to_string(tensors_[t].group) + "; a tensor belongs to one group");
    }
    if (std::find(members.begin(), members.end(), t) != members.end()) {
      throw logic_error("add_group: tensor '" + n + "' is named twice");
    }
    members.push_back(t);
  }
  groups_.push_back(h);
  for (std::size_t const t : members) { tensors_[t].group = groups_.size() - 1; }
  return groups_.size() - 1;
}

TIERSTATE_OPTIMIZER_TEMPLATE
void TIERSTATE_OPTIMIZER::set_hyperparameters(group_id g, hyperparameters const& h)
{
  if (g >= groups_.size()) {
    throw logic_error("set_hyperparameters: there is no group " + std::to_string(g) + " (" +
                      std::to_string(groups_.size()) + " groups)");
  }
  Rule::validate(h);
  groups_[g] = h;
}

TIERSTATE_OPTIMIZER_TEMPLATE
auto TIERSTATE_OPTIMIZER::get_hyperparameters(group_id g) const -> hyperparameters const&
{
  if (g >= groups_.size()) {
    throw logic_error("get_hyperparameters: there is no group " + std::to_string(g));
  }
  return groups_[g];
}

TIERSTATE_OPTIMIZER_TEMPLATE
auto TIERSTATE_OPTIMIZER::group_of(std::string_view tensor) const -> group_id
{
  return tensors_[find_tensor(tensor, "group_of")].group;
}

TIERSTATE_OPTIMIZER_TEMPLATE
std::size_t TIERSTATE_OPTIMIZER::find_tensor(std::string_view name, char const* caller) const
{
  for (std::size_t i = 0; i < tensors_.size(); ++i) {
    if (tensors_[i].name == name) { return i; }
  }
  throw logic_error(std::string(caller) + ": no tensor named '" + std::string(name) +
                    "' is registered");
}

TIERSTATE_OPTIMIZER_TEMPLATE
void TIERSTATE_OPTIMIZER::materialize()
{
  if (layout_) { return; }
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
  layout lay(std::move(extents), chunk, std::move(slots), std::move(bytes));

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
    } else if constexpr (!device_tier<StateTier>) {
      dev->state_stage_bytes = B * lay.chunk_bytes();
      dev->state_stage =
        static_cast<std::byte*>(device::allocate_async(dev->state_stage_bytes, dev->compute));
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
      dev_.reset();
      io_.reset();
      tier_.reset();
      layout_.reset();
      pieces_.clear();
      chunk_pieces_.clear();
      staging_.reset();
      throw;
    }
  }
}

TIERSTATE_OPTIMIZER_TEMPLATE
template <class F>
void TIERSTATE_OPTIMIZER::with_chunk(std::size_t k, bool write_back, step_stats& stats, F&& f)
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

TIERSTATE_OPTIMIZER_TEMPLATE
void TIERSTATE_OPTIMIZER::check_grads(std::span<grad_view<grad_type> const> grads) const
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

TIERSTATE_OPTIMIZER_TEMPLATE
void TIERSTATE_OPTIMIZER::update_chunk_range(std::size_t k, std::byte* chunk, std::size_t b, std::size_t e,
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
    std::size_t const tofs = pc.tensor_begin + (lo - pc.chunk_begin);
    auto const& tensor     = tensors_[pc.tensor];
    arrays_t a;
    a.param  = tensor.where == location::device ? param_stage + lo : tensor.param + tofs;
    a.grad   = grads[pc.tensor].where == location::device ? grad_stage + lo : grads[pc.tensor].data + tofs;
    a.master = master != nullptr ? master + lo : nullptr;
    for (std::size_t j = 0; j < Rule::slot_count; ++j) { a.state[j] = state[j] + lo; }
    host::update_range<Rule, Precision, arch>(coefficients[tensor.group], a, 0, hi - lo);
  }
}

TIERSTATE_OPTIMIZER_TEMPLATE
step_result TIERSTATE_OPTIMIZER::step(std::span<grad_view<grad_type> const> grads, double grad_scale,
                                     device::stream_view ready)
{
  auto const t_start = std::chrono::steady_clock::now();
  check_not_lost("step");
  check_grads(grads);
  // Every group's coefficients first: a refused hyper-parameter or scale changes nothing.
  std::vector<typename Rule::coefficients> coefficients;
  coefficients.reserve(groups_.size());
  for (auto const& h : groups_) { coefficients.push_back(Rule::coefficients_for(h, step_ + 1, grad_scale)); }
  materialize();

  step_result result;
  if constexpr (device_params_) {
    // Device gradients are read after the work queued on `ready` so far.
    dev_->ready.record(ready);
    dev_->compute.wait(dev_->ready);
    dev_->d2h.wait(dev_->ready);
    dev_->h2d.wait(dev_->ready);
  }
  if (opts_.on_nonfinite != nonfinite_policy::ignore) {
    auto const t0 = std::chrono::steady_clock::now();
    result.found_nonfinite = find_nonfinite(grads);

    result.stats.check_seconds = detail::seconds_since(t0);
    if (result.found_nonfinite && opts_.on_nonfinite == nonfinite_policy::skip_step) {
      result.skipped             = true;
      result.step                = step_;
      result.stats.total_seconds = detail::seconds_since(t_start);
      return result;
    }
  }

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
  result.step                = ++step_;
  result.stats.total_seconds = detail::seconds_since(t_start);
  return result;
}

TIERSTATE_OPTIMIZER_TEMPLATE
void TIERSTATE_OPTIMIZER::step_staged(std::span<grad_view<grad_type> const> grads,
                                      std::vector<typename Rule::coefficients> const& coefficients,
                                      step_stats& stats, bool& changed)
{
  // Each chunk read, updated by all threads, written back, before the next is read.
  std::size_t const grain = 64 * host::batch_size<arch>;
  for (std::size_t k = 0; k < layout_->chunk_count(); ++k) {
    with_chunk(k, true, stats, [&](std::byte* chunk) {
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

TIERSTATE_OPTIMIZER_TEMPLATE
void TIERSTATE_OPTIMIZER::step_pipelined(std::span<grad_view<grad_type> const> grads,
                                         std::vector<typename Rule::coefficients> const& coefficients,
                                         step_stats& stats, bool& changed)
{
  // Chunk k uses staging buffer k % B. Reads run Depth chunks ahead of the compute; chunk
  // k + Depth + 1 is read into the buffer of chunk k - 1, queued after k - 1's write (the
  // I/O thread never batches two jobs on one buffer, so the write finishes first).
  constexpr unsigned B     = Transfer::staging_buffers;
  std::size_t const n      = layout_->chunk_count();
  std::size_t const bytes  = layout_->chunk_bytes();
  std::size_t const grain  = 64 * host::batch_size<arch>;
  std::vector<std::uint64_t> read_ticket(n);
  auto read = [&](std::size_t j) {
    read_ticket[j] = io_->enqueue({j * bytes, staging(j % B), bytes, false}, static_cast<unsigned>(j % B));
    stats.tier_bytes_read += bytes;
  };
  try {
    for (std::size_t j = 0; j < std::min<std::size_t>(n, Transfer::depth + 1); ++j) { read(j); }
    for (std::size_t k = 0; k < n; ++k) {
      auto t0 = std::chrono::steady_clock::now();
      io_->wait(read_ticket[k]);
      stats.wait_seconds += detail::seconds_since(t0);

      changed         = true;
      std::byte* const chunk = staging(k % B);
      t0 = std::chrono::steady_clock::now();
      pool_.parallel_for(layout_->chunk_size(k), grain, [&](std::size_t b, std::size_t e) {
        update_chunk_range(k, chunk, b, e, grads, coefficients);
      });
      stats.compute_seconds += detail::seconds_since(t0);

      io_->enqueue({k * bytes, chunk, bytes, true}, static_cast<unsigned>(k % B));
      stats.tier_bytes_written += bytes;
      ++stats.chunks;
      if (k + Transfer::depth + 1 < n) { read(k + Transfer::depth + 1); }
    }
    auto const t0 = std::chrono::steady_clock::now();
    io_->wait_all();  // every write, not only the last one queued: they finish out of order
    stats.wait_seconds += detail::seconds_since(t0);
  } catch (...) {
    io_->drain();  // no staging buffer in the tier's hands when the exception leaves
    throw;
  }
}

TIERSTATE_OPTIMIZER_TEMPLATE
void TIERSTATE_OPTIMIZER::read_params(std::size_t t, std::size_t begin, std::size_t count,
                                      param_type* to) const
{
  param_type const* from = tensors_[t].param + begin;
  if (tensors_[t].where == location::device) {
    device::copy(to, from, count * sizeof(param_type));
  } else {
    std::copy(from, from + count, to);
  }
}

TIERSTATE_OPTIMIZER_TEMPLATE
bool TIERSTATE_OPTIMIZER::find_nonfinite(std::span<grad_view<grad_type> const> grads)
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
      if (grads[t].where != location::host) { continue; }
      std::size_t const lo = std::max(b, ext[t].offset);
      std::size_t const hi = std::min(e, ext[t].offset + ext[t].count);
      if (lo < hi && host::any_nonfinite(grads[t].data + (lo - ext[t].offset), hi - lo)) {
        found.store(true, std::memory_order_relaxed);
      }
    }
  });
  if constexpr (device_params_) {
    // Device gradients: on the device for OnDevice; else copied, a chunk's worth at a
    // time, into the PCIe staging and looked at there.
    for (std::size_t t = 0; t < grads.size() && !found.load(); ++t) {
      auto const& g = grads[t];
      if (g.where != location::device) { continue; }
      if constexpr (on_device_) {
        if (Compute::any_nonfinite(device::stream_view(dev_->compute), g.data, g.size)) { found = true; }
      } else {
        std::size_t const ce = layout_->chunk_elements();
        auto* stage          = reinterpret_cast<grad_type*>(dev_->grad_stage.data());
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

TIERSTATE_OPTIMIZER_TEMPLATE
void TIERSTATE_OPTIMIZER::launch_chunk(std::size_t k, std::byte* chunk,
                                       std::span<grad_view<grad_type> const> grads,
                                       std::vector<typename Rule::coefficients> const& coefficients)
{
  if constexpr (on_device_) {
    using arrays_t = update_arrays<Precision, Rule::slot_count>;
    constexpr std::size_t first_rule_slot = Precision::has_master ? 1 : 0;
    for (std::size_t p = chunk_pieces_[k]; p < chunk_pieces_[k + 1]; ++p) {
      auto const& pc     = pieces_[p];
      auto const& tensor = tensors_[pc.tensor];
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

TIERSTATE_OPTIMIZER_TEMPLATE
void TIERSTATE_OPTIMIZER::step_device_resident(std::span<grad_view<grad_type> const> grads,
                                               std::vector<typename Rule::coefficients> const& coefficients,
                                               step_stats& stats, bool& changed)
{
  // Every chunk updated in place on the device, in one stream: nothing crosses PCIe.
  auto& d = *dev_;
  try {
    if constexpr (device_tier<StateTier>) {
      auto const t0 = std::chrono::steady_clock::now();
      for (std::size_t k = 0; k < layout_->chunk_count(); ++k) {
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

TIERSTATE_OPTIMIZER_TEMPLATE
void TIERSTATE_OPTIMIZER::step_overlapped_host(std::span<grad_view<grad_type> const> grads,
                                               std::vector<typename Rule::coefficients> const& coefficients,
                                               step_stats& stats, bool& changed)
{
  // Chunk k uses buffer k % B of each staging ring. While chunk k is computed on the host,
  // the gradients of chunks k+1..k+Depth come device to host (d2h stream), chunk k-1's
  // params go host to device (h2d stream), and a tier that is not addressable reads ahead
  // and writes behind as with Pipelined. in[b] marks a chunk's gradients landed; out[b] its
  // params gone, after which buffer b may take chunk k + B.
  constexpr unsigned B      = Transfer::staging_buffers;
  constexpr bool staged     = !addressable_tier<StateTier>;
  auto& d                   = *dev_;
  std::size_t const n       = layout_->chunk_count();
  std::size_t const bytes   = layout_->chunk_bytes();
  std::size_t const ce      = layout_->chunk_elements();
  std::size_t const grain   = 64 * host::batch_size<arch>;
  auto* const grad_ring     = reinterpret_cast<grad_type*>(d.grad_stage.data());
  auto* const param_ring    = reinterpret_cast<param_type*>(d.param_stage.data());
  std::vector<std::uint64_t> read_ticket(n);

  auto fetch = [&](std::size_t j) {
    unsigned const b = static_cast<unsigned>(j % B);
    if (j >= B) { d.out[b].synchronize(); }  // chunk j - B's params have left this buffer
    for (std::size_t p = chunk_pieces_[j]; p < chunk_pieces_[j + 1]; ++p) {
      auto const& pc = pieces_[p];
      auto const& g  = grads[pc.tensor];
      if (g.where == location::device) {
        device::copy_async(grad_ring + b * ce + pc.chunk_begin, g.data + pc.tensor_begin,
                           pc.count * sizeof(grad_type), d.d2h);
        stats.d2h_bytes += pc.count * sizeof(grad_type);
      }
      if constexpr (!Precision::has_master) {  // the param is its own master: it comes too
        auto const& t = tensors_[pc.tensor];
        if (t.where == location::device) {
          device::copy_async(param_ring + b * ce + pc.chunk_begin, t.param + pc.tensor_begin,
                             pc.count * sizeof(param_type), d.d2h);
          stats.d2h_bytes += pc.count * sizeof(param_type);
        }
      }
    }
    d.in[b].record(d.d2h);
    if constexpr (staged) {
      read_ticket[j] = io_->enqueue({j * bytes, staging(b), bytes, false}, b);
      stats.tier_bytes_read += bytes;
    }
  };

  try {
    for (std::size_t j = 0; j < std::min<std::size_t>(n, Transfer::depth + 1); ++j) { fetch(j); }
    for (std::size_t k = 0; k < n; ++k) {
      unsigned const b = static_cast<unsigned>(k % B);
      auto t0          = std::chrono::steady_clock::now();
      if constexpr (staged) { io_->wait(read_ticket[k]); }
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
        if (t.where == location::device) {
          device::copy_async(t.param + pc.tensor_begin, param_ring + b * ce + pc.chunk_begin,
                             pc.count * sizeof(param_type), d.h2d);
          stats.h2d_bytes += pc.count * sizeof(param_type);
        }
      }
      d.out[b].record(d.h2d);
      ++stats.chunks;
      if (k + Transfer::depth + 1 < n) { fetch(k + Transfer::depth + 1); }
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

TIERSTATE_OPTIMIZER_TEMPLATE
void TIERSTATE_OPTIMIZER::step_streamed_to_device(std::span<grad_view<grad_type> const> grads,
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

  auto device_chunk = [&](std::size_t j) { return d.state_stage + (j % B) * bytes; };
  auto host_chunk   = [&](std::size_t j) -> std::byte* {
    if constexpr (staged) {
      return staging(static_cast<unsigned>(j % B));
    } else {
      return tier_->data() + j * bytes;
    }
  };
  auto read = [&](std::size_t j) {
    if constexpr (staged) {
      read_ticket[j] = io_->enqueue({j * bytes, host_chunk(j), bytes, false}, static_cast<unsigned>(j % B));
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
      io_->enqueue({j * bytes, host_chunk(j), bytes, true}, b);
      stats.tier_bytes_written += bytes;
    }
  };

  try {
    for (std::size_t j = 0; j < std::min<std::size_t>(n, Transfer::depth + 1); ++j) { read(j); }
    if (n > 0) { upload(0); }
    for (std::size_t k = 0; k < n; ++k) {
      unsigned const b = static_cast<unsigned>(k % B);
      if (k + 1 < n) { upload(k + 1); }
      d.compute.wait(d.in[b]);
      changed = true;
      launch_chunk(k, device_chunk(k), grads, coefficients);
      d.computed[b].record(d.compute);
      d.d2h.wait(d.computed[b]);
      device::copy_async(host_chunk(k), device_chunk(k), bytes, d.d2h);
      d.out[b].record(d.d2h);
      stats.d2h_bytes += bytes;
      if constexpr (!staged) { stats.tier_bytes_in_place += bytes; }
      ++stats.chunks;
      if (k >= 1) { write_back(k - 1); }
      if (k + Transfer::depth + 1 < n) { read(k + Transfer::depth + 1); }
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

TIERSTATE_OPTIMIZER_TEMPLATE
void TIERSTATE_OPTIMIZER::check_not_lost(char const* call) const
{
  if (!lost_.empty()) { throw tierstate::state_lost(call, lost_); }
}

TIERSTATE_OPTIMIZER_TEMPLATE
void TIERSTATE_OPTIMIZER::copy_state(std::string_view tensor, slot s, std::span<float> to)
{
  check_not_lost("copy_state");
  std::size_t const t = find_tensor(tensor, "copy_state");
  materialize();
  std::size_t const si = layout_->slot_index(s);
  auto const& ext      = layout_->tensors()[t];
  if (to.size() != ext.count) {
    throw logic_error("copy_state('" + ext.name + "'): the span has " + std::to_string(to.size()) +
                      " elements; the tensor has " + std::to_string(ext.count));
  }
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

TIERSTATE_OPTIMIZER_TEMPLATE
void TIERSTATE_OPTIMIZER::write_state(std::string_view tensor, slot s, std::span<float const> from)
{
  check_not_lost("write_state");
  std::size_t const t = find_tensor(tensor, "write_state");
  materialize();
  std::size_t const si = layout_->slot_index(s);
  auto const& ext      = layout_->tensors()[t];
  if (from.size() != ext.count) {
    throw logic_error("write_state('" + ext.name + "'): the span has " + std::to_string(from.size()) +
                      " elements; the tensor has " + std::to_string(ext.count));
  }
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

TIERSTATE_OPTIMIZER_TEMPLATE
layout const& TIERSTATE_OPTIMIZER::state_layout()
{
  materialize();
  return *layout_;
}

TIERSTATE_OPTIMIZER_TEMPLATE
StateTier& TIERSTATE_OPTIMIZER::state_tier()
{
  materialize();
  return *tier_;
}

#undef TIERSTATE_OPTIMIZER_TEMPLATE
#undef TIERSTATE_OPTIMIZER

}  // namespace tierstate
