// SPDX-License-Identifier: Apache-2.0
// OffloadedOptimizer: the composition users write.
//
//   OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>
//
//   Rule       Adam, AdamW, ... (rules/), SGD, SGDMomentum, Lion, Adafactor, or your own
//   Precision  Fp32, Bf16Mixed, Bf16Mixed8bit, Bf16Stochastic, ..., any Precision<...>
//   StateTier  where master and slots rest between steps: Device, PinnedHost, NvmeFile, or
//              a type of yours that models the `tier` concept (tiers/tier.hpp)
//   Transfer   how chunks move between the tier, the host and the GPU: Synchronous,
//              Pipelined<Depth> to overlap a tier's I/O with compute, or CudaOverlapped<Depth>
//              for params and gradients on the GPU (transfer/cuda_overlapped.hpp)
//   Compute    where the rule runs: OnHost<Arch>, or OnDevice (kernels/device/on_device.hpp)
//
// What each composition is for: README.md, "Using it", "On the GPU", "State on NVMe".
// Usage: add_tensor for every param tensor, add_group where hyper-parameters differ, then
// step() once per iteration with a gradient view per tensor, in registration order. The state
// is made at the first step (or copy_state): the master from the params then, slots zero;
// the set of tensors is then fixed. Thread safety (one caller at a time; grad_ready from any
// thread) and failures (a refused call changes nothing; a failure after a step began changing
// chunks leaves the optimizer *lost*, refusing steps with tierstate::state_lost until a
// checkpoint is loaded): README.md, "Using it" and "Failures".
#pragma once

#include <tierstate/checkpoint/format.hpp>
#include <tierstate/core/concepts.hpp>
#include <tierstate/core/device_runtime.hpp>
#include <tierstate/core/error.hpp>
#include <tierstate/core/layout.hpp>
#include <tierstate/core/precision.hpp>
#include <tierstate/core/stats.hpp>
#include <tierstate/core/tensor.hpp>
#include <tierstate/core/thread_pool.hpp>
#include <tierstate/core/trace.hpp>
#include <tierstate/detail/optimizer/registry_parts.hpp>
#include <tierstate/io/engine.hpp>
#include <tierstate/kernels/host/finite.hpp>
#include <tierstate/kernels/host/on_host.hpp>
#include <tierstate/kernels/host/update.hpp>
#include <tierstate/optimizer_options.hpp>
#include <tierstate/rules/rule.hpp>
#include <tierstate/state/store.hpp>
#include <tierstate/step/checks.hpp>
#include <tierstate/step/delayed_update.hpp>
#include <tierstate/step/grad_keeper.hpp>
#include <tierstate/step/io_watch.hpp>
#include <tierstate/step/streaming_gate.hpp>
#include <tierstate/step/tensor_phase.hpp>
#include <tierstate/tiers/device.hpp>
#include <tierstate/tiers/pinned_host.hpp>
#include <tierstate/tiers/tier.hpp>
#include <tierstate/transfer/concept.hpp>
#include <tierstate/transfer/cuda_overlapped.hpp>
#include <tierstate/transfer/detail/io_worker.hpp>
#include <tierstate/transfer/pipelined.hpp>
#include <tierstate/transfer/routes/route.hpp>
#include <tierstate/transfer/synchronous.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <vector>

namespace tierstate::inline TIERSTATE_ABI {

template <class Rule, precision Precision = Bf16Mixed, tier StateTier = PinnedHost,
          class Transfer = Synchronous, class Compute = OnHost<>>
class OffloadedOptimizer {
 public:
  /// `Rule`, once it models tierstate::rule (rules/rule.hpp); a type that does not is refused
  /// here with one sentence naming the first thing it misses.
  using rule_type = typename detail::checked_rule<Rule>::type;

