// SPDX-License-Identifier: Apache-2.0
// OffloadedOptimizer's registry parts (optimizer.hpp): the gate that refuses a second
// thread, the name index's hash, and what the registry keeps per tensor.
#pragma once

#include <tierstate/core/device_runtime.hpp>
#include <tierstate/core/error.hpp>
#include <tierstate/core/param_source.hpp>
#include <tierstate/core/tensor.hpp>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace tierstate::inline TIERSTATE_ABI::detail {

/// Who is inside an optimizer's members: a second thread entering while another is inside is
/// refused before it touches anything. Calls nest on one thread (save calls flush).
struct call_gate {
  std::atomic<std::thread::id> owner{};
  std::atomic<char const*> call{nullptr};
};

class gate_entry {
 public:
  gate_entry(call_gate& g, char const* call) : gate_(g)
  {
    std::thread::id expected{};
    if (g.owner.compare_exchange_strong(expected, std::this_thread::get_id(), std::memory_order_acquire)) {
      g.call.store(call, std::memory_order_relaxed);
      return;
    }
    if (expected == std::this_thread::get_id()) {  // nested on this thread
      nested_ = true;
      return;
    }
    char const* other = g.call.load(std::memory_order_relaxed);
    throw logic_error(std::string(call) + ": another thread is inside " + (other != nullptr ? other : "a call") +
                      "() of this optimizer; one thread at a time may call an optimizer's members "
                      "(grad_ready alone may be called concurrently); nothing was changed");
  }
  gate_entry(gate_entry const&)            = delete;
  gate_entry& operator=(gate_entry const&) = delete;
  ~gate_entry()
  {
    if (!nested_) {
      gate_.call.store(nullptr, std::memory_order_relaxed);
      gate_.owner.store(std::thread::id{}, std::memory_order_release);
    }
  }

 private:
  call_gate& gate_;
  bool nested_ = false;
};

/// Hashes std::string and std::string_view alike, for lookups without a copy.
struct name_hash {
  using is_transparent = void;
  std::size_t operator()(std::string_view s) const noexcept { return std::hash<std::string_view>{}(s); }
};

/// The largest step count taken in (2^53: a double's exact integers), so that counting on
/// never overflows.
inline constexpr std::int64_t max_step_count = std::int64_t{1} << 53;

/// A registered parameter tensor.
template <class Param>
struct tensor_entry {
  std::string name;
  Param* param      = nullptr;
  std::size_t count = 0;
  std::size_t group = 0;
  location where    = location::host;
  tensor_shape shape{};  ///< {1, count} unless registered with a shape
  std::int64_t step = 0;  ///< the steps that updated it (torch.optim's state["step"])
  /// Params that rest elsewhere (offloaded_params): `param` is null, and they are read and
  /// written as tensor `source_tensor` of `source`.
  param_source<Param>* source = nullptr;
  std::size_t source_tensor   = 0;
};

/// Elements [offset, offset + n) of a tensor's params wherever they are (host, device, a
/// param_source), read into or written from `to` / `from`.
template <class Param>
void read_params(tensor_entry<Param> const& e, std::size_t offset, std::span<Param> to)
{
  if (e.source != nullptr) {
    e.source->read(e.source_tensor, offset, to);
  } else if (e.where == location::device) {
    device::copy(to.data(), e.param + offset, to.size_bytes());
  } else {
    std::copy_n(e.param + offset, to.size(), to.data());
  }
}
template <class Param>
void write_params(tensor_entry<Param> const& e, std::size_t offset, std::span<Param const> from)
{
  if (e.source != nullptr) {
    e.source->write(e.source_tensor, offset, from);
  } else if (e.where == location::device) {
    device::copy(e.param + offset, from.data(), from.size_bytes());
  } else {
    std::copy_n(from.data(), from.size(), e.param + offset);
  }
}

/// Waits for every offloaded params' writes (param_source::flush) and throws the first
/// failure, or with `discard` forgets it (a load rewrites every param).
template <class Param>
void flush_sources(std::vector<param_source<Param>*> const& sources, bool discard = false)
{
  std::exception_ptr first;  // every source waited for
  for (auto* s : sources) {
    try {
      s->flush();
    } catch (...) {
      if (!first) { first = std::current_exception(); }
    }
  }
  if (first && !discard) { std::rethrow_exception(first); }
}

/// The part of a tensor that falls in one chunk.
struct chunk_piece {
  std::size_t tensor;
  std::size_t tensor_begin;  ///< first element, within the tensor
  std::size_t chunk_begin;   ///< first element, within the chunk
  std::size_t count;
};

}  // namespace tierstate::detail
