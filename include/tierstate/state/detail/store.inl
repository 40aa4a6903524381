// SPDX-License-Identifier: Apache-2.0
// The state store's definitions (state/store.hpp): the layout, making the state, chunk
// access and the slot reads and writes of copy_state and write_state.
#pragma once

namespace tierstate::inline TIERSTATE_ABI::detail {

template <class Precision, class Rule, tier StateTier, class Placement>
tierstate::layout state_store<Precision, Rule, StateTier, Placement>::layout_for(
  std::span<tensor_entry const> tensors, std::size_t chunk_elements)
{
  if (tensors.empty()) { throw logic_error("no tensor is registered: add_tensor first"); }
  std::vector<tensor_extent> extents;
  for (auto const& t : tensors) { extents.push_back({t.name, 0, t.count}); }
  std::vector<slot> slots;
  std::vector<slot_format> formats;
  if constexpr (Precision::leading_slots == 1) {
    slots.push_back(Precision::leading_slot);
    formats.push_back({Precision::leading_codec::block, Precision::leading_codec::block_bytes,
                       Precision::leading_codec::name});
  }
  [&]<std::size_t... J>(std::index_sequence<J...>) {
    ((slots.push_back(Rule::slots[J]), formats.push_back({Precision::template state_codec<J>::block,
                                                          Precision::template state_codec<J>::block_bytes,
                                                          Precision::template state_codec<J>::name})),
     ...);
  }(std::make_index_sequence<Rule::slots.size()>{});
  // A model smaller than one chunk gets one chunk of its own size (rounded up to the 4 KiB
  // granularity), not a mostly empty chunk of the requested size.
  constexpr std::size_t align = detail::state_block_v<Precision, Rule::slots.size()>;
  std::size_t total = 0;
  for (auto const& t : tensors) { total = (total + align - 1) / align * align + t.count; }
  std::size_t const g         = tierstate::layout::element_granularity;
  std::size_t const requested = chunk_elements != 0 ? chunk_elements : tierstate::layout::default_chunk_elements;
  std::size_t const chunk     = std::min(requested, std::max(g, (total + g - 1) / g * g));
  return tierstate::layout(std::move(extents), chunk, std::move(slots), std::move(formats));
}

template <class Precision, class Rule, tier StateTier, class Placement>
void state_store<Precision, Rule, StateTier, Placement>::make(std::span<tensor_entry const> tensors,
                                                              typename StateTier::options const& tier_options,
                                                              std::size_t chunk_elements, bool fill,
                                                              bool shadow, progress_callback const& progress,
                                                              int numa_node)
{
  if (layout_) { return; }
  tierstate::layout lay = layout_for(tensors, chunk_elements);

  // Each tensor cut at chunk boundaries.
  std::vector<piece> pieces;
  std::vector<std::size_t> chunk_pieces(lay.chunk_count() + 1, 0);
  std::size_t const ce = lay.chunk_elements();
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    std::size_t e         = lay.tensors()[t].offset;
    std::size_t const end = e + tensors[t].count;
    while (e < end) {
      std::size_t const k = e / ce;
      std::size_t const n = std::min(end, (k + 1) * ce) - e;
      pieces.push_back({t, e - lay.tensors()[t].offset, e % ce, n});
      ++chunk_pieces[k + 1];
      e += n;
    }
  }
  for (std::size_t k = 0; k < lay.chunk_count(); ++k) { chunk_pieces[k + 1] += chunk_pieces[k]; }

  auto const placed = [&] {  // a PinnedHost state on the optimizer's node where its own names none
    if constexpr (std::is_same_v<StateTier, PinnedHost>) {
      auto o = tier_options;
      if (o.numa_node == -1) { o.numa_node = numa_node; }
      return o;
    } else {
      return tier_options;
    }
  };
  StateTier tier(lay.total_bytes() * (shadow ? 2 : 1), placed());
  std::optional<PinnedHost> staging;
  if constexpr (Placement::host_staging_chunks > 0) {
    staging.emplace(Placement::host_staging_chunks * lay.chunk_bytes(), PinnedHost::options{.numa_node = numa_node});
  }
  std::unique_ptr<device_resources> dev;
  if constexpr (Placement::device != routes::device_staging::none) {
    dev = std::make_unique<device_resources>();
    std::size_t const B = Placement::buffers;
    if constexpr (Placement::device == routes::device_staging::pcie_rings) {
      dev->grad_stage  = PinnedHost(B * lay.chunk_elements() * sizeof(typename Precision::grad_type));
      dev->param_stage = PinnedHost(B * lay.chunk_elements() * sizeof(param_type));
    } else {
      dev->nonfinite_flag =
        static_cast<std::uint32_t*>(device::allocate_async(sizeof(std::uint32_t), dev->compute));
      if constexpr (Placement::device == routes::device_staging::on_device_streamed) {
        dev->state_stage_bytes = B * lay.chunk_bytes();
        dev->state_stage = static_cast<std::byte*>(device::allocate_async(dev->state_stage_bytes, dev->compute));
      }
      dev->compute.synchronize();
    }
  }

