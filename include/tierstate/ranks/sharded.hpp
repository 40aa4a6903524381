// SPDX-License-Identifier: Apache-2.0
// ZeRO-1 for a C++ trainer: a replicated model (every rank holds all the params and computes
// gradients on its part of the batch), whose optimizer state is shared out among the ranks
// (ranks/partition.hpp), each rank keeping its share in its own tier. A step:
//   1. agree: every rank's arguments are sound and the same tensors have gradients;
//   2. reduce-scatter each tensor's gradients: each rank receives the sum (or the mean) of
//      its own elements only;
//   3. step this rank's optimizer over its pieces, its non-finite check and its gradient
//      norm agreed with the others through options::ranks (the same bits as one process);
//   4. all-reduce a status word: a rank whose step failed makes every rank throw, naming it;
//   5. all-gather the params: every rank holds the whole updated model again.
// With Comm = ranks::mpi (ranks/mpi.hpp), or any communicator_for the grad and param types.
//
// Failure: a rank that fails before its update (an I/O error in its tier, a lazy state that
// cannot be made) still takes part in every collective of the step, saying so; every rank
// then refuses the step with nothing changed (rank_failed on the others, its own error on
// it). A rank that fails during its update loses its state (OffloadedOptimizer's "Failures");
// the others' updates stand and they throw rank_failed, after which this object refuses
// steps (the ranks' states disagree) until load() (ranks/sharded_checkpoint.hpp).
#pragma once

#include <tierstate/optimizer.hpp>
#include <tierstate/ranks/communicator.hpp>
#include <tierstate/ranks/partition.hpp>
#include <tierstate/step/checks.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace tierstate::inline TIERSTATE_ABI::ranks {

struct sharded_options {
  /// Divide the reduced gradients by the rank count (DDP's mean); false: their sum.
  bool average = true;
  /// The partition's block (ranks::partition_elements); the norm's bits need 4096.
  std::size_t block = 4096;
};

template <class Opt, class Comm>
  requires communicator_for<Comm, typename Opt::grad_type> && communicator_for<Comm, typename Opt::param_type>
class sharded {
 public:
  using optimizer_type  = Opt;
  using param_type      = typename Opt::param_type;
  using grad_type       = typename Opt::grad_type;
  using hyperparameters = typename Opt::hyperparameters;
  using options         = typename Opt::options;
  using tensor_id       = std::size_t;
  using group_id        = std::size_t;

  /// `o.ranks` is this object's (set on the copy it keeps); delayed_update is refused.
  sharded(Comm& comm, hyperparameters const& defaults = {}, options o = {}, sharded_options s = {})
    : comm_(comm), rank_(comm.rank()), size_(comm.size()), opts_(std::move(o)), how_(s)
  {
    if (opts_.delayed_update) {
      throw invalid_option("delayed_update", "true", "ranks::sharded steps and gathers the params in one call");
    }
    if (opts_.ranks.any_nonfinite || opts_.ranks.norm) {
      throw invalid_option("ranks", "set", "ranks::sharded sets options::ranks itself");
    }
    (void)partition_elements(std::span<std::size_t const>{}, size_, how_.block);  // refuses a bad block by name
    groups_.push_back({defaults, {}});
    opts_.ranks.any_nonfinite = [this](bool f) { return agree_nonfinite(f, false); };
    opts_.ranks.norm          = [this](std::span<double const> s) { return agree_norm(s, false); };
  }
  sharded(sharded const&)            = delete;
  sharded& operator=(sharded const&) = delete;

  /// Registers a whole (replicated) param tensor, as OffloadedOptimizer::add_tensor, in the
  /// same order on every rank; before the first step, save or load.
  tensor_id add_tensor(std::string name, param_type* param, std::size_t count)
  {
    check_open("add_tensor");
    if (param == nullptr || count == 0) {
      throw invalid_option("add_tensor", name, "needs a param array of at least one element");
    }
    for (auto const& t : tensors_) {
      if (t.name == name) { throw logic_error("add_tensor: tensor '" + name + "' is registered already"); }
    }
    tensors_.push_back({std::move(name), param, count});
    return tensors_.size() - 1;
  }
  /// A parameter group of whole tensors, as OffloadedOptimizer::add_group.
  group_id add_group(hyperparameters const& h, std::vector<std::string> const& tensor_names)
  {
    check_open("add_group");
    if (tensor_names.empty()) { throw logic_error("add_group: the group names no tensor"); }
    for (auto const& n : tensor_names) { (void)find(n, "add_group"); }
    groups_.push_back({h, tensor_names});
    return groups_.size() - 1;
  }
  void set_hyperparameters(group_id g, hyperparameters const& h)
  {
    if (g >= groups_.size()) { throw logic_error("set_hyperparameters: no group " + std::to_string(g)); }
    if (local_ && inner_group_[g]) { local_->set_hyperparameters(*inner_group_[g], h); }
    groups_[g].h = h;
  }

