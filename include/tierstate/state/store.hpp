// SPDX-License-Identifier: Apache-2.0
// The state store: one optimizer's state and everything made with it. It owns the layout
// (the tensors packed into chunks), the tier that holds the bytes, each chunk's pieces (the
// parts of tensors that fall in it), the pinned staging, the I/O thread, the device streams
// and rings, and the record of a failure that left the state part updated ("lost").
//
// What it makes beside the tier is what the composition's route needs, and what it asks of
// the tier beyond the `tier` concept (addressable memory, staging registration, preflight, an
// engine that may hold buffers), as the composition's placement says
// (transfer/routes/route.hpp): the store itself tests no tier, compute or transfer trait. It
// reads and writes the tier in place where the tier is host memory, through its staging
// otherwise.
//
// The state is made on first use (make), from the tensors registered by then; until then
// made() is false and nothing but layout_for may be called. A failure while making it
// leaves none (discard), so the next call starts over.
//
// A shadowed store (make's `shadow`) has a tier of twice the state's bytes: each chunk has
// two places, one holding its state (the committed one) and one spare. Between
// begin_shadow() and commit_shadow() or abort_shadow(), a step's writes go to the spare
// places (write_offset); a commit makes them the chunks' state, an abort forgets them, and
// the state is then as it was before the step, however far the step got.
#pragma once

#include <tierstate/core/error.hpp>
#include <tierstate/core/layout.hpp>
#include <tierstate/core/progress.hpp>
#include <tierstate/core/numeric.hpp>
#include <tierstate/core/stats.hpp>
#include <tierstate/core/tensor.hpp>
#include <tierstate/detail/optimizer/registry_parts.hpp>
#include <tierstate/state/detail/device_resources.hpp>
#include <tierstate/tiers/pinned_host.hpp>
#include <tierstate/tiers/tier.hpp>
#include <tierstate/transfer/detail/io_worker.hpp>
#include <tierstate/transfer/routes/route.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <type_traits>
#include <vector>

namespace tierstate::inline TIERSTATE_ABI::detail {

template <class Precision, class Rule, tier StateTier, class Placement>
class state_store {
 public:
  using param_type       = typename Precision::param_type;
  using tensor_entry     = detail::tensor_entry<param_type>;
  using piece            = detail::chunk_piece;
  using device_resources = detail::device_resources<Placement::buffers>;

  state_store() = default;
  /// Keeps (leaks) the staging memory when the tier's I/O engine retired with a transfer the
  /// kernel never answered (io::engine::held()): a late transfer must not land in freed pages.
  ~state_store() { keep_held_staging(); }
  state_store(state_store const&)            = delete;
  state_store& operator=(state_store const&) = delete;

  /// Checks the tier's options before anything is made, where the tier can (a missing or
  /// read-only directory fails at construction, not at the first step).
  static void preflight(typename StateTier::options const& tier_options)
  {
    if constexpr (Placement::tier_preflights) { StateTier::preflight(tier_options); }
  }
  /// The layout these tensors get (the same as make makes), without making anything; chunk
  /// elements 0: layout::default_chunk_elements. Throws logic_error for no tensor.
  [[nodiscard]] static tierstate::layout layout_for(std::span<tensor_entry const> tensors,
                                                    std::size_t chunk_elements);

  /// Makes the layout, the tier, the staging and what the route needs; the master from the
  /// params as they are now (when `fill_master`; load overwrites every chunk), the slots zero
  /// (the tier's fill). Does nothing when the state is made already.
  void make(std::span<tensor_entry const> tensors, typename StateTier::options const& tier_options,
            std::size_t chunk_elements, bool fill_master = true, bool shadow = false,
            progress_callback const& progress = {}, int numa_node = -1);
  /// Back to "no state yet".
  void discard() noexcept;
  [[nodiscard]] bool made() const noexcept { return layout_.has_value(); }

  // --- what make made (made() only) -----------------------------------------------------
  [[nodiscard]] tierstate::layout const& layout() const noexcept { return *layout_; }