 private:
  static_assert(transfer<Transfer>,
                "tierstate::OffloadedOptimizer: Transfer must model tierstate::transfer "
                "(transfer/concept.hpp): static constexpr unsigned depth and staging_buffers (more than "
                "depth), and a static template schedule(Route&) that drives a route's legs; the "
                "library's transfers are Synchronous, Pipelined<Depth> and CudaOverlapped<Depth>.");
  static_assert(requires { Compute::runs_on_device; },
                "tierstate::OffloadedOptimizer: the computes available are OnHost<Arch> "
                "(kernels/host/on_host.hpp) and OnDevice (kernels/device/on_device.hpp).");
  static_assert(Precision::state_codec_count == 0 || Precision::state_codec_count == rule_type::slots.size(),
                "tierstate::OffloadedOptimizer: the precision's slot_codecs<...> names one codec per slot of the "
                "rule, in the order of the rule's `slots`; their numbers differ.");

 public:
  /// The composition's route and what it needs (transfer/routes/route.hpp): the one place that
  /// looks at the tier's kind, the compute and the transfer's traits, and refuses what has none.
  using placement = routes::placement<StateTier, Compute, Transfer>;

  using precision_type  = Precision;
  using tier_type       = StateTier;
  using transfer_type   = Transfer;
  using param_type      = typename Precision::param_type;
  using grad_type       = typename Precision::grad_type;
  using state_type      = typename Precision::state_type;
  using hyperparameters = typename rule_type::hyperparameters;
  using compute_type    = Compute;
  using arch            = typename detail::compute_arch<Compute>::type;  ///< the host work's xsimd arch (OnHost's)
  /// The largest codec block of the rule's slots (1 with element codecs only): tensors start,
  /// and the host threads' parts of a chunk begin, on multiples of it.
  static constexpr std::size_t state_block =
    Precision::state_codec_count == 0 || Precision::state_codec_count == rule_type::slots.size()
      ? detail::state_block_v<Precision, rule_type::slots.size()>
      : 1;
  using tensor_id       = std::size_t;
  using group_id        = std::size_t;

  /// The slots this composition keeps, in layout order: the master or the compensation
  /// (when the precision has one), then the rule's.
  static constexpr std::size_t slot_count = rule_type::slots.size() + Precision::leading_slots;
  /// Whether params and gradients may be in device memory: OnDevice compute, or a transfer
  /// that moves them (CudaOverlapped, or one of yours with params_on_device = true).
  static constexpr bool takes_device_params = placement::device_params;

  using options = optimizer_options<typename StateTier::options>;  ///< see optimizer_options.hpp
  /// Whether options::shadow_state is taken: the host-staged route (host params, a tier that is
  /// not host memory, OnHost compute), an fp32 master, and a rule without a tensor phase.
  static constexpr bool can_shadow_state =
    std::is_same_v<routes::route_of<OffloadedOptimizer>, routes::host_staged<OffloadedOptimizer>> &&
    Precision::has_master && !has_tensor_phase<rule_type>;

  /// Group 0 holds every tensor not placed in another group, with `defaults`.
  explicit OffloadedOptimizer(hyperparameters const& defaults = {}, options const& opts = {});
  /// Waits for a delayed update in flight and stops a streaming step's driver. Staging memory
  /// a never-answered transfer may still reach is leaked on purpose (io::engine::held()).
  ~OffloadedOptimizer() { delayed_.wait(); }
  OffloadedOptimizer(OffloadedOptimizer const&)            = delete;
  OffloadedOptimizer& operator=(OffloadedOptimizer const&) = delete;

  /// Registers a parameter tensor; returns its index (its position in step()'s gradients).
  /// `param` must stay valid and is updated in place by every step. `where` says whether it
  /// is host or device memory: device params need CudaOverlapped or OnDevice, and OnDevice
  /// needs them (with CUDA, a pointer in the wrong place is refused).
  tensor_id add_tensor(std::string name, param_type* param, std::size_t count,
                       location where = location::host);
  /// The same, with the tensor's shape as a matrix (rows x columns, row-major: its last
  /// dimension the columns), which a rule with a tensor phase reads; a tensor added by count
  /// is one row. Refused (logic_error) where rows x columns overflows.
  tensor_id add_tensor(std::string name, param_type* param, tensor_shape shape,
                       location where = location::host);
  /// Registers tensor `id` of `source` (offloaded_params: weights in a tier) by its size and name
  /// (or `name`, if not empty): the master comes from it, each update reads and writes params
  /// through it (in a streaming step, also the gradient where it keeps_grads(): see begin_step).
  /// OnHost compute only, without delayed_update or a tensor phase (else logic_error); `source` must outlive it.
  tensor_id add_tensor(param_source<param_type>& source, std::size_t id, std::string name = {});

