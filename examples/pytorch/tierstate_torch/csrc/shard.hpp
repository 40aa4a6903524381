// SPDX-License-Identifier: Apache-2.0
// The extension's view of one OffloadedOptimizer: a run-time interface over the
// compile-time compositions, free of torch and pybind so that the compositions compile in
// their own translation units, in parallel, without PyTorch's headers.
//
// A "shard" is one optimizer over the parameters of one dtype: a PyTorch model may mix
// fp32 and bf16 parameters, and one OffloadedOptimizer has one precision.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace tierstate_torch {

/// A param's dtype, or the state's (i8: 8-bit blockwise moments, codecs/dynamic8.hpp).
enum class dtype : std::uint8_t { f32, bf16, f16, i8 };

/// One param group's hyper-parameters: one number per row of the rule's table
/// (rules/rule.hpp), in the table's order (a flag as 0 or 1).
using hyper = std::vector<double>;

/// What the bindings know of a rule, from its table: each number's name as torch.optim
/// spells it ("lr", "betas[0]") and default, and the slots it keeps.
struct rule_info {
  std::string name;
  std::vector<std::string> hyperparameters;
  std::vector<double> defaults;
  std::vector<std::string> slots;
};

/// Everything that picks the composition and its options.
struct config {
  std::string rule      = "adamw";  ///< a rule's name: rule_names()
  dtype param           = dtype::f32;  ///< params and grads
  dtype state           = dtype::f32;  ///< m and v: f32, bf16 or i8 (8-bit blocks)
  /// bf16 params: "fp32" (an fp32 master), "kahan" (Compensated: a bf16 compensation slot) or
  /// "stochastic" (StochasticRounding: the param alone). Other params: "fp32".
  std::string master    = "fp32";
  std::string tier      = "pinned";  ///< "pinned" (PinnedHost), "nvme" (NvmeFile), "device" (Device)
  std::string compute   = "host";    ///< "host" (OnHost, xsimd) or "device" (OnDevice, Thrust)
  bool device_params    = false;     ///< params and grads in device memory (CudaOverlapped)
  std::string directory;           ///< NvmeFile: where the scratch file goes
  std::size_t chunk_elements = 0;  ///< 0: 2^20, or a checkpoint's
  std::size_t threads   = 0;
  bool bind_threads     = false;   ///< tierstate::thread_binding::physical_cores
  double max_grad_norm  = 0.0;
  std::string on_nonfinite = "skip_step";  ///< skip_step, report, ignore
  bool delayed_update   = false;
  int shadow_state      = 0;  ///< 0 off, 1 on (refused where the composition cannot), 2 where it can
  /// A rank's share of a model (torch.distributed): the other ranks' verdict and norm
  /// (tierstate::across_ranks); empty in one process.
  std::function<bool(bool)> any_nonfinite;
  std::function<double(std::span<double const>)> norm;
  hyper defaults;  ///< empty: the rule's own defaults
  /// Hears (phase, bytes done, bytes total) of making the state, save and load
  /// (tierstate::progress_callback, with the phase's name); empty: none.
  std::function<void(std::string_view, std::uint64_t, std::uint64_t)> progress;
};

/// A gradient: a null `data` says the tensor has none this step. Device gradients are
/// read after the work queued so far on `stream` (a cudaStream_t; 0: the legacy default).
struct grad_in {
  void const* data     = nullptr;
  std::size_t size     = 0;
  std::uintptr_t stream = 0;
};

struct result {
  bool found_nonfinite = false;
  bool skipped         = false;
  bool deferred        = false;
  std::int64_t step    = 0;
  double grad_norm     = 0;
  std::uint64_t tier_bytes_read    = 0;
  std::uint64_t tier_bytes_written = 0;
  double check_seconds   = 0;
  double compute_seconds = 0;
  double wait_seconds    = 0;
  double grad_wait_seconds = 0;
  double total_seconds   = 0;
};

