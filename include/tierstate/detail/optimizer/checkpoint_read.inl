// SPDX-License-Identifier: Apache-2.0
// read_checkpoint: a checkpoint's bytes read back through a caller's reader, each part checked
// (header, table, checksums) before any of it reaches the state; load and load_from call it.
#pragma once

#include <tierstate/checkpoint/detail/params_region.hpp>

namespace tierstate::inline TIERSTATE_ABI {

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
template <class Read>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::read_checkpoint(std::uint64_t file_bytes,
    std::string const& file, bool verify, progress_callback const& progress, PinnedHost& first, PinnedHost& region,
    PinnedHost& table, PinnedHost& scratch, Read&& read)
{
  if (file_bytes < checkpoint::block) {
    throw checkpoint_error(file, "is " + std::to_string(file_bytes) + " bytes, shorter than a header (truncated)");
  }
  // Everything is checked against the layout this optimizer has, or would make: nothing is
  // made before the file is known to be good.
  std::optional<layout> planned;
  if (!store_.made()) { planned.emplace(store_type::layout_for(tensors_, opts_.chunk_elements)); }
  layout const* lay = store_.made() ? &store_.layout() : &*planned;
  // The header: its first block, then the rest, bounded by what a header of this
  // optimizer's tensors can need (its own size, with a group per tensor), and never more
  // than 8 MiB for another's: a file's claim is never allocated before it is bounded.
  first = PinnedHost(checkpoint::block);
  read(0, first.data(), checkpoint::block);
  std::uint64_t const own_payload = checkpoint::encode(make_header(*lay)).size();
  std::uint64_t const max_header  = std::max<std::uint64_t>(
    std::uint64_t{8} << 20,
    own_payload + (tensors_.size() + 1) * (8 * rule_type::hyperparameter_table.size() + 8) + checkpoint::block);
  std::uint64_t const H = checkpoint::header_bytes({first.data(), first.size()}, file_bytes, file, max_header);
  region = PinnedHost(H);
  std::memcpy(region.data(), first.data(), checkpoint::block);
  if (H > checkpoint::block) { read(checkpoint::block, region.data() + checkpoint::block, H - checkpoint::block); }
  checkpoint::header const h = checkpoint::decode({region.data(), region.size()}, file, verify);
  // No chunk asked for, and no state to keep (none yet, or a lost one, which a load rewrites
  // whole): the file's chunk, so a file saved with another loads; the state is made with it
  // below (a lost one made again).
  bool const adopt = opts_.chunk_elements == 0 && (!store_.made() || store_.lost()) &&
                     h.chunk_elements != lay->chunk_elements() && h.chunk_elements != 0 &&
                     h.chunk_elements % layout::element_granularity == 0;
  if (adopt) {
    planned.emplace(store_type::layout_for(tensors_, h.chunk_elements));
    lay = &*planned;
  }
  check_header(h, *lay, file);

  // The file's size, now that its layout is known to be ours.
  std::size_t const B   = lay->chunk_bytes();
  std::size_t const C   = lay->chunk_count();
  std::vector<std::uint64_t> counts;  // of the tensors whose params the file keeps
  for (auto const t : h.param_tensors) { counts.push_back(tensors_[t].count); }
  std::size_t const PB  = checkpoint::detail::param_block_bytes(B);
  std::uint64_t const P = checkpoint::detail::param_blocks(counts, sizeof(param_type), PB);  // (at R)
  std::uint64_t const R = H + C * B;
  std::uint64_t const T = checkpoint::table_bytes(C + P);
  if (file_bytes != R + P * PB + T) {
    throw checkpoint_error(file, "is " + std::to_string(file_bytes) + " bytes; its header describes " +
                                   std::to_string(R + P * PB + T) + " (truncated or extended)");
  }
  table = PinnedHost(T);
  read(R + P * PB, table.data(), T);
  std::vector<std::uint64_t> const sums = checkpoint::decode_table({table.data(), table.size()}, C + P, file, verify);
  auto corrupt_params = [&](std::uint64_t j) {
    return checkpoint_error(file, "params block " + std::to_string(j) + " of " + std::to_string(P) + " (bytes [" +
                                    std::to_string(R + j * PB) + ", " + std::to_string(R + (j + 1) * PB) +
                                    ") of the file) does not match its checksum (corrupt)");
  };

  auto corrupt_chunk = [&](std::size_t k) {
    return checkpoint_error(file, "chunk " + std::to_string(k) + " of " + std::to_string(C) + " (bytes [" +
                                    std::to_string(H + k * B) + ", " + std::to_string(H + (k + 1) * B) +
                                    ") of the file) does not match its checksum (corrupt)");
  };
  scratch = PinnedHost(P > 0 ? std::max(B, PB) : B);  // one chunk (or params block): all load needs beyond
  std::uint64_t const total = std::uint64_t{C} * B + P * PB;  // (a pass's bytes)
  auto const report         = [&](progress_phase phase, std::uint64_t done) {
    if (progress) { progress(phase, done, total); }
  };
  // Pass 1: every chunk verified before anything changes.
  if (verify) {
    for (std::size_t k = 0; k < C; ++k) {
      read(H + k * B, scratch.data(), B);
      if (checkpoint::checksum(scratch.data(), B) != sums[k]) { throw corrupt_chunk(k); }
      if (k + 1 < C || P > 0) { report(progress_phase::verify, (k + 1) * B); }
    }
    for (std::uint64_t j = 0; j < P; ++j) {
      read(R + j * PB, scratch.data(), PB);
      if (checkpoint::checksum(scratch.data(), PB) != sums[C + j]) { throw corrupt_params(j); }
      if (j + 1 < P) { report(progress_phase::verify, C * B + (j + 1) * PB); }
    }
    report(progress_phase::verify, total);
  }
  // The file is good: the state is made (its master is not filled from the params: every
  // chunk is loaded below) and replaced. A failure from here on leaves it part loaded: lost.
  bool const was_made = store_.made();
  if (adopt && was_made) { store_.discard(); }  // lost, at another chunk
  try {
    materialize(false, adopt ? h.chunk_elements : 0);
  } catch (...) {
    if (!was_made) { store_.discard(); }  // a fresh optimizer stays fresh
    throw;
  }
  delayed_.discard();  // its param buffer is made afresh from the params load writes
  try {
    // Read into load's own buffer, then copied into the tier: a read that hangs never holds
    // the tier's memory, which a later load would then share with a late transfer.
    for (std::size_t k = 0; k < C; ++k) {
      std::byte* chunk = scratch.data();
      read(H + k * B, chunk, B);
      if (verify && checkpoint::checksum(chunk, B) != sums[k]) { throw corrupt_chunk(k); }
      store_.tier().write(store_.chunk_offset(k), std::span<std::byte const>(chunk, B));
      store_.params_from_master(k, chunk, tensors_);
      if (k + 1 < C || P > 0) { report(progress_phase::load, (k + 1) * B); }
    }
    for (std::uint64_t j = 0; j < P; ++j) {  // the params the file keeps: after the master's
      read(R + j * PB, scratch.data(), PB);
      if (verify && checkpoint::checksum(scratch.data(), PB) != sums[C + j]) { throw corrupt_params(j); }
      checkpoint::detail::walk_param_block(counts, sizeof(param_type), j, PB, scratch.data(),
                                           [&](std::size_t i, std::size_t offset, std::byte* at, std::size_t n) {
                                             detail::write_params(tensors_[h.param_tensors[i]], offset,
                                                          {reinterpret_cast<param_type const*>(at), n});
                                           });
      if (j + 1 < P) { report(progress_phase::load, C * B + (j + 1) * PB); }
    }
    detail::flush_sources(sources_);  // every param in its tier before load returns
    report(progress_phase::load, total);
  } catch (std::exception const& e) {
    store_.mark_lost(e.what());
    throw;
  } catch (...) {  // (a progress callback may throw anything)
    store_.mark_lost("load: an exception that is not a std::exception, part way through the load");
    throw;
  }
  step_ = h.step;
  groups_.clear();
  for (auto const& g : h.groups) { groups_.push_back(hyperparameters_from_values<rule_type>(g)); }
  for (std::size_t t = 0; t < tensors_.size(); ++t) {
    tensors_[t].group = h.tensors[t].group;
    tensors_[t].step  = h.tensors[t].step;
  }
  if constexpr (has_tensor_phase<rule_type>) {
    for (std::size_t t = 0; t < tensors_.size(); ++t) {
      auto const& values = h.tensor_states[t].values;
      std::copy(values.begin(), values.end(), tensor_phase_.state(t).begin());
    }
  }
  store_.clear_lost();
}

}  // namespace tierstate