  /// A parameter group: moves the named tensors (from group 0) into a new group with its
  /// own hyper-parameters, as torch.optim's param_groups do.
  group_id add_group(hyperparameters const& h, std::vector<std::string> const& tensor_names);

  /// Changes a group's hyper-parameters from the next step on (learning-rate schedules).
  void set_hyperparameters(group_id g, hyperparameters const& h);
  [[nodiscard]] hyperparameters const& get_hyperparameters(group_id g) const;
  [[nodiscard]] std::size_t group_count() const noexcept { return groups_.size(); }
  [[nodiscard]] group_id group_of(std::string_view tensor) const;

  /// One optimizer step. `grads` holds one view per registered tensor, in registration
  /// order, each with the tensor's element count: on the host, or (with CudaOverlapped or
  /// OnDevice) on the device; OnDevice needs them on the device. `grad_scale` is the factor
  /// the gradients were multiplied by (GradScaler's scale; 1 when unscaled): the update
  /// divides it out. Device gradients are read after the work queued so far on `ready`
  /// (the stream that produced them; by default the legacy default stream). Blocks until
  /// the step is done, every param written back included. A view {nullptr, 0} says the
  /// tensor has no gradient this step: its param, state and step count stay as they are, as
  /// torch.optim skips a param whose grad is None.
  ///
  /// Looking for non-finite gradients (on_nonfinite) costs one more read of them: on the
  /// device with OnDevice, and with OnHost one more device-to-host copy of device gradients
  /// (grad bytes over PCIe); set `ignore` when the framework has checked already.
  step_result step(std::span<grad_view<grad_type> const> grads, double grad_scale = 1.0,
                   device::stream_view ready = {});

  /// A streaming step, overlapping the update with backward: begin_step() starts it,
  /// grad_ready() hands over a tensor's gradient as soon as it is final (a post-accumulate-grad
  /// hook), from any thread, concurrently; finish_step() marks every tensor not handed over as
  /// having no gradient (as step()'s empty views), waits for the update and returns what step()
  /// would. A chunk is updated once every tensor in it has its gradient, in an order that starts
  /// as the reverse of registration (backward's) and then follows the order the previous step's
  /// chunks became ready. With `micro_batches` = m, a gradient is final at its m-th grad_ready
  /// (gradient accumulation: each call passes the accumulated gradient so far).
  ///
  /// What the options cost the overlap: the non-finite check (on_nonfinite other than
  /// `ignore`), clipping (max_grad_norm) and a rule's tensor phase need every gradient before
  /// the first update, the tier's reads ahead (NvmeFile) still overlapping backward; the check
  /// does not with options::shadow_state (where can_shadow_state), which checks after.
  ///
  /// Between begin_step and finish_step only grad_ready may be called; the results equal
  /// step()'s with the same gradients, bit for bit.
  void begin_step(double grad_scale = 1.0, unsigned micro_batches = 1);
  /// Thread-safe. `g` must stay valid and unchanged until finish_step returns, except a final
  /// gradient where keeps_gradient(t), which goes to its source: a host one before this returns
  /// (reuse it at once), a device one behind (reuse it in work queued on `ready` next; a failure
  /// is finish_step's). Device gradients are read after the work on `ready` so far (default: legacy stream).
  void grad_ready(tensor_id t, grad_view<grad_type> g, device::stream_view ready = {});
  /// Whether t's params rest in a source that keeps_grads(), under OnHost compute (host or device
  /// gradients), with one type for gradients and params.
  [[nodiscard]] bool keeps_gradient(tensor_id t) const;
  step_result finish_step();
  /// The next streaming step's chunk order (empty before the first): the last one's, as they became ready.
  [[nodiscard]] std::vector<std::size_t> const& next_chunk_order() const noexcept { return streaming_.next_order(); }
  [[nodiscard]] bool in_step() const noexcept { return streaming_.open(); }  ///< a streaming step is in progress

  /// delayed_update: waits for the update in flight (if any), writes its params into the
  /// model and returns its result (rethrowing its failure). Without it, does nothing.
  step_result flush();