  // --- where a chunk's state rests (a shadowed store: one of two places) -------------------
  /// The tier's byte offset of chunk k's state.
  [[nodiscard]] std::size_t chunk_offset(std::size_t k) const noexcept
  {
    return (std::size_t{place_.empty() ? 0u : place_[k]} * layout_->chunk_count() + k) * layout_->chunk_bytes();
  }
  /// Where a step writes chunk k's new state: its spare place while shadowing (noted for
  /// commit_shadow), else its own.
  [[nodiscard]] std::size_t write_offset(std::size_t k) noexcept
  {
    if (!shadowing_) { return chunk_offset(k); }
    written_[k] = 1;
    return (std::size_t{place_[k] ^ 1u} * layout_->chunk_count() + k) * layout_->chunk_bytes();
  }
  [[nodiscard]] bool shadowed() const noexcept { return !place_.empty(); }
  [[nodiscard]] bool shadowing() const noexcept { return shadowing_; }
  /// From here on the step's writes go to the spare places (a shadowed store).
  void begin_shadow() noexcept
  {
    shadowing_ = shadowed();
    std::fill(written_.begin(), written_.end(), 0);
  }
  /// The chunks a step wrote (write_offset) now rest in their spare places.
  void commit_shadow() noexcept
  {
    if (shadowing_) {
      for (std::size_t k = 0; k < place_.size(); ++k) { place_[k] ^= written_[k]; }
    }
    shadowing_ = false;
  }
  /// The spare places are forgotten: every chunk's state is as before begin_shadow().
  void abort_shadow() noexcept { shadowing_ = false; }
  /// Points `a`'s (update_arrays') master or compensation and rule slots at element e of the
  /// chunk whose bytes start at `chunk` (a block codec's slot: at the block e starts).
  template <class Arrays>
  void arrays_at(std::byte* chunk, std::size_t e, Arrays& a) const noexcept
  {
    if constexpr (Precision::has_master) {
      a.master = reinterpret_cast<float*>(chunk + layout_->slot_offset(0)) + e;
    } else if constexpr (Precision::has_compensation) {
      a.compensation = reinterpret_cast<bf16*>(chunk + layout_->slot_offset(0)) + e;
    }
    [&]<std::size_t... J>(std::index_sequence<J...>) {
      ((a.state[J] = detail::codec_address<typename Precision::template state_codec<J>>(
          chunk + layout_->slot_offset(Precision::leading_slots + J), e)),
       ...);
    }(std::make_index_sequence<Rule::slots.size()>{});
  }
  [[nodiscard]] StateTier& tier() noexcept { return *tier_; }
  /// The pieces of chunk k, in chunk order.
  [[nodiscard]] std::span<piece const> pieces(std::size_t k) const noexcept
  {
    return {pieces_.data() + chunk_pieces_[k], chunk_pieces_[k + 1] - chunk_pieces_[k]};
  }
  /// Staging buffer b (one chunk), where the placement has host staging.
  [[nodiscard]] std::byte* staging(std::size_t b) noexcept { return staging_->data() + b * layout_->chunk_bytes(); }
  /// The I/O thread, where the placement has one.
  [[nodiscard]] detail::io_worker<StateTier>& io() noexcept { return *io_; }
  /// The device streams and rings, where the placement has device params.
  [[nodiscard]] device_resources& device() noexcept { return *dev_; }
  /// The same, or null where there are none (or no state yet).
  [[nodiscard]] device_resources* device_if_any() noexcept { return dev_.get(); }
  [[nodiscard]] std::size_t staging_bytes() const noexcept
  {
    return (staging_ ? staging_->size() : 0) + (dev_ ? dev_->grad_stage.size() + dev_->param_stage.size() : 0);
  }
  [[nodiscard]] std::size_t device_staging_bytes() const noexcept { return dev_ ? dev_->state_stage_bytes : 0; }

  /// Calls f(chunk bytes) for chunk k: the tier's own memory, or staging buffer 0 read from
  /// the tier (and written back after f when `write_back`). Counts the bytes in `stats`.
  template <class F>
  void with_chunk(std::size_t k, bool write_back, step_stats& stats, F&& f);
  /// Reads slot index `si` of the tensor at layout extent t into `to` (as float).
  void read_slot(std::size_t t, std::size_t si, std::span<float> to);
  /// Writes `from` into slot index `si` of tensor t, rounded to the slot's type. A failed
  /// write may have landed in part: the state is lost.
  void write_slot(std::size_t t, std::size_t si, std::span<float const> from);
  /// Writes the params of chunk k's tensors from its master (a precision with one); those
  /// of the tensors t with only[t] != 0 alone, where `only` is not empty.
  void params_from_master(std::size_t k, std::byte const* chunk, std::span<tensor_entry const> tensors,
                          std::span<char const> only = {}) const;

  // --- lost state ---------------------------------------------------------------------
  [[nodiscard]] bool lost() const noexcept { return !lost_.empty(); }
  [[nodiscard]] std::string const& lost_reason() const noexcept { return lost_; }
  /// Records the failure that left the state part updated (the first one counts where
  /// `keep_first`).
  void mark_lost(std::string what, bool keep_first = false)
  {
    if (!keep_first || lost_.empty()) { lost_ = std::move(what); }
  }
  void clear_lost() noexcept { lost_.clear(); }
  /// Throws state_lost naming the first failure, when the state is lost.
  void check_not_lost(char const* call) const
  {
    if (!lost_.empty()) { throw tierstate::state_lost(call, lost_); }
  }

 private:
  void fill_master(std::span<tensor_entry const> tensors, progress_callback const& progress);
  /// Calls f(std::type_identity<C>{}) with the codec C of slot index si (the master: fp32).
  template <class F>
  static void visit_codec(std::size_t si, F&& f);
  /// Abandons the staging memory if the tier's engine may still use it (see the destructor).
  void keep_held_staging() noexcept;

  std::optional<tierstate::layout> layout_;
  std::optional<StateTier> tier_;
  std::vector<piece> pieces_;
  std::vector<std::size_t> chunk_pieces_;  ///< pieces of chunk k: [chunk_pieces_[k], chunk_pieces_[k + 1])
  std::optional<PinnedHost> staging_;      ///< Placement::host_staging_chunks chunks
  std::unique_ptr<detail::io_worker<StateTier>> io_;  ///< declared after tier_
  std::unique_ptr<device_resources> dev_;             ///< declared after tier_ and staging_
  std::string lost_;  ///< the failure that left the state part updated, or empty
  std::vector<unsigned char> place_;  ///< a shadowed store's: per chunk, which half holds its state
  std::vector<unsigned char> written_;  ///< per chunk: written to its spare place while shadowing
  bool shadowing_ = false;            ///< between begin_shadow and commit_shadow or abort_shadow
};

}  // namespace tierstate::detail

#include <tierstate/state/detail/store.inl>
