// SPDX-License-Identifier: Apache-2.0
// The optimizer's state: its layout, making it in the tier (materialize), chunk access, the
// state-access calls (copy_state, write_state, set_step_count) and lost state.
#pragma once

namespace tierstate::inline TIERSTATE_ABI {

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
std::size_t OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::staging_bytes() const noexcept
{
  return (staging_ ? staging_->size() : 0) + (dev_ ? dev_->grad_stage.size() + dev_->param_stage.size() : 0);
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
std::size_t OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::device_staging_bytes() const noexcept
{
  return dev_ ? dev_->state_stage_bytes : 0;
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
auto OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::update_params(std::size_t t) const noexcept -> param_type*
{
  return delayed_ ? reinterpret_cast<param_type*>(delayed_->params.data()) + layout_->tensors()[t].offset
                  : tensors_[t].param;
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
bool OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::update_params_on_device(std::size_t t) const noexcept
{
  return !delayed_ && tensors_[t].where == location::device;
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::keep_held_staging() noexcept
{
  if constexpr (requires(StateTier const& t) { { t.engine().usable() } -> std::convertible_to<bool>; }) {
    if (tier_ && !tier_->engine().usable() && staging_) { staging_->abandon(); }
  }
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
std::byte* OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::staging(std::size_t buffer) noexcept
{
  return staging_->data() + buffer * layout_->chunk_bytes();
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
  if constexpr (routes::detail::tier_io<OffloadedOptimizer>::threaded) {  // transfer/concept.hpp
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