  /// Steps taken (skipped steps do not count); with a name, the steps that updated that
  /// tensor, as torch.optim's state["step"]: one without a gradient in a step does not count
  /// it, and its next bias corrections are its own next step's (conditional compute, MoE).
  [[nodiscard]] std::int64_t step_count() const noexcept { return step_; }
  [[nodiscard]] std::int64_t step_count(std::string_view tensor) const;
  /// Sets the step count of the optimizer and every tensor, or of one tensor, for state
  /// brought in with write_state (a torch state_dict's state["step"]): its next step is
  /// number n + 1. Refused for n < 0 (tierstate::invalid_option), a name not registered and
  /// during a streaming step (tierstate::logic_error); flushes a delayed update.
  void set_step_count(std::int64_t n);
  void set_step_count(std::string_view tensor, std::int64_t n);

  /// Reads slot `s` of `tensor` (every element, as float) into `to`, from any tier.
  void copy_state(std::string_view tensor, slot s, std::span<float> to);
  /// Writes `from` into slot `s` of `tensor`, rounded to the slot's type. Writing the
  /// master does not change the param: the next step writes it from the master.
  void write_state(std::string_view tensor, slot s, std::span<float const> from);

  /// A rule with a tensor phase (rules/rule.hpp): the floats of `tensor`'s own state
  /// (Rule::tensor_state_size of its shape); 0 for a rule without one.
  [[nodiscard]] std::size_t tensor_state_size(std::string_view tensor);
  /// Reads `tensor`'s own state, as of the last step, into `to` (of tensor_state_size).
  void copy_tensor_state(std::string_view tensor, std::span<float> to);
  /// Replaces `tensor`'s own state with `from` (of tensor_state_size).
  void write_tensor_state(std::string_view tensor, std::span<float const> from);

  /// Saves the whole state (master, slots, step counts, groups, layout, rule, precision) to `path`
  /// (checkpoint/format.hpp) atomically: a crash leaves the previous checkpoint whole, a failure
  /// nothing (io_error); a `path` not a regular file is refused (logic_error). More: checkpoint.inl.
  void save(std::filesystem::path const& path, checkpoint_options const& o = {});
  /// Loads a checkpoint of the same rule, precision, chunk size and tensors, all checked first
  /// (checkpoint_error names the difference): a refused load changes nothing; a read failing
  /// after the checks loses the state ("Failures"). It restores a lost one. More: checkpoint.inl.
  void load(std::filesystem::path const& path, checkpoint_options const& o = {});

  /// The bytes save() would write, in order, to `write` (a stream, a buffer), with no file; a
  /// writer's exception leaves the optimizer as it was. load() and load_from() read them back.
  void save_to(std::function<void(std::span<std::byte const>)> const& write);
  /// load() from `size` bytes that `read(offset, to)` provides (filling `to` with the bytes
  /// at `offset`): the same checks before anything changes (checkpoint_error names
  /// "(load_from)"), the same two passes (the second read failing loses the state).
  void load_from(std::uint64_t size, std::function<void(std::uint64_t offset, std::span<std::byte> to)> const& read,
                 bool verify_checksums = true);

  /// The layout, and the tier holding the state (made on first use, like the state; with
  /// shadow_state, chunk k's state is at one of two places: the tier is twice the layout's).
  [[nodiscard]] layout const& state_layout();
  [[nodiscard]] StateTier& state_tier();
  [[nodiscard]] std::size_t tensor_count() const noexcept { return tensors_.size(); }
  /// Host memory used to stage chunks: for a tier that is not addressable, the transfer's
  /// staging_buffers x the layout's chunk bytes; with CudaOverlapped and OnHost, also
  /// staging_buffers x chunk_elements x (grad + param bytes) for the PCIe copies. Made with
  /// the state. A fixed amount: it does not grow with the model.
  [[nodiscard]] std::size_t staging_bytes() const noexcept;
  /// Device memory used to stage chunks (OnDevice with a host tier: staging_buffers chunks).
  [[nodiscard]] std::size_t device_staging_bytes() const noexcept;
  [[nodiscard]] bool state_lost() const noexcept { return store_.lost(); }  ///< see "Failures" above
  [[nodiscard]] thread_pool& pool() noexcept { return pool_; }