/// One traced interval (tierstate::trace_event), its times in nanoseconds of
/// std::chrono::steady_clock, so that every shard's events share one timeline.
struct trace_record {
  std::string_view phase;  ///< tierstate::to_string(trace_phase): static text
  std::int64_t begin_ns = 0;
  std::int64_t end_ns   = 0;
  std::uint64_t bytes   = 0;
  std::int64_t chunk    = -1;
  std::uint32_t track   = 0;  ///< a thread id, or a staging buffer's (io_track_base + buffer)
  bool io               = false;  ///< a staging buffer's track (then `track` is the buffer)
};

class param_store;  // param_store.hpp

class shard {
 public:
  virtual ~shard() = default;
  /// `param` points at a tensor of these dimensions (torch's `p.shape`) of the shard's dtype,
  /// updated in place.
  virtual std::size_t add_tensor(std::string name, void* param, std::span<std::size_t const> dims) = 0;
  /// Tensor `id` of `store` (offloaded parameters, of this shard's dtype), named `name`:
  /// updated through the store (OffloadedOptimizer::add_tensor(source, id, name)).
  virtual std::size_t add_offloaded(std::string name, param_store& store, std::size_t id) = 0;
  virtual std::size_t add_group(hyper const& h, std::vector<std::string> const& names) = 0;
  virtual void set_hyperparameters(std::size_t group, hyper const& h) = 0;
  /// `stream`: device gradients are read after the work queued on it so far.
  virtual result step(std::span<grad_in const> grads, double grad_scale, std::uintptr_t stream) = 0;
  virtual void begin_step(double grad_scale, unsigned micro_batches) = 0;
  /// Thread-safe.
  virtual void grad_ready(std::size_t tensor, grad_in g) = 0;
  virtual result finish_step() = 0;
  /// Whether tensor t's final gradient goes to its source in grad_ready (offloaded params).
  [[nodiscard]] virtual bool keeps_gradient(std::size_t tensor) const = 0;
  virtual result flush() = 0;
  [[nodiscard]] virtual bool in_step() const = 0;
  virtual void save(std::string const& path) = 0;
  virtual void load(std::string const& path) = 0;
  /// The checkpoint save() writes, in order, to `write`; and loaded from `size` bytes `read`
  /// provides (OffloadedOptimizer::save_to / load_from).
  virtual void save_to(std::function<void(std::span<std::byte const>)> const& write) = 0;
  virtual void load_from(std::uint64_t size,
                         std::function<void(std::uint64_t, std::span<std::byte>)> const& read) = 0;
  virtual void copy_state(std::string_view tensor, std::string_view slot, std::span<float> to) = 0;
  virtual void write_state(std::string_view tensor, std::string_view slot, std::span<float const> from) = 0;
  /// A rule's per-tensor state (a tensor phase's: Adafactor's statistics); size 0 without one.
  [[nodiscard]] virtual std::size_t tensor_state_size(std::string_view tensor) = 0;
  virtual void copy_tensor_state(std::string_view tensor, std::span<float> to) = 0;
  virtual void write_tensor_state(std::string_view tensor, std::span<float const> from) = 0;
  [[nodiscard]] virtual std::int64_t step_count() const = 0;
  virtual void set_step_count(std::int64_t n) = 0;
  /// One tensor's own count (torch's per-param state["step"]), and setting it alone.
  [[nodiscard]] virtual std::int64_t tensor_step_count(std::string_view tensor) const = 0;
  virtual void set_tensor_step_count(std::string_view tensor, std::int64_t n) = 0;
  /// The slots this composition keeps ("master" first when it has one).
  [[nodiscard]] virtual std::vector<std::string> slot_names() const = 0;
  /// The composition, spelled as its C++ type.
  [[nodiscard]] virtual std::string composition() const = 0;
  [[nodiscard]] virtual bool state_lost() const = 0;
  /// Records the timeline of the steps, saves and loads that follow (OffloadedOptimizer::trace)
  /// into a new tracer of `capacity` events, replacing one in use.
  virtual void trace_start(std::size_t capacity) = 0;
  /// Stops recording and hands over what was recorded (`dropped`: events that did not fit);
  /// empty when not tracing.
  virtual std::vector<trace_record> trace_stop(std::uint64_t& dropped) = 0;
};

