// SPDX-License-Identifier: Apache-2.0
// offloaded_params' members (state/offloaded_params.hpp).
#pragma once

#include <algorithm>
#include <cstring>
#include <utility>

namespace tierstate::inline TIERSTATE_ABI {

namespace detail {
inline std::string layer_text(std::size_t l, std::string const& name)
{
  std::string text = "layer ";
  text.append(std::to_string(l)).append(" '").append(name).append("'");
  return text;
}
}  // namespace detail

template <class Param, tier Tier>
offloaded_params<Param, Tier>::offloaded_params(options const& o) : opts_(o)
{
  if (o.window < 1 || o.window > 64) {
    throw invalid_option("offloaded_params.window", std::to_string(o.window),
                         "the layers read ahead of the one in use must be 1 to 64");
  }
  if constexpr (preflight_tier<Tier>) { Tier::preflight(o.tier); }
  resource_ = o.buffers != nullptr                 ? o.buffers
              : o.where == location::device        ? static_cast<std::pmr::memory_resource*>(&default_device_memory_resource())
                                                   : std::pmr::new_delete_resource();
}

template <class Param, tier Tier>
offloaded_params<Param, Tier>::~offloaded_params()
{
  {
    std::lock_guard lk(mu_);
    stopping_ = true;  // (the I/O thread writes what is behind first)
  }
  cv_.notify_all();
  if (io_.joinable()) { io_.join(); }
  if (grad_io_.joinable()) { grad_io_.join(); }
  try {  // (device memory: the trainer's work queued at release is done with it)
    for (auto& b : buffers_) {
      if (b.released) { b.released->synchronize(); }
    }
    for (auto& l : layers_) {
      if (l.resident_released) { l.resident_released->synchronize(); }
    }
  } catch (...) {  // a failure was the trainer's work's to report
  }
  for (auto& b : buffers_) { resource_->deallocate(b.data, buffer_bytes_, tier_alignment); }
  if (resident_device_ != nullptr) {
    resource_->deallocate(resident_device_, resident_count_ * sizeof(Param), tier_alignment);
  }
}

template <class Param, tier Tier>
auto offloaded_params<Param, Tier>::add_layer(std::string name) -> layer_id
{
  std::lock_guard lk(mu_);
  TIERSTATE_EXPECTS(!made_, "offloaded_params::add_layer('" + name + "'): the tier is made already; register "
                            "every layer and tensor before the first acquire, read, write or materialize");
  layers_.push_back({});
  layers_.back().name = std::move(name);
  return layers_.size() - 1;
}

template <class Param, tier Tier>
auto offloaded_params<Param, Tier>::add_tensor(layer_id layer, std::string name, std::size_t count) -> tensor_id
{
  std::lock_guard lk(mu_);
  TIERSTATE_EXPECTS(!made_, "offloaded_params::add_tensor('" + name + "'): the tier is made already; register "
                            "every layer and tensor before the first acquire, read, write or materialize");
  TIERSTATE_EXPECTS(layer < layers_.size(), "offloaded_params::add_tensor('" + name + "'): layer " +
                                              std::to_string(layer) + " was not added (there are " +
                                              std::to_string(layers_.size()) + ")");
  TIERSTATE_EXPECTS(count > 0, "offloaded_params::add_tensor('" + name + "'): a tensor needs at least one element");
  TIERSTATE_EXPECTS(!index_.contains(name), "offloaded_params::add_tensor('" + name + "'): the name is taken");
  tensor_entry t;
  t.name     = name;
  t.layer    = layer;
  t.count    = count;
  t.resident = count < opts_.persistence_threshold;
  tensor_id const id = tensors_.size();
  tensors_.reserve(id + 1);  // (so that nothing below throws once the name is in)
  layers_[layer].tensors.reserve(layers_[layer].tensors.size() + 1);
  index_.emplace(std::move(name), id);
  tensors_.push_back(std::move(t));
  layers_[layer].tensors.push_back(id);
  return id;
}

template <class Param, tier Tier>
void offloaded_params<Param, Tier>::materialize()
{
  std::lock_guard lk(mu_);
  if (!made_) { make_locked(); }
}

template <class Param, tier Tier>
auto offloaded_params<Param, Tier>::upcoming() const -> std::vector<layer_id>
{
  std::vector<layer_id> next;
  for (std::size_t p = cursor_; p < expected_.size() && next.size() < opts_.window; ++p) {
    layer_id const l = expected_[p];
    if (layers_[l].bytes > 0 && std::find(next.begin(), next.end(), l) == next.end()) { next.push_back(l); }
  }
  return next;
}

template <class Param, tier Tier>
int offloaded_params<Param, Tier>::take_buffer(std::vector<layer_id> const& keep, bool force)
{
  for (std::size_t b = 0; b < buffers_.size(); ++b) {
    if (buffers_[b].state == buffer_state::free) { return static_cast<int>(b); }
  }
  for (int pass = 0; pass < (force ? 2 : 1); ++pass) {
    for (std::size_t b = 0; b < buffers_.size(); ++b) {
      auto const& buf = buffers_[b];
      if (buf.state != buffer_state::ready || layers_[buf.layer].wanted) { continue; }
      if (pass == 0 && std::find(keep.begin(), keep.end(), buf.layer) != keep.end()) { continue; }
      ++stats_.evicted;
      drop(static_cast<int>(b));
      return static_cast<int>(b);
    }
  }
  return -1;
}

template <class Param, tier Tier>
void offloaded_params<Param, Tier>::start_read(layer_id l, int b, bool front)
{
  buffers_[b].state   = buffer_state::reading;
  buffers_[b].layer   = l;
  buffers_[b].version = layers_[l].version;
  layers_[l].buffer   = b;
  read_job const job{l, b};
  if (front) {
    jobs_.push_front(job);
  } else {
    jobs_.push_back(job);
  }
  cv_.notify_all();
}

template <class Param, tier Tier>
void offloaded_params<Param, Tier>::read_ahead()
{
  if (buffers_.empty() || stopping_) { return; }
  auto const next = upcoming();
  for (auto const l : next) {
    if (layers_[l].buffer >= 0 || layers_[l].failure) { continue; }  // there, coming, or for acquire to throw
    int const b = take_buffer(next, false);
    if (b < 0) { return; }
    start_read(l, b, false);
  }
}

template <class Param, tier Tier>
void offloaded_params<Param, Tier>::drop(int b)
{
  layers_[buffers_[b].layer].buffer = -1;
  buffers_[b].state                 = buffer_state::free;
}

template <class Param, tier Tier>
void offloaded_params<Param, Tier>::fill_views(layer_entry& l, std::byte const* data)
{
  std::vector<std::span<Param const>> views;
  // Device buffers: the resident tensors' device copies are made again only when a write
  // changed their values, on the object's stream once the work that read the last copies
  // (queued on release's stream) is done, and waited for.
  bool const copy_up = resident_device_ != nullptr && l.resident_released && l.resident_stale;
  if (copy_up) { stream_->wait(*l.resident_released); }
  for (auto const t : l.tensors) {
    auto const& e = tensors_[t];
    if (e.resident) {  // a copy of its own: a write does not change a view while it is held
      Param* held = resident_device_ != nullptr ? resident_device_ + e.offset : resident_.data() + resident_count_ + e.offset;
      if (copy_up) {
        device::copy_async(held, resident_.data() + e.offset, e.count * sizeof(Param), *stream_);
      } else if (resident_device_ == nullptr) {
        std::copy_n(resident_.data() + e.offset, e.count, held);
      }
      views.emplace_back(held, e.count);
    } else {
      views.emplace_back(reinterpret_cast<Param const*>(data + (e.offset - l.offset)), e.count);
    }
  }
  if (copy_up) {
    device::event up;
    up.record(*stream_);
    up.synchronize();
    l.resident_stale = false;
  }
  l.views = std::move(views);  // (nothing changed if a copy failed)
}

template <class Param, tier Tier>
auto offloaded_params<Param, Tier>::acquire(layer_id layer) -> layer_view
{
  std::unique_lock lk(mu_);
  TIERSTATE_EXPECTS(layer < layers_.size(), "offloaded_params::acquire: layer " + std::to_string(layer) +
                                              " was not added (there are " + std::to_string(layers_.size()) + ")");
  auto& l = layers_[layer];
  TIERSTATE_EXPECTS(!l.acquired, "offloaded_params::acquire(" + detail::layer_text(layer, l.name) +
                                   "): it is acquired already; release it first");
  if (!made_) { make_locked(); }
  // Held: acquired, or being read or read for an acquire that waits for it (another thread's).
  bool const every_buffer_held = std::all_of(buffers_.begin(), buffers_.end(), [&](buffer const& b) {
    return b.state == buffer_state::acquired || (b.state != buffer_state::free && layers_[b.layer].wanted);
  });
  TIERSTATE_EXPECTS(l.bytes == 0 || l.buffer >= 0 || !every_buffer_held,
                    "offloaded_params::acquire(" + detail::layer_text(layer, l.name) + "): all " +
                      std::to_string(buffers_.size()) +
                      " buffers (window + 1) hold acquired layers; release one first, or make the window larger");

  recorded_.push_back(layer);
  if (cursor_ < expected_.size() && expected_[cursor_] == layer) {
    ++cursor_;
  } else {
    ++stats_.out_of_order;
    auto const at = std::find(expected_.begin() + static_cast<std::ptrdiff_t>(cursor_), expected_.end(), layer);
    if (at != expected_.end()) { cursor_ = static_cast<std::size_t>(at - expected_.begin()) + 1; }
  }
  if (l.bytes == 0) {  // every tensor resident
    fill_views(l, nullptr);
    l.acquired = true;
    read_ahead();
    layer_view v;
    v.layer_   = layer;
    v.tensors_ = l.views;
    return v;
  }

  ++stats_.acquires;
  auto const t0  = std::chrono::steady_clock::now();
  bool on_demand = false, waited = false;
  if (l.failure) {  // a read ahead's: this acquire reads again
    l.failure = nullptr;
    ++stats_.retried;
  }
  l.wanted = true;  // (its buffer is not taken while this waits)
  struct unwant {
    bool& wanted;
    ~unwant() { wanted = false; }
  } const unwanted{l.wanted};
  for (;;) {
    if (l.failure) {
      std::exception_ptr const failure = std::exchange(l.failure, nullptr);
      stats_.wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      read_ahead();
      std::rethrow_exception(failure);
    }
    if (l.buffer >= 0) {
      if (buffers_[l.buffer].state == buffer_state::ready) { break; }
      waited = true;
      cv_.wait(lk);
      continue;
    }
    int const b = take_buffer(upcoming(), true);
    if (b < 0) {  // every buffer is being read into or held: wait for a read to end
      waited = true;
      cv_.wait(lk);
      continue;
    }
    start_read(layer, b, true);
    on_demand = true;
  }
  auto& b = buffers_[l.buffer];
  b.state    = buffer_state::acquired;
  l.acquired = true;
  if (on_demand) {
    ++stats_.on_demand;
  } else if (waited) {
    ++stats_.waited;
  } else {
    ++stats_.ready;
  }
  stats_.wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  try {
    fill_views(l, b.data);
  } catch (...) {  // (a resident copy's device error: not acquired)
    b.state    = buffer_state::ready;
    l.acquired = false;
    throw;
  }
  read_ahead();
  layer_view v;
  v.layer_   = layer;
  v.tensors_ = l.views;
  return v;
}

template <class Param, tier Tier>
void offloaded_params<Param, Tier>::release(layer_id layer, device::stream_view done)
{
  std::lock_guard lk(mu_);
  TIERSTATE_EXPECTS(layer < layers_.size(), "offloaded_params::release: layer " + std::to_string(layer) +
                                              " was not added (there are " + std::to_string(layers_.size()) + ")");
  auto& l = layers_[layer];
  TIERSTATE_EXPECTS(l.acquired, "offloaded_params::release(" + detail::layer_text(layer, l.name) +
                                  "): it is not acquired");
  if (l.resident_released) { l.resident_released->record(done); }
  if (l.buffer >= 0 && buffers_[l.buffer].released) { buffers_[l.buffer].released->record(done); }
  l.acquired = false;
  if (l.buffer >= 0) {
    auto& b = buffers_[l.buffer];
    if (b.version != l.version) {
      drop(l.buffer);  // written while acquired: its bytes are old
    } else {
      b.state = buffer_state::ready;  // kept until the buffer is needed
    }
  }
  read_ahead();
  cv_.notify_all();
}

template <class Param, tier Tier>
void offloaded_params<Param, Tier>::end_iteration()
{
  std::lock_guard lk(mu_);
  for (layer_id l = 0; l < layers_.size(); ++l) {
    TIERSTATE_EXPECTS(!layers_[l].acquired, "offloaded_params::end_iteration: " +
                                              detail::layer_text(l, layers_[l].name) +
                                              " is still acquired; release every layer first");
  }
  if (!recorded_.empty()) { expected_ = std::move(recorded_); }
  recorded_.clear();
  cursor_ = 0;
  read_ahead();
}

template <class Param, tier Tier>
auto offloaded_params<Param, Tier>::find_tensor(std::string_view name) const -> std::optional<tensor_id>
{
  std::lock_guard lk(mu_);
  auto const it = index_.find(std::string(name));
  return it == index_.end() ? std::nullopt : std::optional(it->second);
}

template <class Param, tier Tier>
auto offloaded_params<Param, Tier>::expected_order() const -> std::vector<layer_id>
{
  std::lock_guard lk(mu_);
  return expected_;
}

template <class Param, tier Tier>
offload_stats offloaded_params<Param, Tier>::stats() const
{
  std::lock_guard lk(mu_);
  return stats_;
}

template <class Param, tier Tier>
Tier& offloaded_params<Param, Tier>::param_tier()
{
  std::lock_guard lk(mu_);
  if (!made_) { make_locked(); }
  TIERSTATE_EXPECTS(tier_ != nullptr, "offloaded_params::param_tier: every tensor is resident: there is no tier");
  return *tier_;
}

template <class Param, tier Tier>
auto offloaded_params<Param, Tier>::layer_at(layer_id l, char const* call) const -> layer_entry const&
{
  TIERSTATE_EXPECTS(l < layers_.size(), std::string("offloaded_params::") + call + ": layer " + std::to_string(l) +
                                          " was not added (there are " + std::to_string(layers_.size()) + ")");
  return layers_[l];
}

template <class Param, tier Tier>
auto offloaded_params<Param, Tier>::tensor_at(tensor_id t, char const* call) const -> tensor_entry const&
{
  TIERSTATE_EXPECTS(t < tensors_.size(), std::string("offloaded_params::") + call + ": tensor " + std::to_string(t) +
                                           " was not added (there are " + std::to_string(tensors_.size()) + ")");
  return tensors_[t];
}

template <class Param, tier Tier>
void offloaded_params<Param, Tier>::check_range(tensor_id t, std::size_t offset, std::size_t n, char const* call) const
{
  auto const& e = tensor_at(t, call);
  TIERSTATE_EXPECTS(offset <= e.count && n <= e.count - offset,
                    std::string("offloaded_params::") + call + "('" + e.name + "'): elements [" +
                      std::to_string(offset) + ", " + std::to_string(offset + n) + ") are outside its " +
                      std::to_string(e.count));
}

}  // namespace tierstate
