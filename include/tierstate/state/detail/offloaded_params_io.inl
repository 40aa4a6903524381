// SPDX-License-Identifier: Apache-2.0
// offloaded_params' tier side (state/offloaded_params.hpp): making the tier and the buffers,
// the I/O thread (reads into buffers, writes behind), and read, write and flush (the
// gradients' side: offloaded_params_grads.inl).
#pragma once

#include <algorithm>
#include <cstring>
#include <utility>

namespace tierstate::inline TIERSTATE_ABI {

template <class Param, tier Tier>
void offloaded_params<Param, Tier>::make_locked()
{
  auto const round_up = [](std::size_t n, std::size_t a) { return (n + a - 1) / a * a; };
  // Each layer's tensors packed, 64-byte aligned, the layer 4 KiB-aligned: one read a layer.
  std::size_t tier_bytes = 0, buffer_bytes = 0, resident_count = 0;
  for (auto& l : layers_) {
    l.offset       = tier_bytes;
    std::size_t at = 0;
    for (auto const t : l.tensors) {
      auto& e = tensors_[t];
      if (e.resident) {
        e.offset = resident_count;
        resident_count += round_up(e.count, tensor_alignment);  // (elements: every start stays aligned)
        continue;
      }
      at       = round_up(at, tensor_alignment);
      e.offset = l.offset + at;
      at += e.count * sizeof(Param);
    }
    l.bytes = round_up(at, tier_alignment);
    tier_bytes += l.bytes;
    buffer_bytes = std::max(buffer_bytes, l.bytes);
  }
  std::unique_ptr<Tier> tier;
  if (tier_bytes > 0) { tier = std::make_unique<Tier>(tier_bytes, opts_.tier); }
  std::vector<buffer> buffers(buffer_bytes > 0 ? opts_.window + 1 : 0);
  std::vector<Param> resident;
  Param* resident_device = nullptr;
  std::vector<layer_id> expected;
  std::thread io;
  try {
    for (auto& b : buffers) { b.data = static_cast<std::byte*>(resource_->allocate(buffer_bytes, tier_alignment)); }
    // The values, then what held views show (with device buffers, device copies instead).
    resident.assign((opts_.where == location::device ? 1 : 2) * resident_count, Param{});
    if (opts_.where == location::device && (!buffers.empty() || resident_count > 0)) {
      if (!stream_) { stream_.emplace(); }
      for (auto& b : buffers) { b.released = std::make_unique<device::event>(); }
      if constexpr (!addressable_tier<Tier>) { staging_ = std::make_unique<PinnedHost>(buffer_bytes); }
    }
    if (opts_.where == location::device && resident_count > 0) {  // what views of resident tensors show
      resident_device = static_cast<Param*>(resource_->allocate(resident_count * sizeof(Param), tier_alignment));
      for (auto& l : layers_) {
        bool const any = std::any_of(l.tensors.begin(), l.tensors.end(), [&](tensor_id t) { return tensors_[t].resident; });
        if (any && !l.resident_released) { l.resident_released = std::make_unique<device::event>(); }
      }
    }
    // The first iteration: forward, then backward.
    for (layer_id l = 0; l < layers_.size(); ++l) { expected.push_back(l); }
    for (layer_id l = layers_.size(); l-- > 0;) { expected.push_back(l); }
    // (It waits for mu_, held here, before it looks at anything.)
    if (!buffers.empty()) { io = std::thread([this] { io_loop(); }); }
  } catch (...) {
    for (auto& b : buffers) {
      if (b.data != nullptr) { resource_->deallocate(b.data, buffer_bytes, tier_alignment); }
    }
    if (resident_device != nullptr) {
      resource_->deallocate(resident_device, resident_count * sizeof(Param), tier_alignment);
    }
    throw;
  }
  tier_           = std::move(tier);
  buffers_        = std::move(buffers);
  resident_       = std::move(resident);
  resident_device_ = resident_device;
  tier_bytes_     = tier_bytes;
  buffer_bytes_   = buffer_bytes;
  resident_count_ = resident_count;
  if (opts_.keep_grads) { resident_grads_.assign(resident_count, Param{}); }
  expected_       = std::move(expected);
  io_             = std::move(io);
  made_           = true;
  read_ahead();
}

template <class Param, tier Tier>
void offloaded_params<Param, Tier>::io_loop()
{
  std::unique_lock lk(mu_);
  for (;;) {
    auto startable = jobs_.end();
    cv_.wait(lk, [&] {
      startable = std::find_if(jobs_.begin(), jobs_.end(), [&](read_job const& j) { return layers_[j.layer].writers == 0; });
      return stopping_ || !writes_.empty() || startable != jobs_.end();
    });
    if (!writes_.empty()) {  // writes behind first, in order: the reads of their layers wait for them
      write_job w = std::move(writes_.front());
      writes_.pop_front();
      ++writing_;
      lk.unlock();
      std::exception_ptr failure;
      try {
        std::lock_guard tk(tier_mu_);
        write_staged(*tier_, w.bytes);
      } catch (...) {
        failure = std::current_exception();
      }
      lk.lock();
      --writing_;
      --layers_[w.id].writers;
      behind_bytes_ -= w.bytes.n;
      if (failure) {
        if (!write_failure_) { write_failure_ = failure; }
      } else {
        stats_.bytes_written += w.bytes.size;
      }
      read_ahead();
      cv_.notify_all();
      continue;
    }
    if (stopping_) { return; }
    read_job const job = *startable;
    jobs_.erase(startable);
    auto& l = layers_[job.layer];
    auto& b = buffers_[job.buffer];
    b.version = l.version;  // no write is in progress: the read sees every write so far
    std::size_t const offset = l.offset, bytes = l.bytes;
    lk.unlock();
    std::exception_ptr failure;
    try {
      fill_buffer(b, offset, bytes);
    } catch (...) {
      failure = std::current_exception();
    }
    lk.lock();
    ++stats_.reads;
    stats_.bytes_read += bytes;
    if (failure) {
      l.failure = failure;
      ++stats_.failed_reads;
      drop(job.buffer);
    } else if (l.version != b.version) {
      ++stats_.discarded;  // a write began meanwhile: read it again
      drop(job.buffer);
    } else {
      b.state = buffer_state::ready;
    }
    read_ahead();
    cv_.notify_all();
  }
}

template <class Param, tier Tier>
void offloaded_params<Param, Tier>::fill_buffer(buffer& b, std::size_t offset, std::size_t bytes)
{
  if (opts_.where == location::host) {
    std::lock_guard tk(tier_mu_);
    tier_->read(offset, {b.data, bytes});
    return;
  }
  // Device buffers: up from the tier's memory, or through one layer of pinned staging, once
  // the work that read the buffer's last layer is done; waited for, so that the buffer is
  // ready (and the staging free) when this returns. The tier is held only while it is read:
  // by the copy itself from its memory, by the read into the staging otherwise.
  stream_->wait(*b.released);
  device::event up;
  if constexpr (addressable_tier<Tier>) {
    std::lock_guard tk(tier_mu_);
    device::copy_async(b.data, tier_->data() + offset, bytes, *stream_);
    up.record(*stream_);
    up.synchronize();
  } else {
    {
      std::lock_guard tk(tier_mu_);
      tier_->read(offset, {staging_->data(), bytes});
    }
    device::copy_async(b.data, staging_->data(), bytes, *stream_);
    up.record(*stream_);
    up.synchronize();
  }
}


template <class Param, tier Tier>
void offloaded_params<Param, Tier>::read(tensor_id t, std::size_t offset, std::span<Param> to)
{
  check_range(t, offset, to.size(), "read");
  std::unique_lock lk(mu_);
  if (!made_) { make_locked(); }
  auto const& e = tensors_[t];
  if (e.resident) {
    std::copy_n(resident_.data() + e.offset + offset, to.size(), to.data());
    return;
  }
  cv_.wait(lk, [&] { return layers_[e.layer].writers == 0; });  // (its writes behind are in the tier)
  lk.unlock();
  std::lock_guard tk(tier_mu_);
  tier_->read(e.offset + offset * sizeof(Param), std::as_writable_bytes(to));
}

template <class Param, tier Tier>
void offloaded_params<Param, Tier>::flush()
{
  std::unique_lock lk(mu_);
  cv_.wait(lk, [&] { return writes_.empty() && writing_ == 0; });
  if (write_failure_) { std::rethrow_exception(std::exchange(write_failure_, nullptr)); }
}

template <class Param, tier Tier>
void offloaded_params<Param, Tier>::write(tensor_id t, std::size_t offset, std::span<Param const> from)
{
  check_range(t, offset, from.size(), "write");
  if (from.empty()) { return; }
  std::unique_lock lk(mu_);
  if (!made_) { make_locked(); }
  auto const& e = tensors_[t];
  auto& l       = layers_[e.layer];
  if (e.resident) {  // (a view held shows its own copy, made at acquire)
    std::copy_n(from.data(), from.size(), resident_.data() + e.offset + offset);
    l.resident_stale = true;  // (device buffers: copied up again at the next acquire)
    return;
  }
  std::size_t const at = e.offset + offset * sizeof(Param);
  if (opts_.write_behind_bytes > 0 && io_.joinable()) {
    // Behind: a copy, queued for the I/O thread; room for it first (or none behind at all).
    // (counted as staged: whole blocks)
    std::size_t const staged = staged_bytes(at, from.size_bytes());
    cv_.wait(lk, [&] { return behind_bytes_ == 0 || behind_bytes_ + staged <= opts_.write_behind_bytes; });
    writes_.push_back({e.layer, stage(at, std::as_bytes(from))});
    behind_bytes_ += staged;
    ++l.writers;
    ++l.version;  // a read in flight is thrown away; a buffer holding the layer is old
    if (l.buffer >= 0 && buffers_[l.buffer].state == buffer_state::ready) { drop(l.buffer); }
    read_ahead();  // (a layer expected soon is read again at once: the read waits for the write)
    cv_.notify_all();
    return;
  }
  ++l.writers;
  ++l.version;  // a read in flight is thrown away; a buffer holding the layer is old
  if (l.buffer >= 0 && buffers_[l.buffer].state == buffer_state::ready) { drop(l.buffer); }
  lk.unlock();
  std::exception_ptr failure;
  try {
    staged_write w;
    if (at % write_alignment == 0 && from.size_bytes() % write_alignment == 0 &&
        reinterpret_cast<std::uintptr_t>(from.data()) % write_alignment == 0) {
      std::lock_guard tk(tier_mu_);
      tier_->write(at, std::as_bytes(from));  // whole blocks from aligned memory: as they are
    } else {
      w = stage(at, std::as_bytes(from));
      std::lock_guard tk(tier_mu_);
      write_staged(*tier_, w);
    }
  } catch (...) {
    failure = std::current_exception();
  }
  lk.lock();
  --l.writers;
  if (!failure) { stats_.bytes_written += from.size_bytes(); }
  read_ahead();
  cv_.notify_all();
  if (failure) { std::rethrow_exception(failure); }
}

template <class Param, tier Tier>
auto offloaded_params<Param, Tier>::stage(std::size_t at, std::span<std::byte const> from) -> staged_write
{
  staged_write w;
  w.at   = at;
  w.size = from.size();
  w.lo   = at / write_alignment * write_alignment;
  w.n    = staged_bytes(at, from.size());
  w.buffer.reset(static_cast<std::byte*>(::operator new(std::max<std::size_t>(w.n, 1),
                                                        std::align_val_t{buffer_alignment})));
  std::memcpy(w.buffer.get() + (at - w.lo), from.data(), from.size());
  return w;
}

template <class Param, tier Tier>
void offloaded_params<Param, Tier>::write_staged(Tier& tier, staged_write& w)
{
  // A tier with an alignment (NvmeFile: O_DIRECT) is written in whole blocks: the first and
  // last blocks' bytes outside the values come from the tier, read into a block of their own
  // (the values already fill the rest), and the range is written at once.
  constexpr std::size_t a = write_alignment;
  std::byte* const buf    = w.buffer.get();
  std::size_t const head  = w.at - w.lo;                // bytes of the first block before the values
  std::size_t const tail  = w.lo + w.n - w.at - w.size;  // bytes of the last block after them
  if (head > 0 || tail > 0) {
    std::unique_ptr<std::byte, aligned_delete> const block(
      static_cast<std::byte*>(::operator new(a, std::align_val_t{buffer_alignment})));
    if (head > 0) {
      tier.read(w.lo, {block.get(), a});
      std::memcpy(buf, block.get(), head);
    }
    if (tail > 0) {
      if (head == 0 || w.n > a) { tier.read(w.lo + w.n - a, {block.get(), a}); }  // (one block: read above)
      std::memcpy(buf + w.n - tail, block.get() + a - tail, tail);
    }
  }
  tier.write(w.lo, {buf, w.n});
}

}  // namespace tierstate
