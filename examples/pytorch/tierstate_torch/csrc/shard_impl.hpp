// SPDX-License-Identifier: Apache-2.0
// shard over one OffloadedOptimizer composition, and the run-time choice among them for
// one rule. Included by one translation unit per rule and compute (shards_<rule>.cpp for
// OnHost, device_shards_<rule>.cpp for OnDevice, which includes on_device.hpp first).
#pragma once

#include "param_store.hpp"
#include "shard.hpp"

#include <tierstate/tierstate.hpp>
#if defined(TIERSTATE_TORCH_DISPATCH)
#include "host_kernels.hpp"
#endif

#include <chrono>
#include <memory>
#include <stdexcept>
#include <type_traits>
#include <string>
#include <vector>

namespace tierstate_torch {

namespace detail {

[[nodiscard]] inline tierstate::nonfinite_policy parse_policy(std::string const& s)
{
  if (s == "skip_step") { return tierstate::nonfinite_policy::skip_step; }
  if (s == "report") { return tierstate::nonfinite_policy::report; }
  if (s == "ignore") { return tierstate::nonfinite_policy::ignore; }
  throw std::invalid_argument("tierstate_torch: on_nonfinite must be 'skip_step', 'report' or 'ignore', not '" +
                              s + "'");
}

[[nodiscard]] inline tierstate::device::stream_view to_stream([[maybe_unused]] std::uintptr_t s) noexcept
{
#if defined(TIERSTATE_ENABLE_CUDA)
  return tierstate::device::stream_view(reinterpret_cast<cudaStream_t>(s));
#else
  return {};  // the emulated device: gradients are ready when handed over
#endif
}

[[nodiscard]] inline std::string dtype_name(dtype d)
{
  return d == dtype::f32 ? "float32" : d == dtype::bf16 ? "bfloat16" : d == dtype::f16 ? "float16" : "int8";
}

[[nodiscard]] inline result to_result(tierstate::step_result const& r)
{
  result o;
  o.found_nonfinite    = r.found_nonfinite;
  o.skipped            = r.skipped;
  o.deferred           = r.deferred;
  o.step               = r.step;
  o.grad_norm          = r.grad_norm;
  o.tier_bytes_read    = r.stats.tier_bytes_read;
  o.tier_bytes_written = r.stats.tier_bytes_written;
  o.check_seconds      = r.stats.check_seconds;
  o.compute_seconds    = r.stats.compute_seconds;
  o.wait_seconds       = r.stats.wait_seconds;
  o.grad_wait_seconds  = r.stats.grad_wait_seconds;
  o.total_seconds      = r.stats.total_seconds;
  return o;
}

/// The OnHost compositions' compute: a package build's kernels are dispatched at run time
/// among x86-64 levels (host_kernels.hpp); a just-in-time build's are its own -march's.
#if defined(TIERSTATE_TORCH_DISPATCH)
using host_compute = tierstate::OnHostDispatched<kernels::all>;
#else
using host_compute = tierstate::OnHost<>;
#endif

template <class Rule, class Precision, class Tier, class Transfer, class Compute = host_compute>
class shard_impl final : public shard {
  using optimizer = tierstate::OffloadedOptimizer<Rule, Precision, Tier, Transfer, Compute>;
  static constexpr bool device_params = optimizer::takes_device_params;
  static constexpr auto where = device_params ? tierstate::location::device : tierstate::location::host;
  using param_t   = typename optimizer::param_type;
  using grad_t    = typename optimizer::grad_type;

  /// The rule's hyper-parameters from their table's values (checked against the table's
  /// ranges, tierstate::invalid_option naming the first refused); none: the defaults.
  static typename Rule::hyperparameters to_rule(hyper const& h)
  {
    if (h.empty()) { return {}; }
    return tierstate::hyperparameters_from_values<Rule>(h);
  }

  static typename optimizer::options options_for(config const& c)
  {
    typename optimizer::options o;
    o.chunk_elements = c.chunk_elements;
    o.threads        = c.threads;
    o.on_nonfinite   = parse_policy(c.on_nonfinite);
    o.max_grad_norm  = c.max_grad_norm;
    o.bind_threads   = c.bind_threads ? tierstate::thread_binding::physical_cores : tierstate::thread_binding::none;
    o.delayed_update = c.delayed_update;
    o.shadow_state   = c.shadow_state == 1 || (c.shadow_state == 2 && optimizer::can_shadow_state);
    o.ranks.any_nonfinite = c.any_nonfinite;
    o.ranks.norm          = c.norm;
    if constexpr (std::is_same_v<Tier, tierstate::NvmeFile>) { o.tier.directory = c.directory; }
    if (c.progress) {
      o.progress = [f = c.progress](tierstate::progress_phase p, std::uint64_t done, std::uint64_t total) {
        f(tierstate::to_string(p), done, total);
      };
    }
    return o;
  }