  /// Records every later step, save and load into `t` (core/trace.hpp), which must outlive its
  /// use; null stops. Refused during a streaming step (logic_error); flushes a delayed update
  /// first. With TIERSTATE_TRACE=0 it records nothing.
  void trace(tracer* t);
  [[nodiscard]] tracer* tracing() const noexcept { return tracer_; }

 private:
  using store_type   = detail::state_store<Precision, rule_type, StateTier, placement>;
  using coefficients_type = typename rule_type::coefficients;
  using checks       = detail::step_checks<grad_type, Compute, placement>;
  using device_resources = typename store_type::device_resources;
  using tensor_entry = detail::tensor_entry<param_type>;
  static constexpr bool keeps_grads_in_sources = std::is_same_v<grad_type, param_type> && !placement::on_device;  ///< see keeps_gradient
  /// Makes the state (state/store.hpp) from the tensors registered now; the master is left
  /// unset when `fill_master` is false (load overwrites every chunk).
  void materialize(bool fill_master = true, std::size_t chunk_elements = 0);  ///< 0: opts_'s
  std::size_t find_tensor(std::string_view name, char const* caller) const;
  tensor_id register_tensor(std::string name, param_type* p, tensor_shape s, location where, param_source<param_type>* src, std::size_t id);
  // The routes (transfer/routes/) move a step's chunks through the optimizer's parts.
  template <class> friend class routes::host_in_place;
  template <class> friend class routes::host_staged;
  template <class> friend class routes::device_params_on_host;
  template <class> friend class routes::device_resident;
  template <class> friend class routes::streamed_to_device;
  template <class> friend class routes::detail::tier_io;
  template <class> friend class routes::detail::route_base;
  /// Per tensor, its group's coefficients at its own next step; a step taken counts, for the
  /// optimizer and for each tensor that had a gradient.
  [[nodiscard]] std::vector<coefficients_type> coefficients_for(double grad_scale) const;
  void count_step(std::span<grad_view<grad_type> const> grads) noexcept;
  /// Non-finite detection and clipping; false when the step must be skipped. `host_found`:
  /// the host gradients were looked at already (a streaming step), and what that found.
  bool check_and_clip(std::span<grad_view<grad_type> const> grads, double grad_scale,
                      std::vector<coefficients_type>& coefficients, step_result& result,
                      std::optional<bool> host_found = std::nullopt);
  /// The step after its checks: chunks updated in chunk_at() order, each after await_chunk().
  void run_step(std::span<grad_view<grad_type> const> grads,
                std::vector<coefficients_type>& coefficients, step_result& result);
  /// The chunk at position j of this step's order; a streaming step's wait for chunk k's
  /// gradients (for every gradient, checked, when the checks need them all), and whether
  /// chunk k can start without waiting.
  [[nodiscard]] std::size_t chunk_at(std::size_t j) const noexcept;
  void await_chunk(std::size_t k, step_stats& stats);
  [[nodiscard]] bool chunk_is_ready(std::size_t k);
  void check_not_streaming(char const* call) const;
  step_result step_delayed(std::span<grad_view<grad_type> const> grads, double grad_scale,
                           device::stream_view ready);
  /// A rule with a tensor phase: this step's passes over the gradients (after the checks),
  /// and, with OnDevice, their result copied to the device for the kernels.
  void reduce_tensors(std::span<grad_view<grad_type> const> grads, std::vector<coefficients_type> const& coefficients);
  [[nodiscard]] float const* tensor_state_for_update(std::size_t t) noexcept;  ///< where it runs
  /// Where the update reads and writes tensor t's params: the model's, or (delayed_update)
  /// the optimizer's own buffer, which is host memory.
  [[nodiscard]] param_type* update_params(std::size_t t) const noexcept;
  [[nodiscard]] bool update_params_on_device(std::size_t t) const noexcept;
  void drive_streaming_step();
  void undo_shadowed_step(std::exception_ptr failure);  ///< streaming.inl
  /// Queues the device update of chunk k, whose state is device memory at `chunk`.
  void launch_chunk(std::size_t k, std::byte* chunk, std::span<grad_view<grad_type> const> grads,
                    std::vector<coefficients_type> const& coefficients);
  void check_slot(slot s, char const* call) const;  ///< refuses, naming it, a slot not kept
  void flush_before_load();
  /// The checkpoint's regions through write(offset, data, n), in order.
  template <class Write> void write_checkpoint(PinnedHost& header, PinnedHost& table, progress_callback const& progress,
                                               Write&& write);
  /// Checks and loads `file_bytes` bytes through read(offset, data, n), with four buffers.
  template <class Read> void read_checkpoint(std::uint64_t file_bytes, std::string const& file, bool verify,
                       progress_callback const& progress, PinnedHost& first,
                       PinnedHost& region, PinnedHost& table, PinnedHost& scratch, Read&& read);
  [[nodiscard]] checkpoint::header make_header() const, make_header(layout const& lay) const;  // (made, or `lay`)
  void check_header(checkpoint::header const& h, layout const& lay, std::string const& path) const;
  /// The checkpoint's engine options (given, or the tier's), and the engine, or an io_error naming them.
  [[nodiscard]] io::engine_options checkpoint_io(checkpoint_options const& o) const;
  [[nodiscard]] io::engine checkpoint_engine(io::engine_options const& eo, checkpoint_options const& o, std::string const& path) const;
  /// Updates elements [b, e) of chunk k (whose bytes start at `chunk`) on this thread; device tensors'
  /// gradients and params through the chunk's PCIe staging (`grad_stage`, `param_stage`: chunk_elements each).
  void update_chunk_range(std::size_t k, std::byte* chunk, std::size_t b, std::size_t e,
                          std::span<grad_view<grad_type> const> grads,
                          std::vector<coefficients_type> const& coefficients,
                          grad_type const* grad_stage = nullptr, param_type* param_stage = nullptr);

