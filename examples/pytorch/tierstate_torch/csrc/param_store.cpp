// SPDX-License-Identifier: Apache-2.0
// param_store over offloaded_params, for each param dtype and tier (its own translation
// unit: the window's compositions compile beside the optimizers').
#include "param_store.hpp"

#include <tierstate/tierstate.hpp>

#include <stdexcept>
#include <type_traits>

namespace tierstate_torch {

namespace {

[[nodiscard]] tierstate::device::stream_view to_stream([[maybe_unused]] std::uintptr_t s) noexcept
{
#if defined(TIERSTATE_ENABLE_CUDA)
  return tierstate::device::stream_view(reinterpret_cast<cudaStream_t>(s));
#else
  return {};
#endif
}

template <class Param, class Tier>
class store_impl final : public param_store {
  using window = tierstate::offloaded_params<Param, Tier>;

  static typename window::options options_for(store_config const& c)
  {
    typename window::options o;
    o.window                = c.window;
    o.persistence_threshold = c.persistence_threshold;
    o.write_behind_bytes    = c.write_behind_bytes;
    o.where                 = c.device_buffers ? tierstate::location::device : tierstate::location::host;
    if constexpr (std::is_same_v<Tier, tierstate::NvmeFile>) { o.tier.directory = c.directory; }
    return o;
  }

  /// Elements in `bytes`, refusing a part of one.
  static std::size_t elements(std::size_t bytes, char const* call)
  {
    if (bytes % sizeof(Param) != 0) {
      throw std::invalid_argument(std::string("tierstate_torch: param store ") + call + ": " + std::to_string(bytes) +
                                  " bytes is not a whole number of " + std::to_string(sizeof(Param)) +
                                  "-byte elements");
    }
    return bytes / sizeof(Param);
  }

  window w_;
  dtype dtype_;

 public:
  explicit store_impl(store_config const& c) : w_(options_for(c)), dtype_(c.param) {}

  std::size_t add_layer(std::string name) override { return w_.add_layer(std::move(name)); }
  std::size_t add_tensor(std::size_t layer, std::string name, std::size_t count) override
  {
    return w_.add_tensor(layer, std::move(name), count);
  }
  void materialize() override { w_.materialize(); }
  std::vector<std::span<std::byte const>> acquire(std::size_t layer) override
  {
    auto const v = w_.acquire(layer);
    std::vector<std::span<std::byte const>> out;
    out.reserve(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) { out.push_back(std::as_bytes(v.tensor(i))); }
    return out;
  }
  void release(std::size_t layer, std::uintptr_t stream) override { w_.release(layer, to_stream(stream)); }
  void end_iteration() override { w_.end_iteration(); }
  void read(std::size_t t, std::size_t offset, std::span<std::byte> to) override
  {
    w_.read(t, offset, {reinterpret_cast<Param*>(to.data()), elements(to.size(), "read")});
  }
  void write(std::size_t t, std::size_t offset, std::span<std::byte const> from) override
  {
    w_.write(t, offset, {reinterpret_cast<Param const*>(from.data()), elements(from.size(), "write")});
  }
  void flush() override { w_.flush(); }
  [[nodiscard]] std::size_t tensor_size(std::size_t t) const override { return w_.tensor_size(t); }
  [[nodiscard]] bool resident(std::size_t t) const override { return w_.resident(t); }
  [[nodiscard]] store_stats stats() const override
  {
    auto const s = w_.stats();
    store_stats o;
    o.acquires           = s.acquires;
    o.ready              = s.ready;
    o.waited             = s.waited;
    o.on_demand          = s.on_demand;
    o.out_of_order       = s.out_of_order;
    o.reads              = s.reads;
    o.bytes_read         = s.bytes_read;
    o.bytes_written      = s.bytes_written;
    o.grad_bytes_written = s.grad_bytes_written;
    o.grad_bytes_read    = s.grad_bytes_read;
    o.wait_seconds       = s.wait_seconds;
    o.buffer_bytes       = w_.buffer_bytes();
    o.buffer_count       = w_.buffer_count();
    o.tier_bytes         = w_.tier_bytes();
    o.resident_bytes     = w_.resident_bytes();
    return o;
  }
  [[nodiscard]] dtype param() const noexcept override { return dtype_; }
  [[nodiscard]] void* source() noexcept override
  {
    return static_cast<tierstate::param_source<Param>*>(&w_);
  }
};

template <class Param>
std::unique_ptr<param_store> for_tier(store_config const& c)
{
  if (c.tier == "pinned") { return std::make_unique<store_impl<Param, tierstate::PinnedHost>>(c); }
  if (c.tier == "nvme") { return std::make_unique<store_impl<Param, tierstate::NvmeFile>>(c); }
  throw std::invalid_argument("tierstate_torch: offload_parameters' tier must be 'pinned' or 'nvme', not '" +
                              c.tier + "'");
}

}  // namespace

std::unique_ptr<param_store> make_param_store(store_config const& c)
{
#if !defined(TIERSTATE_TORCH_DEVICE_PARAMS)
  if (c.device_buffers) {
    throw std::invalid_argument("tierstate_torch: parameters offloaded from a device need the CUDA build "
                                "(TIERSTATE_TORCH_CUDA=1) or, for tests, the emulated device's");
  }
#endif
  switch (c.param) {
    case dtype::f32: return for_tier<float>(c);
    case dtype::bf16: return for_tier<tierstate::bf16>(c);
    case dtype::f16: return for_tier<tierstate::fp16>(c);
    case dtype::i8: break;
  }
  throw std::invalid_argument("tierstate_torch: offloaded parameters must be float32, bfloat16 or float16");
}

}  // namespace tierstate_torch
