// SPDX-License-Identifier: Apache-2.0
// OffloadedOptimizer's options (optimizer.hpp): OffloadedOptimizer<...>::options is
// optimizer_options<StateTier::options>.
#pragma once

#include <tierstate/core/config.hpp>
#include <tierstate/core/progress.hpp>
#include <tierstate/core/thread_pool.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>

namespace tierstate::inline TIERSTATE_ABI {

/// What step() does when a gradient holds an infinity or a NaN.
enum class nonfinite_policy : std::uint8_t {
  skip_step,  ///< GradScaler's contract: report it and leave params, state and step count as they are
  report,     ///< report it, and update anyway
  ignore,     ///< do not look (saves one read of the gradients)
};

/// An optimizer over one rank's share of a model (its own tensors, or its element ranges of
/// them) takes its step's decisions with the other ranks': both hooks are called on the
/// thread that checks (step()'s caller, or a streaming step's driver), at most once per step
/// each, in the same order on every rank, so each is one collective (an all-reduce of a flag,
/// an all-gather of block sums). Empty: this process alone. An exception a hook throws fails
/// the step as an I/O error would (refused, nothing changed; a streaming step's finish_step
/// throws it).
struct across_ranks {
  /// Given whether this rank's gradients hold an inf or a NaN: whether any rank's do (with
  /// skip_step, every rank then skips; with report, every rank reports). Called where
  /// on_nonfinite is not `ignore`.
  std::function<bool(bool)> any_nonfinite;
  /// Given this rank's sums of squares per 4096-element block of each tensor (in double, in
  /// element order) in (tensor, block) order, scaled as the gradients are: the 2-norm of every
  /// rank's gradients. One process's norm is the square root of their pairwise sum
  /// (step/checks.hpp); ranks that own whole blocks get the same bits by gathering every
  /// rank's sums in the global (tensor, block) order and summing them so. Called where
  /// max_grad_norm is set and the step is not skipped.
  std::function<double(std::span<double const>)> norm;
};

/// What an OffloadedOptimizer is made with; `tier` holds its state tier's own options.
template <class TierOptions>
struct optimizer_options {
  /// Elements per chunk: a multiple of 2048 (each slot array a multiple of 4 KiB); 0: 2^20
  /// (layout::default_chunk_elements), or, for a load before the state is made (or once it
  /// is lost), the file's.
  /// A model with fewer elements gets one chunk of its own size, rounded up to 2048.
  std::size_t chunk_elements = 0;
  /// Worker threads, the caller included; 0: the CPUs of the affinity mask (with
  /// bind_threads = physical_cores: its physical cores).
  std::size_t threads = 0;
  /// Where the worker threads run: left to the kernel (none), or each bound to a physical
  /// core of the affinity mask (core/thread_pool.hpp). The caller's thread is never bound.
  thread_binding bind_threads = thread_binding::none;
  /// The NUMA node of the staging buffers' memory, and of a PinnedHost state's where
  /// tier.numa_node is -1 (tiers/pinned_host.hpp: needs a build with libnuma); -1: none.
  int numa_node = -1;
  nonfinite_policy on_nonfinite = nonfinite_policy::skip_step;
  /// Clip the gradients' global 2-norm to this, as torch.nn.utils.clip_grad_norm_ does
  /// (after unscaling); 0: no clipping. The norm is summed over fixed 4096-element blocks
  /// of each tensor, combined pairwise in (tensor, block) order: the same bits whatever
  /// the chunk size, the thread count or the order gradients arrive in.
  double max_grad_norm = 0.0;
  /// ZeRO-Offload's delayed parameter update (OnHost compute): step() copies the
  /// gradients into the optimizer's own buffer, waits for the previous step's update,
  /// writes its params into the model, starts this step's update in the background and
  /// returns, so the update runs while the next forward and backward do. The model then
  /// always computes with params one step older than the state: one step of staleness,
  /// a trade of exactness for time that ZeRO-Offload makes only after its first steps.
  /// Costs a model-sized gradient buffer and a model-sized param buffer of pinned host
  /// memory (grad + param bytes per element). flush() (also called by save, load,
  /// copy_state and write_state) waits for the update in flight and writes its params.
  /// Off by default; streaming steps are refused with it.
  bool delayed_update = false;
  /// Streaming steps (begin_step ... finish_step) write their new state to a second copy
  /// (the tier is made twice the state's bytes), which becomes the state only when the step
  /// passes its checks and completes: a step skipped for an inf or a NaN, or one that fails
  /// part way (a full disk), leaves the state as it was and writes back the params it changed
  /// from the master (the state is lost only if that fails). So the non-finite check
  /// (skip_step, report) no longer holds the first update until the last gradient: each chunk
  /// is updated as soon as its gradients are in, as with `ignore`, and checked after.
  /// Clipping still waits. Needs params and gradients in host memory (not CudaOverlapped), a
  /// tier that is not (NvmeFile, a user's), OnHost compute and an fp32 master
  /// (OffloadedOptimizer::can_shadow_state); refused otherwise, and with delayed_update.
  /// Plain step()s are not shadowed. Off by default.
  bool shadow_state = false;
  /// StochasticRounding's seed: with the step count and the tensor's index it picks each
  /// element's random bits (codecs/stochastic_rounding.hpp), so the same seed, model and
  /// gradients give the same params, resumed from a checkpoint or not. Checkpoints do not
  /// record it: resume with the seed the run had. Unused otherwise.
  std::uint64_t rounding_seed = 0;
  across_ranks ranks{};  ///< a rank's share of a model: its decisions taken with the others'
  /// Hears the progress of making the state (core/progress.hpp), and of save and load where
  /// their checkpoint_options name no callback of their own. Empty: none.
  progress_callback progress{};
  TierOptions tier{};  ///< the state tier's own (StateTier::options)
};

}  // namespace tierstate