  layout_ = std::move(lay);
  tier_.emplace(std::move(tier));
  staging_      = std::move(staging);
  pieces_       = std::move(pieces);
  chunk_pieces_ = std::move(chunk_pieces);
  dev_          = std::move(dev);
  place_.assign(shadow ? layout_->chunk_count() : 0, 0);
  written_.assign(place_.size(), 0);
  shadowing_ = false;
  // If anything fails from here on (the I/O thread, the tier on the way through the master),
  // the store goes back to having no state, so the next call starts over instead of stepping
  // on a half-made one.
  try {
    if constexpr (Placement::tier_takes_staging) {
      if (staging_) { (void)tier_->register_staging({staging_->data(), staging_->size()}); }  // refusal is announced
    }
    if constexpr (Placement::io_thread) { io_ = std::make_unique<detail::io_worker<StateTier>>(*tier_); }
    if constexpr (Precision::has_master) {
      if (fill) { fill_master(tensors, progress); }
    } else {
      (void)fill, (void)progress;
    }
  } catch (...) {
    discard();
    throw;
  }
}

template <class Precision, class Rule, tier StateTier, class Placement>
void state_store<Precision, Rule, StateTier, Placement>::fill_master(std::span<tensor_entry const> tensors,
                                                                     progress_callback const& progress)
{
  std::uint64_t const total = layout_->total_bytes();
  step_stats ignored;
  std::vector<param_type> params;  // device params, copied to the host
  for (std::size_t k = 0; k < layout_->chunk_count(); ++k) {
    with_chunk(k, true, ignored, [&](std::byte* chunk) {
      auto* master = reinterpret_cast<float*>(chunk + layout_->slot_offset(0));
      for (auto const& pc : pieces(k)) {
        auto const& t         = tensors[pc.tensor];
        param_type const* src = nullptr;
        if (t.source != nullptr) {  // offloaded params
          params.resize(pc.count);
          t.source->read(t.source_tensor, pc.tensor_begin, params);
          src = params.data();
        } else if (t.where == location::device) {
          params.resize(pc.count);
          device::copy(params.data(), t.param + pc.tensor_begin, pc.count * sizeof(param_type));
          src = params.data();
        } else {
          src = t.param + pc.tensor_begin;
        }
        for (std::size_t i = 0; i < pc.count; ++i) { master[pc.chunk_begin + i] = convert<float>(src[i]); }
      }
    });
    if (progress) { progress(progress_phase::make_state, std::uint64_t{k + 1} * layout_->chunk_bytes(), total); }
  }
}

template <class Precision, class Rule, tier StateTier, class Placement>
void state_store<Precision, Rule, StateTier, Placement>::discard() noexcept
{
  keep_held_staging();
  dev_.reset();
  io_.reset();
  tier_.reset();
  layout_.reset();
  pieces_.clear();
  chunk_pieces_.clear();
  staging_.reset();
  place_.clear();
  written_.clear();
  shadowing_ = false;
}

template <class Precision, class Rule, tier StateTier, class Placement>
void state_store<Precision, Rule, StateTier, Placement>::keep_held_staging() noexcept
{
  if constexpr (Placement::tier_engine_may_hold) {
    if (tier_ && !tier_->engine().usable() && staging_) { staging_->abandon(); }
  }
}