  /// One step from this rank's own gradients (one view per tensor, registration order; an
  /// empty view on every rank: no gradient). `grad_scale` as OffloadedOptimizer::step.
  step_result step(std::span<grad_view<grad_type> const> grads, double grad_scale = 1.0)
  {
    round_ = {};
    std::exception_ptr failure;
    std::uint64_t shape = tensors_.size();  // which tensors have gradients, and the scale: the same on every rank
    try {
      build();  // (where this rank's optimizer cannot be made, every rank hears of it below)
      if (diverged_) { throw logic_error("step: " + *diverged_); }
      // Without a check or a norm, nothing is agreed between here and the update: a state
      // that cannot be made is heard of here, before any rank changes anything.
      if (local_ && opts_.on_nonfinite == nonfinite_policy::ignore && opts_.max_grad_norm == 0) {
        (void)local_->state_layout();
      }
      if (grads.size() != tensors_.size()) {
        throw invalid_option("step", std::to_string(grads.size()) + " gradients",
                             "this rank registered " + std::to_string(tensors_.size()) + " tensors");
      }
      for (std::size_t t = 0; t < grads.size(); ++t) {
        if (grads[t].size != 0 && (grads[t].size != tensors_[t].count || grads[t].data == nullptr)) {
          throw invalid_option("step", "gradient of '" + tensors_[t].name + "'",
                               "has " + std::to_string(grads[t].size) + " elements; the tensor has " +
                                 std::to_string(tensors_[t].count));
        }
        shape = shape * 1099511628211ULL ^ (grads[t].size != 0 ? 2 * t + 1 : 2 * t);
      }
      shape = shape * 1099511628211ULL ^ std::bit_cast<std::uint64_t>(grad_scale);
    } catch (...) {
      failure = std::current_exception();
    }
    std::uint64_t words[3] = {failure ? detail::failure_word(rank_) : 0, shape, ~shape};
    comm_.max(words);
    if (words[0] != 0) { fail(failure, "failed before its step began", {static_cast<std::size_t>(words[0] - 1)}); }
    if (words[1] != ~words[2]) {
      throw logic_error("step: the ranks disagree on which tensors have gradients or on grad_scale");
    }
    // The reduced gradients of this rank's pieces, and its views of them.
    std::vector<grad_view<grad_type>> mine;
    std::size_t at = 0;
    for (auto const& pc : part_.pieces[rank_]) {
      mine.push_back(grads[pc.tensor].size == 0 ? grad_view<grad_type>{}
                                                : grad_view<grad_type>{share_.data() + at, pc.count, location::host});
      at += pc.count;
    }
    for (std::size_t t = 0; t < tensors_.size(); ++t) {
      if (grads[t].size == 0) { continue; }
      auto const [offset, counts] = counts_in(t);
      comm_.reduce_scatter(std::span<grad_type const>(grads[t].data, grads[t].size),
                           std::span<grad_type>(share_.data() + offset, counts[rank_]), std::span(counts));
    }
    double const scale = how_.average ? grad_scale * static_cast<double>(size_) : grad_scale;
    step_result result;
    if (local_) {
      try {
        result = local_->step(mine, scale);
      } catch (...) {  // (a hook that heard of another rank's failure refused it here: not this rank's)
        if (!round_.aborted) { failure = std::current_exception(); }
      }
    }
    // The collectives this rank's optimizer did not make (it owns nothing, it failed, or it
    // had no gradient to check), as the agreed outcome says every rank makes them.
    try {
      if (opts_.on_nonfinite != nonfinite_policy::ignore && !round_.checked) { agree_nonfinite(false, bool(failure)); }
      if (opts_.max_grad_norm > 0 && !round_.skips(opts_) && !round_.aborted && !round_.normed) {
        agree_norm({}, bool(failure));
      }
    } catch (rank_failed const&) {  // (told below, with every rank's word)
    }
    bool const skipped = round_.skips(opts_);
    std::vector<std::uint64_t> all(size_);
    comm_.gather(failure ? detail::failure_word(rank_) : 0, std::span(all));
    auto const failed = detail::failed_in(all);
    if (!failed.empty()) {
      if (!round_.aborted && !failure && !skipped && local_) {  // it failed after this rank's update was applied
        diverged_ = detail::rank_list(failed) + " failed during its update while this rank's was applied: the "
                    "ranks' states disagree; load a checkpoint";
      }
      fail(failure, "failed its step", failed);
    }
    result.found_nonfinite = round_.nonfinite;
    result.skipped         = skipped;
    result.grad_norm       = round_.norm / scale;  // (OffloadedOptimizer's: the unscaled gradients')
    if (!skipped) {
      ++steps_;
      for (std::size_t t = 0; t < tensors_.size(); ++t) {
        if (grads[t].size == 0) { continue; }
        auto const [offset, counts] = counts_in(t);
        comm_.all_gather(tensors_[t].param, std::span(counts));
      }
    }
    result.step = steps_;
    return result;
  }