  [[nodiscard]] static tierstate::grad_view<grad_t> view(grad_in g) noexcept
  {
    if (g.data == nullptr) { return {}; }
    return {static_cast<grad_t const*>(g.data), g.size, where};
  }

  std::unique_ptr<tierstate::tracer> tracer_;  ///< trace_start's (declared first: it outlives opt_'s use)
  optimizer opt_;
  bool shadowed_ = false;  ///< options::shadow_state taken

 public:
  explicit shard_impl(config const& c) : opt_(to_rule(c.defaults), options_for(c)), shadowed_(options_for(c).shadow_state) {}

  std::size_t add_tensor(std::string name, void* param, std::span<std::size_t const> dims) override
  {
    return opt_.add_tensor(std::move(name), static_cast<param_t*>(param), tierstate::tensor_shape::of(dims), where);
  }
  std::size_t add_offloaded(std::string name, param_store& store, std::size_t id) override
  {
    constexpr dtype mine = std::is_same_v<param_t, float>             ? dtype::f32
                           : std::is_same_v<param_t, tierstate::bf16> ? dtype::bf16
                                                                      : dtype::f16;
    if (store.param() != mine) {
      throw std::invalid_argument("tierstate_torch: offloaded parameter '" + name + "': the store holds " +
                                  dtype_name(store.param()) + " and this shard " + dtype_name(mine));
    }
    return opt_.add_tensor(*static_cast<tierstate::param_source<param_t>*>(store.source()), id, std::move(name));
  }
  std::size_t add_group(hyper const& h, std::vector<std::string> const& names) override
  {
    return opt_.add_group(to_rule(h), names);
  }
  void set_hyperparameters(std::size_t group, hyper const& h) override
  {
    opt_.set_hyperparameters(group, to_rule(h));
  }
  result step(std::span<grad_in const> grads, double grad_scale, std::uintptr_t stream) override
  {
    std::vector<tierstate::grad_view<grad_t>> views;
    views.reserve(grads.size());
    for (auto const& g : grads) { views.push_back(view(g)); }
    return to_result(opt_.step(views, grad_scale, to_stream(stream)));
  }
  void begin_step(double grad_scale, unsigned micro_batches) override
  {
    opt_.begin_step(grad_scale, micro_batches);
  }
  void grad_ready(std::size_t tensor, grad_in g) override
  {
    opt_.grad_ready(tensor, view(g), to_stream(g.stream));
  }
  result finish_step() override { return to_result(opt_.finish_step()); }
  [[nodiscard]] bool keeps_gradient(std::size_t tensor) const override { return opt_.keeps_gradient(tensor); }
  result flush() override { return to_result(opt_.flush()); }
  [[nodiscard]] bool in_step() const override { return opt_.in_step(); }
  void save(std::string const& path) override { opt_.save(path); }
  void load(std::string const& path) override { opt_.load(path); }
  void save_to(std::function<void(std::span<std::byte const>)> const& write) override { opt_.save_to(write); }
  void load_from(std::uint64_t size, std::function<void(std::uint64_t, std::span<std::byte>)> const& read) override
  {
    opt_.load_from(size, read);
  }
  void copy_state(std::string_view tensor, std::string_view slot, std::span<float> to) override
  {
    opt_.copy_state(tensor, tierstate::slot{slot}, to);  // an unknown name: logic_error naming it
  }
  void write_state(std::string_view tensor, std::string_view slot, std::span<float const> from) override
  {
    opt_.write_state(tensor, tierstate::slot{slot}, from);
  }
  [[nodiscard]] std::size_t tensor_state_size(std::string_view tensor) override { return opt_.tensor_state_size(tensor); }
  void copy_tensor_state(std::string_view tensor, std::span<float> to) override { opt_.copy_tensor_state(tensor, to); }
  void write_tensor_state(std::string_view tensor, std::span<float const> from) override
  {
    opt_.write_tensor_state(tensor, from);
  }
  [[nodiscard]] std::int64_t step_count() const override { return opt_.step_count(); }
  void set_step_count(std::int64_t n) override { opt_.set_step_count(n); }
  [[nodiscard]] std::int64_t tensor_step_count(std::string_view tensor) const override
  {
    return opt_.step_count(tensor);
  }
  void set_tensor_step_count(std::string_view tensor, std::int64_t n) override { opt_.set_step_count(tensor, n); }
  [[nodiscard]] std::vector<std::string> slot_names() const override
  {
    std::vector<std::string> names;
    if constexpr (Precision::has_master) { names.emplace_back(tierstate::slot::master.name()); }
    if constexpr (Precision::has_compensation) { names.emplace_back(tierstate::slot::compensation.name()); }
    for (auto const s : Rule::slots) { names.emplace_back(s.name()); }
    return names;
  }
  [[nodiscard]] std::string composition() const override
  {
    std::string s("OffloadedOptimizer<");
    s.append(Rule::name).append(", ").append(Precision::name()).append(", ").append(Tier::name);
    s.append(std::is_same_v<Transfer, tierstate::Synchronous> ? ", Synchronous"
             : device_params                                    ? ", CudaOverlapped<2>"
                                                                : ", Pipelined<2>");
    s.append(Compute::runs_on_device ? ", OnDevice>" : ", OnHost>");
    if (shadowed_) { s.append(" with shadow_state"); }
    return s;
  }
  [[nodiscard]] bool state_lost() const override { return opt_.state_lost(); }
  void trace_start(std::size_t capacity) override
  {
    auto next = std::make_unique<tierstate::tracer>(capacity);
    opt_.trace(next.get());  // (refused during a streaming step: nothing changed)
    tracer_ = std::move(next);
  }
  std::vector<trace_record> trace_stop(std::uint64_t& dropped) override
  {
    dropped = 0;
    if (!tracer_) { return {}; }
    opt_.trace(nullptr);
    auto const t = std::move(tracer_);
    std::int64_t const origin =
      std::chrono::duration_cast<std::chrono::nanoseconds>(t->origin().time_since_epoch()).count();
    std::vector<trace_record> out;
    out.reserve(t->events().size());
    for (auto const& e : t->events()) {
      bool const io = e.track >= tierstate::tracer::io_track_base;
      out.push_back({tierstate::to_string(e.phase), origin + e.begin_ns, origin + e.end_ns, e.bytes, e.chunk,
                     io ? e.track - tierstate::tracer::io_track_base : e.track, io});
    }
    dropped = t->dropped();
    return out;
  }
};

/// A rule's table, as the bindings expose it.
template <class Rule>
rule_info info_of()
{
  rule_info r;
  r.name = std::string(Rule::name);
  typename Rule::hyperparameters const defaults{};
  for (auto const& row : Rule::hyperparameter_table) {
    r.hyperparameters.emplace_back(row.name);
    r.defaults.push_back(row.get(defaults));
  }
  for (auto const s : Rule::slots) { r.slots.emplace_back(s.name()); }
  return r;
}

[[noreturn]] inline void refuse_tier(config const& c)
{
  throw std::invalid_argument("tierstate_torch: tier '" + c.tier + "' with compute '" + c.compute +
                              "' and " + (c.device_params ? "device" : "host") +
                              " params: the tiers are 'pinned' and 'nvme' (any compute), and 'device' "
                              "(compute 'device' only)");
}

/// OnHost: host params (Synchronous in memory, Pipelined<2> from NVMe), or device params
/// streamed to the host and back (CudaOverlapped<2>: ZeRO-Offload).
struct on_host {
  template <class Rule, class Precision>
  static std::unique_ptr<shard> make(config const& c)
  {
    using namespace tierstate;
    if (c.device_params) {
      // (A CPU build compiles them only with the emulated device: without it, no param is on
      // a device.)
#if defined(TIERSTATE_TORCH_DEVICE_PARAMS)
      if (c.tier == "pinned") { return std::make_unique<shard_impl<Rule, Precision, PinnedHost, CudaOverlapped<2>>>(c); }
      if (c.tier == "nvme") { return std::make_unique<shard_impl<Rule, Precision, NvmeFile, CudaOverlapped<2>>>(c); }
#else
      throw std::invalid_argument("tierstate_torch: device params need the CUDA build (TIERSTATE_TORCH_CUDA=1) or, "
                                  "for tests, the emulated device's (TIERSTATE_TORCH_EMULATED_DEVICE_BUILD=1)");
#endif
    } else {
      if (c.tier == "pinned") { return std::make_unique<shard_impl<Rule, Precision, PinnedHost, Synchronous>>(c); }
      if (c.tier == "nvme") { return std::make_unique<shard_impl<Rule, Precision, NvmeFile, Pipelined<2>>>(c); }
    }
    refuse_tier(c);
  }
};

/// The precisions: params and grads of the param dtype, an fp32 master for bf16 and fp16
/// params, m and v in fp32 or bf16.
template <class Rule, class Compositions>
std::unique_ptr<shard> for_rule(config const& c)
{
  using tierstate::bf16;
  using tierstate::fp16;
  using tierstate::Precision;
  bool const bf16_state = c.state == dtype::bf16;
  if (c.state == dtype::f16) {
    throw std::invalid_argument("tierstate_torch: state_dtype must be float32, bfloat16 or int8, not float16");
  }
  if (c.state == dtype::i8 || c.master != "fp32") {
    throw std::logic_error("tierstate_torch: for_rule with a compact format (make_shard sends those to the rule's "
                           "compact compositions)");
  }
  // A rule without slots (SGD without momentum) keeps no state for state_dtype to choose.
  auto make = [&]<class Param>() {
    if constexpr (Rule::slots.size() != 0) {
      if (bf16_state) { return Compositions::template make<Rule, Precision<Param, Param, float, bf16>>(c); }
    }
    return Compositions::template make<Rule, Precision<Param, Param, float, float>>(c);
  };
  switch (c.param) {
    case dtype::f32: return make.template operator()<float>();
    case dtype::bf16: return make.template operator()<bf16>();
    case dtype::f16: return make.template operator()<fp16>();
    case dtype::i8: break;
  }
  throw std::invalid_argument("tierstate_torch: unknown param dtype");
}

/// The 8-bit state of a rule's slots: the signed map for a first moment or momentum, the
/// unsigned one for a second moment (a rule with two slots keeps m, then v).
template <class Rule>
using eight_bit_state = std::conditional_t<Rule::slots.size() == 2,
                                           tierstate::slot_codecs<tierstate::codecs::dynamic8, tierstate::codecs::udynamic8>,
                                           tierstate::codecs::dynamic8>;

/// The compact precisions (for_rule has the others): m and v in 8-bit blocks (any param
/// dtype, an fp32 master for bf16 and fp16 params), or bf16 params without an fp32 master
/// (a Kahan compensation slot, or stochastic rounding) with fp32, bf16 or 8-bit state.
template <class Rule, class Compositions>
std::unique_ptr<shard> for_rule_compact(config const& c)
{
  using tierstate::bf16;
  using tierstate::fp16;
  using tierstate::Precision;
  static_assert(Rule::slots.size() == 1 || Rule::slots.size() == 2);
  if (c.state == dtype::f16) {
    throw std::invalid_argument("tierstate_torch: state_dtype must be float32, bfloat16 or int8, not float16");
  }
  if (c.master != "fp32" && c.master != "kahan" && c.master != "stochastic") {
    throw std::invalid_argument("tierstate_torch: master must be 'fp32', 'kahan' or 'stochastic', not '" + c.master + "'");
  }
  if (c.master != "fp32" && c.param != dtype::bf16) {
    throw std::invalid_argument("tierstate_torch: master '" + c.master + "' is for bfloat16 params (the param is "
                                "its own master); a " + std::string(c.param == dtype::f32 ? "float32" : "float16") +
                                " param takes master 'fp32'");
  }
  // An fp32 master with fp32 or bf16 state is for_rule's: not instantiated here again.
  auto make = [&]<class Param, class Master>() -> std::unique_ptr<shard> {
    if (c.state == dtype::i8) {
      return Compositions::template make<Rule, Precision<Param, Param, Master, eight_bit_state<Rule>>>(c);
    }
    if constexpr (!std::is_same_v<Master, float>) {
      if (c.state == dtype::bf16) { return Compositions::template make<Rule, Precision<Param, Param, Master, bf16>>(c); }
      return Compositions::template make<Rule, Precision<Param, Param, Master, float>>(c);
    }
    throw std::logic_error("tierstate_torch: for_rule_compact with an fp32 master and fp32 or bf16 state");
  };
  switch (c.param) {
    case dtype::f32: return make.template operator()<float, float>();
    case dtype::f16: return make.template operator()<fp16, float>();
    case dtype::bf16:
      if (c.master == "kahan") { return make.template operator()<bf16, tierstate::Compensated>(); }
      if (c.master == "stochastic") { return make.template operator()<bf16, tierstate::StochasticRounding>(); }
      return make.template operator()<bf16, float>();
    case dtype::i8: break;
  }
  throw std::invalid_argument("tierstate_torch: a parameter dtype must be float32, bfloat16 or float16");
}

}  // namespace detail

}  // namespace tierstate_torch