template <class Precision, class Rule, tier StateTier, class Placement>
template <class F>
void state_store<Precision, Rule, StateTier, Placement>::with_chunk(std::size_t k, bool write_back,
                                                                    step_stats& stats, F&& f)
{
  std::size_t const bytes  = layout_->chunk_bytes();
  std::size_t const offset = chunk_offset(k);
  if constexpr (Placement::tier_in_host_memory) {
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

template <class Precision, class Rule, tier StateTier, class Placement>
template <class F>
void state_store<Precision, Rule, StateTier, Placement>::visit_codec(std::size_t si, F&& f)
{
  constexpr std::size_t first = Precision::leading_slots;
  if (Precision::leading_slots == 1 && si == 0) {
    f(std::type_identity<typename Precision::leading_codec>{});
    return;
  }
  [&]<std::size_t... J>(std::index_sequence<J...>) {
    ((si == first + J ? (f(std::type_identity<typename Precision::template state_codec<J>>{}), 0) : 0), ...);
  }(std::make_index_sequence<Rule::slots.size()>{});
}

template <class Precision, class Rule, tier StateTier, class Placement>
void state_store<Precision, Rule, StateTier, Placement>::read_slot(std::size_t t, std::size_t si,
                                                                   std::span<float> to)
{
  auto const& ext = layout_->tensors()[t];
  std::size_t const ce = layout_->chunk_elements();
  visit_codec(si, [&]<class C>(std::type_identity<C>) {
    std::vector<std::byte> buf;
    std::size_t done = 0;
    while (done < ext.count) {  // a piece of the tensor per chunk; each starts on a block
      std::size_t const e      = ext.offset + done;
      std::size_t const n      = std::min(ext.count - done, ce - e % ce);
      std::size_t const blocks = (n + C::block - 1) / C::block;
      buf.resize(blocks * C::block_bytes);
      tier_->read(layout_->byte_offset(si, e) - (e / ce) * layout_->chunk_bytes() + chunk_offset(e / ce), buf);
      for (std::size_t b = 0; b < blocks; ++b) {
        std::byte const* from = buf.data() + b * C::block_bytes;
        if constexpr (block_codec<C>) {
          C::decode(from, &to[done + b * C::block], std::min(C::block, n - b * C::block));
        } else {
          typename C::element_type v;
          std::memcpy(&v, from, sizeof(v));
          to[done + b] = convert<float>(v);
        }
      }
      done += n;
    }
  });
}

template <class Precision, class Rule, tier StateTier, class Placement>
void state_store<Precision, Rule, StateTier, Placement>::write_slot(std::size_t t, std::size_t si,
                                                                    std::span<float const> from)
{
  auto const& ext = layout_->tensors()[t];
  std::size_t const ce = layout_->chunk_elements();
  visit_codec(si, [&]<class C>(std::type_identity<C>) {
    std::vector<std::byte> buf;
    std::size_t done = 0;
    while (done < ext.count) {
      std::size_t const e      = ext.offset + done;
      std::size_t const n      = std::min(ext.count - done, ce - e % ce);
      std::size_t const blocks = (n + C::block - 1) / C::block;
      buf.assign(blocks * C::block_bytes, std::byte{0});
      for (std::size_t b = 0; b < blocks; ++b) {
        std::byte* to = buf.data() + b * C::block_bytes;
        if constexpr (block_codec<C>) {
          // (a tensor's last block is encoded from its own elements alone: the rest of the
          // block is padding that belongs to no tensor)
          C::encode(&from[done + b * C::block], std::min(C::block, n - b * C::block), to);
        } else {
          auto const v = convert<typename C::element_type>(from[done + b]);
          std::memcpy(to, &v, sizeof(v));
        }
      }
      try {
        tier_->write(layout_->byte_offset(si, e) - (e / ce) * layout_->chunk_bytes() + chunk_offset(e / ce), buf);
      } catch (std::exception const& x) {
        lost_ = x.what();  // a failed write may have landed in part
        throw;
      }
      done += n;
    }
  });
}

template <class Precision, class Rule, tier StateTier, class Placement>
void state_store<Precision, Rule, StateTier, Placement>::params_from_master(
  std::size_t k, std::byte const* chunk, std::span<tensor_entry const> tensors, std::span<char const> only) const
{
  if constexpr (Precision::has_master) {
    auto const* master = reinterpret_cast<float const*>(chunk + layout_->slot_offset(0));
    std::vector<param_type> staged;  // for params on the device, or offloaded
    for (auto const& pc : pieces(k)) {
      if (!only.empty() && only[pc.tensor] == 0) { continue; }
      auto const& t   = tensors[pc.tensor];
      param_type* dst = nullptr;
      if (t.where == location::device || t.source != nullptr) {
        staged.resize(pc.count);
        dst = staged.data();
      } else {
        dst = t.param + pc.tensor_begin;
      }
      for (std::size_t i = 0; i < pc.count; ++i) { dst[i] = convert<param_type>(master[pc.chunk_begin + i]); }
      if (t.source != nullptr) {
        t.source->write(t.source_tensor, pc.tensor_begin, staged);
      } else if (t.where == location::device) {
        device::copy(t.param + pc.tensor_begin, staged.data(), pc.count * sizeof(param_type));
      }
    }
  } else {
    (void)k, (void)chunk, (void)tensors, (void)only;
  }
}

}  // namespace tierstate::detail