/// Throws std::invalid_argument naming the option for an unknown rule, tier, dtype or policy.
std::unique_ptr<shard> make_shard(config const& c);

/// The rules this build has compositions for, and one's table (std::invalid_argument for a
/// name it does not know).
std::vector<std::string> rule_names();
rule_info rule_table(std::string const& rule);

/// Whether this build's device is tierstate's emulated one (built without CUDA): device
/// memory is then host memory, and "device" params are CPU tensors.
bool device_is_emulated() noexcept;
/// Whether the build has the compositions of params on a device (the CUDA build, or a CPU
/// build with the emulated device).
bool has_device_params() noexcept;
/// The host kernels' level: a package build's dispatched one ("x86-64-v4", ...; a
/// TIERSTATE_ARCH that names none, or one this CPU lacks, is refused: std::invalid_argument),
/// or "native <xsimd architecture>" for a build with its own -march.
std::string host_kernel_level();

// One per rule and compute, each in its own translation unit: shards_<rule>.cpp (OnHost:
// host params, or device params through CudaOverlapped; and the rule's table) and
// device_shards_<rule>.cpp (OnDevice; compiled by nvcc, as device_shards_<rule>.cu, with
// CUDA); the rules after Adam's share one unit per compute (shards_sgd_lion_adafactor.cpp). A rule is
// added with its definitions there, its three declarations here, its line in rules.cpp and
// its refusal in no_device_shards.cpp (and a new unit's name in _build.py's _UNITS).
rule_info adam_info();
rule_info adamw_info();
rule_info adam_amsgrad_info();
rule_info adamw_amsgrad_info();
std::unique_ptr<shard> make_adam_shard(config const& c);
std::unique_ptr<shard> make_adamw_shard(config const& c);
std::unique_ptr<shard> make_adam_amsgrad_shard(config const& c);
std::unique_ptr<shard> make_adamw_amsgrad_shard(config const& c);
std::unique_ptr<shard> make_adam_device_shard(config const& c);
std::unique_ptr<shard> make_adamw_device_shard(config const& c);
std::unique_ptr<shard> make_adam_amsgrad_device_shard(config const& c);
std::unique_ptr<shard> make_adamw_amsgrad_device_shard(config const& c);
rule_info sgd_info();
rule_info sgd_momentum_info();
rule_info lion_info();
std::unique_ptr<shard> make_sgd_shard(config const& c);
std::unique_ptr<shard> make_sgd_momentum_shard(config const& c);
std::unique_ptr<shard> make_lion_shard(config const& c);
std::unique_ptr<shard> make_sgd_device_shard(config const& c);
std::unique_ptr<shard> make_sgd_momentum_device_shard(config const& c);
std::unique_ptr<shard> make_lion_device_shard(config const& c);
/// The compact compositions (state i8, or master "kahan" or "stochastic") of the rules with
/// moments and without amsgrad: shards_<rule>_compact.cpp (OnHost) and
/// device_shards_<rule>_compact.cpp (OnDevice; .cu with CUDA; refused in no_device_shards.cpp).
std::unique_ptr<shard> make_adam_compact_shard(config const& c);
std::unique_ptr<shard> make_adamw_compact_shard(config const& c);
std::unique_ptr<shard> make_lion_compact_shard(config const& c);
std::unique_ptr<shard> make_sgd_momentum_compact_shard(config const& c);
std::unique_ptr<shard> make_adam_device_compact_shard(config const& c);
std::unique_ptr<shard> make_adamw_device_compact_shard(config const& c);
std::unique_ptr<shard> make_lion_device_compact_shard(config const& c);
std::unique_ptr<shard> make_sgd_momentum_device_compact_shard(config const& c);
rule_info adafactor_info();
std::unique_ptr<shard> make_adafactor_shard(config const& c);
std::unique_ptr<shard> make_adafactor_device_shard(config const& c);

}  // namespace tierstate_torch