  /// The partition (made at the first step, save or load).
  [[nodiscard]] partition const& shares()
  {
    build();
    return part_;
  }
  /// This rank's optimizer over its pieces ("name@begin"), or nullptr where it owns none.
  [[nodiscard]] Opt* local()
  {
    build();
    return local_.get();
  }
  /// Bytes of optimizer state this rank keeps (its layout's).
  [[nodiscard]] std::size_t state_bytes()
  {
    build();
    return local_ ? local_->state_layout().total_bytes() : 0;
  }
  [[nodiscard]] std::int64_t step_count() const noexcept { return steps_; }
  [[nodiscard]] std::size_t rank() const noexcept { return rank_; }
  [[nodiscard]] std::size_t ranks() const noexcept { return size_; }
  [[nodiscard]] Comm& communicator() noexcept { return comm_; }

  /// "name@begin": the name of tensor t's piece from `begin` in a rank's optimizer.
  [[nodiscard]] std::string piece_name(piece const& p) const
  {
    return tensors_.at(p.tensor).name + "@" + std::to_string(p.begin);
  }

 private:
  struct tensor_entry {
    std::string name;
    param_type* param;
    std::size_t count;
  };
  struct group_entry {
    hyperparameters h;
    std::vector<std::string> names;
  };
  /// What this step's agreements found (see step()).
  struct round {
    bool checked   = false;  ///< the non-finite flags were all-reduced
    bool normed    = false;  ///< the norm's sums were gathered
    bool nonfinite = false;
    bool aborted   = false;  ///< a rank said it failed in one of them
    double norm    = 0.0;
    [[nodiscard]] bool skips(options const& o) const noexcept
    {
      return nonfinite && o.on_nonfinite == nonfinite_policy::skip_step;
    }
  };

  template <class, class> friend struct sharded_access;

  void check_open(char const* call) const
  {
    if (built_) { throw logic_error(std::string(call) + ": the tensors are fixed after the first step, save or load"); }
  }
  std::size_t find(std::string const& n, char const* call) const
  {
    for (std::size_t t = 0; t < tensors_.size(); ++t) {
      if (tensors_[t].name == n) { return t; }
    }
    throw logic_error(std::string(call) + ": no tensor '" + n + "'");
  }