  options opts_;
  std::vector<hyperparameters> groups_;
  std::vector<tensor_entry> tensors_;
  std::unordered_map<std::string, std::size_t, detail::name_hash, std::equal_to<>> index_;  ///< name -> tensor
  std::vector<param_source<param_type>*> sources_;  ///< of offloaded tensors, each once: flushed after a step
  mutable detail::call_gate gate_;
  std::atomic<std::int64_t> step_{0};  ///< (step_count() may read it while a streaming step counts)
  std::int64_t rounding_step_ = 0;  ///< the step StochasticRounding's keys are made for
  thread_pool pool_;
  tracer* tracer_ = nullptr;  ///< see trace(); read by the legs of a step, set between steps
  detail::io_watch io_watch_;  ///< the notice that steps wait for I/O (step/io_watch.hpp)
  /// The layout, the tier, the staging, the I/O thread, the device resources and the lost state, made
  /// by materialize() (declared before what uses them: the delayed update and the streaming driver stop first).
  store_type store_;
  /// A rule's tensor phase: every tensor's own state (step/tensor_phase.hpp).
  detail::tensor_phase<rule_type> tensor_phase_;

  /// The delayed update (step/delayed_update.hpp); the destructor waits for its worker first.
  detail::delayed_update<grad_type, param_type, coefficients_type, placement::device_params> delayed_;
  /// The streaming gate (step/streaming_gate.hpp), and the keeper of device gradients kept in
  /// sources (step/grad_keeper.hpp), declared last: it hands on what it holds, then the driver stops.
  detail::streaming_gate<grad_type, coefficients_type, placement::device_params> streaming_;
  [[no_unique_address]] detail::grad_keeper_if<grad_type, keeps_grads_in_sources && placement::device_params> keeper_;
};

}  // namespace tierstate

#include <tierstate/detail/optimizer/registry.inl>
#include <tierstate/detail/optimizer/state.inl>
#include <tierstate/detail/optimizer/checks.inl>
#include <tierstate/detail/optimizer/step_host.inl>
#include <tierstate/detail/optimizer/step_device.inl>
#include <tierstate/detail/optimizer/streaming.inl>
#include <tierstate/detail/optimizer/delayed.inl>
#include <tierstate/detail/optimizer/checkpoint_files.inl>
#include <tierstate/detail/optimizer/checkpoint_header.inl>
#include <tierstate/detail/optimizer/checkpoint.inl>
#include <tierstate/detail/optimizer/checkpoint_read.inl>
