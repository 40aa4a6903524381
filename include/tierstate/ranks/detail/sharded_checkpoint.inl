// SPDX-License-Identifier: Apache-2.0
// ranks::sharded's save and load (the bottom half of ranks/sharded.hpp): each rank's share in
// its own file, a manifest naming them (ranks/detail/manifest.hpp), and loading at another rank
// count by reading each rank's new elements out of the files that hold them.
#pragma once

#include <cstdio>
#include <map>
#include <random>

namespace tierstate::inline TIERSTATE_ABI::ranks {

template <class Opt, class Comm>
  requires communicator_for<Comm, typename Opt::grad_type> && communicator_for<Comm, typename Opt::param_type>
void sharded<Opt, Comm>::save(std::filesystem::path const& dir)
{
  if constexpr (memory != location::host) {
    throw logic_error("ranks::sharded::save: not built for a communicator of device memory yet (host params only)");
  }
  std::exception_ptr failure;
  std::uint64_t agreed[2] = {0, 0};  // a failure; the generation (rank 0's random number, by max)
  prepare();
  try {
    if (diverged_) { throw logic_error("save: " + *diverged_); }
    if (rank_ == 0) { agreed[1] = (std::uint64_t{std::random_device{}()} << 32) ^ std::random_device{}(); }
  } catch (...) {
    failure   = std::current_exception();
    agreed[0] = detail::failure_word(rank_);
  }
  comm_.max(agreed);
  if (agreed[0] != 0) { fail(failure, "could not save", {static_cast<std::size_t>(agreed[0] - 1)}); }
  auto const name = [&](std::size_t r) {
    return detail::cat("rank", std::to_string(r), "-of-", std::to_string(size_), ".", detail::hex16(agreed[1]), ".tsck");
  };
  std::pair<std::uint64_t, std::uint64_t> sum{0, 0};  // this rank's file's checksum and bytes
  bool wrote = false;
  auto const mine = dir / name(rank_);
  auto const all_well = [&](char const* what) {  // every rank's word; on a failure, this save's files go
    std::vector<std::uint64_t> words(size_);
    comm_.gather(failure ? detail::failure_word(rank_) : 0, std::span(words));
    auto const failed = detail::failed_in(words);
    if (failed.empty()) { return; }
    std::error_code ec;
    if (wrote) { std::filesystem::remove(mine, ec); }
    fail(failure, what, failed);
  };
  try {
    if (local_) {
      local_->save(mine);
      wrote = true;
      sum   = detail::file_checksum(mine);
    }
  } catch (...) {
    failure = std::current_exception();
  }
  all_well("could not save its share");
  std::vector<std::uint64_t> sums(size_);
  std::vector<std::uint64_t> bytes(size_);
  comm_.gather(sum.first, std::span(sums));
  comm_.gather(sum.second, std::span(bytes));
  std::vector<std::string> previous;  // the files of the save this one replaces (rank 0's to remove)
  if (rank_ == 0) {
    try {
      auto const path = dir / "manifest";
      if (std::filesystem::exists(path)) {
        try {
          for (auto const& f : detail::parse_manifest(detail::read_small(path), path.string()).files) {
            if (!f.name.empty()) { previous.push_back(f.name); }
          }
        } catch (std::exception const&) {  // (a damaged one names nothing to remove)
        }
      }
      detail::manifest m;
      m.block      = how_.block;
      m.step       = steps_;
      m.generation = agreed[1];
      for (auto const& t : tensors_) { m.tensors.emplace_back(t.name, t.count); }
      for (auto const& g : groups_) {
        auto const v = hyperparameter_values<typename Opt::rule_type>(g.h);
        m.groups.emplace_back(v.begin(), v.end());
      }
      for (std::size_t r = 0; r < size_; ++r) {
        m.files.push_back({part_.pieces[r].empty() ? std::string() : name(r), bytes[r], sums[r], part_.pieces[r]});
      }
      detail::write_atomically(path, detail::to_text(m));
    } catch (...) {
      failure = std::current_exception();
    }
  }
  all_well("could not write the manifest");
  for (auto const& f : previous) {  // only files of a save's own naming, and none of this one's
    bool const ours = f.starts_with("rank") && f.ends_with(".tsck") && f.find("-of-") != std::string::npos &&
                      f.find(detail::hex16(agreed[1])) == std::string::npos;
    std::error_code ec;
    if (ours) { std::filesystem::remove(dir / f, ec); }  // (already gone: nothing to do)
  }
}

/// Rank q's file of `m`, loaded into an optimizer of this one's type over q's pieces (params in
/// `params`), after its checksum is checked against the manifest's.
template <class Opt, class Comm>
  requires communicator_for<Comm, typename Opt::grad_type> && communicator_for<Comm, typename Opt::param_type>
std::unique_ptr<Opt> sharded<Opt, Comm>::open_rank_file(detail::manifest const& m, std::size_t q,
                                                        std::filesystem::path const& dir,
                                                        std::vector<std::vector<param_type>>& params)
{
  auto const& f   = m.files[q];
  auto const path = dir / f.name;
  auto const sum  = detail::file_checksum(path);
  if (sum.first != f.checksum || sum.second != f.bytes) {
    throw checkpoint_error(path.string(), detail::cat("does not match the manifest's checksum and size for rank ",
                                                        std::to_string(q), " (from another save, or changed since)"));
  }
  auto o           = opts_;
  o.ranks          = {};
  o.chunk_elements = 0;  // the file's
  if constexpr (requires { o.tier.file_name; }) { o.tier.file_name.clear(); }  // (a name of its own)
  auto opt         = std::make_unique<Opt>(groups_[0].h, o);
  params.assign(f.pieces.size(), {});
  for (std::size_t k = 0; k < f.pieces.size(); ++k) {
    params[k].resize(f.pieces[k].count);
    opt->add_tensor(piece_name(f.pieces[k]), params[k].data(), f.pieces[k].count);
  }
  opt->load(path);
  return opt;
}

template <class Opt, class Comm>
  requires communicator_for<Comm, typename Opt::grad_type> && communicator_for<Comm, typename Opt::param_type>
void sharded<Opt, Comm>::load(std::filesystem::path const& dir)
{
  if constexpr (memory != location::host) {
    throw logic_error("ranks::sharded::load: not built for a communicator of device memory yet (host params only)");
  }
  prepare();  // (a refused load then leaves what prepare() would have made)
  std::exception_ptr failure;
  detail::manifest m;
  std::uint64_t read = settings_;  // the settings and the manifest this rank read: alike on every rank
  bool direct = false;  // each rank owns what it owned then: its own file
  std::vector<piece> mine;  // (this rank's pieces)
  // Re-partitioned: each of this rank's pieces' slots, params, step counts and hyper-parameters.
  std::vector<staged> slots;
  std::vector<std::vector<param_type>> params;
  std::vector<std::int64_t> counts;
  std::vector<hyperparameters> hypers;  // each group's, the manifest's
  try {
    build();
    mine            = part_.pieces[rank_];
    auto const path = dir / "manifest";
    auto const text = detail::read_small(path);
    m               = detail::parse_manifest(text, path.string());
    read            = detail::mix(read, checkpoint::checksum(text.data(), text.size()));
    bool same       = m.tensors.size() == tensors_.size();
    for (std::size_t t = 0; same && t < tensors_.size(); ++t) {
      same = m.tensors[t] == std::pair{tensors_[t].name, tensors_[t].count};
    }
    if (!same) { throw checkpoint_error(path.string(), "its tensors (names and sizes, in order) are not this optimizer's"); }
    if (m.groups.size() != groups_.size()) {
      throw checkpoint_error(path.string(), detail::cat("saved with ", std::to_string(m.groups.size()),
                                                          " parameter groups; this optimizer has ",
                                                          std::to_string(groups_.size())));
    }
    for (auto const& g : m.groups) { hypers.push_back(hyperparameters_from_values<typename Opt::rule_type>(g)); }
    if (m.block != how_.block) {
      throw checkpoint_error(path.string(), detail::cat("saved with a partition block of ", std::to_string(m.block),
                                                          " elements; this optimizer's is ", std::to_string(how_.block)));
    }
    direct = m.files.size() == size_;
    for (std::size_t r = 0; direct && r < size_; ++r) { direct = m.files[r].pieces == part_.pieces[r]; }
    if (direct && local_) {
      auto const& f  = m.files[rank_];
      auto const sum = detail::file_checksum(dir / f.name);
      if (sum.first != f.checksum || sum.second != f.bytes) {
        throw checkpoint_error((dir / f.name).string(), "does not match the manifest's checksum and size (from "
                                                        "another save, or changed since)");
      }
    } else if (!direct && local_) {
      auto const layout_slots = local_->state_layout().slots();
      slots.assign(mine.size(), staged(layout_slots.size()));
      params.assign(mine.size(), {});
      counts.assign(mine.size(), m.step);
      for (std::size_t k = 0; k < mine.size(); ++k) {
        for (auto& s : slots[k]) { s.resize(mine[k].count); }
        params[k].resize(mine[k].count);
      }
      // Each old rank whose elements this rank now owns: its file, once, each overlap copied.
      for (std::size_t q = 0; q < m.files.size(); ++q) {
        auto const& old = m.files[q].pieces;
        auto overlaps   = [&](piece const& a, piece const& b) {
          return a.tensor == b.tensor && a.begin < b.begin + b.count && b.begin < a.begin + a.count;
        };
        bool needed = false;
        for (auto const& op : old) {
          for (auto const& np : mine) { needed = needed || overlaps(op, np); }
        }
        if (!needed) { continue; }
        std::vector<std::vector<param_type>> old_params;
        auto const scratch = open_rank_file(m, q, dir, old_params);
        std::vector<float> whole;
        for (std::size_t j = 0; j < old.size(); ++j) {
          auto const on = piece_name(old[j]);
          for (std::size_t k = 0; k < mine.size(); ++k) {
            if (!overlaps(old[j], mine[k])) { continue; }
            std::size_t const from  = std::max(old[j].begin, mine[k].begin);
            std::size_t const until = std::min(old[j].begin + old[j].count, mine[k].begin + mine[k].count);
            for (std::size_t s = 0; s < layout_slots.size(); ++s) {
              whole.resize(old[j].count);
              scratch->copy_state(on, layout_slots[s], std::span<float>(whole));
              std::copy(whole.begin() + (from - old[j].begin), whole.begin() + (until - old[j].begin),
                        slots[k][s].begin() + (from - mine[k].begin));
            }
            std::copy(old_params[j].begin() + (from - old[j].begin), old_params[j].begin() + (until - old[j].begin),
                      params[k].begin() + (from - mine[k].begin));
            counts[k] = scratch->step_count(on);
          }
        }
      }
    }
  } catch (...) {
    failure = std::current_exception();
  }
  agree_to_begin(failure, read, "refused the load (nothing changed on any rank)");
  // Everything is read and checked: now the state is replaced.
  try {
    if (direct && local_) {
      local_->load(dir / m.files[rank_].name);
    } else if (local_) {
      auto const layout_slots = local_->state_layout().slots();
      local_->set_step_count(m.step);
      for (std::size_t k = 0; k < mine.size(); ++k) {
        auto const pn = piece_name(mine[k]);
        for (std::size_t s = 0; s < layout_slots.size(); ++s) {
          local_->write_state(pn, layout_slots[s], std::span<float const>(slots[k][s]));
        }
        local_->set_step_count(pn, counts[k]);
        if constexpr (Opt::precision_type::has_master) {  // (else the params are the model's own, not the state's)
          std::copy(params[k].begin(), params[k].end(), tensors_[mine[k].tensor].param + mine[k].begin);
        }
      }
    }
    for (std::size_t g = 0; g < groups_.size(); ++g) {  // (every rank's, its own group or not)
      if (local_ && inner_group_[g]) { local_->set_hyperparameters(*inner_group_[g], hypers[g]); }
      groups_[g].h = hypers[g];
    }
  } catch (...) {
    failure = std::current_exception();
  }
  {
    std::vector<std::uint64_t> words(size_);
    comm_.gather(failure ? detail::failure_word(rank_) : 0, std::span(words));
    if (auto const failed = detail::failed_in(words); !failed.empty()) {  // some ranks loaded, some did not
      diverged_ = detail::rank_list(failed) + " failed to load while the others loaded: the ranks' states disagree; "
                  "load again";
      fail(failure, "failed to load its share", failed);
    }
  }
  for (std::size_t t = 0; t < tensors_.size(); ++t) {  // every rank's params, from the ranks that loaded them
    comm_.all_gather(tensors_[t].param, std::span<std::size_t const>(counts_[t]));
  }
  steps_ = m.step;
  diverged_.reset();
  prepared_ = true;  // (its state and every rank's params are the checkpoint's)
}

}  // namespace tierstate::ranks