  /// The partition, this rank's optimizer over its pieces, and its groups.
  void build()
  {
    if (built_) { return; }
    if (tensors_.empty()) { throw logic_error("ranks::sharded: no tensor is registered"); }
    std::vector<std::size_t> sizes;
    for (auto const& t : tensors_) { sizes.push_back(t.count); }
    part_ = partition_elements(sizes, size_, how_.block);
    auto const& mine = part_.pieces[rank_];
    inner_group_.assign(groups_.size(), std::nullopt);
    if (!mine.empty()) {
      auto opt = std::make_unique<Opt>(groups_[0].h, opts_);
      for (auto const& pc : mine) { opt->add_tensor(piece_name(pc), tensors_[pc.tensor].param + pc.begin, pc.count); }
      inner_group_[0] = 0;
      for (std::size_t g = 1; g < groups_.size(); ++g) {
        std::vector<std::string> names;
        for (auto const& pc : mine) {
          for (auto const& n : groups_[g].names) {
            if (tensors_[pc.tensor].name == n) { names.push_back(piece_name(pc)); }
          }
        }
        if (!names.empty()) { inner_group_[g] = opt->add_group(groups_[g].h, names); }
      }
      local_ = std::move(opt);
    }
    share_.resize(part_.elements(rank_));
    built_ = true;
  }

  /// Where tensor t's pieces begin in this rank's share, and every rank's count of t.
  std::pair<std::size_t, std::vector<std::size_t>> counts_in(std::size_t t) const
  {
    std::vector<std::size_t> counts(size_, 0);
    std::size_t offset = 0;
    for (std::size_t r = 0; r < size_; ++r) {
      for (auto const& pc : part_.pieces[r]) {
        if (pc.tensor == t) { counts[r] = pc.count; }
        if (r == rank_ && pc.tensor < t) { offset += pc.count; }
      }
    }
    return {offset, counts};
  }

  /// The non-finite flags all-reduced (options::ranks.any_nonfinite, or played for an
  /// optimizer that did not); throws rank_failed where a rank said it failed.
  bool agree_nonfinite(bool found, bool failed)
  {
    std::uint64_t w[2] = {found ? 1u : 0u, failed ? detail::failure_word(rank_) : 0};
    comm_.max(w);
    round_.checked   = true;
    round_.nonfinite = w[0] != 0;
    if (w[1] != 0) {
      round_.aborted = true;
      throw_aborted(w[1] - 1);
    }
    return round_.nonfinite;
  }
  /// The norm of every rank's block sums (options::ranks.norm): their counts, then the sums,
  /// summed pairwise in rank order (one process's order: see partition.hpp).
  double agree_norm(std::span<double const> sums, bool failed)
  {
    std::vector<std::uint64_t> counts(size_);
    comm_.gather(failed ? ~std::uint64_t{0} : sums.size(), std::span(counts));
    round_.normed = true;
    for (std::size_t r = 0; r < size_; ++r) {
      if (counts[r] == ~std::uint64_t{0}) {
        round_.aborted = true;
        throw_aborted(r);
      }
    }
    std::vector<std::size_t> n(counts.begin(), counts.end());
    std::size_t total = 0;
    for (auto const c : n) { total += c; }
    std::vector<double> all(total);
    comm_.gather(sums, std::span(all), std::span<std::size_t const>(n));
    round_.norm = std::sqrt(tierstate::detail::pairwise_sum(all.data(), all.size()));
    return round_.norm;
  }
  [[noreturn]] void throw_aborted(std::size_t r) const
  {
    std::vector<std::size_t> const who{r};
    throw rank_failed(who, "rank " + std::to_string(rank_) + ": the step was refused on every rank: " +
                             detail::rank_list(who) + " failed in it (its own error says why)");
  }
  /// Throws this rank's own failure, or rank_failed naming the ranks that failed.
  [[noreturn]] void fail(std::exception_ptr own, char const* what, std::vector<std::size_t> who)
  {
    if (own) { std::rethrow_exception(own); }
    std::string const list = detail::rank_list(who);
    throw rank_failed(who, "rank " + std::to_string(rank_) + ": " + list + " " + what +
                             " (its own error says why); " +
                             (diverged_ ? *diverged_ : std::string("this rank refused it, with nothing changed")));
  }

  Comm& comm_;
  std::size_t rank_;
  std::size_t size_;
  options opts_;
  sharded_options how_;
  std::vector<tensor_entry> tensors_;
  std::vector<group_entry> groups_;
  bool built_ = false;
  partition part_;
  std::unique_ptr<Opt> local_;
  std::vector<std::optional<std::size_t>> inner_group_;
  std::vector<grad_type> share_;  ///< this rank's reduced gradients, its pieces back to back
  round round_;
  std::int64_t steps_ = 0;
  std::optional<std::string> diverged_;
};

}  // namespace tierstate::ranks
