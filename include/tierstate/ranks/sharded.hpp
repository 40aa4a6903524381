// SPDX-License-Identifier: Apache-2.0
// ZeRO-1 for a C++ trainer: a replicated model (every rank holds all the params and computes
// gradients on its part of the batch), whose optimizer state is shared out among the ranks
// (ranks/partition.hpp), each rank keeping its share in its own tier. A step:
//   1. agree: every rank's settings and arguments are sound and alike (one hash each);
//   2. reduce-scatter each tensor's gradients: each rank receives the sum (or the mean) of
//      its own elements only;
//   3. step this rank's optimizer over its pieces, its non-finite check and its gradient
//      norm agreed with the others through options::ranks (the same bits as one process);
//   4. gather a status word: a rank whose step failed makes every rank throw, naming it;
//   5. all-gather the params: every rank holds the whole updated model again.
// With Comm = ranks::mpi (ranks/mpi.hpp), or any communicator_for the grad and param types.
// The first step (or prepare()) gives every rank rank 0's params, as DDP does.
//
// Failure: a rank that fails before the ranks' last agreement before the update (the
// non-finite check, else the norm, else step 1; a state that cannot be made is found in
// prepare()) still takes part in every collective of the step, saying so; every rank then
// refuses the step with nothing changed (rank_failed on the others, its own error on it). A
// rank that fails after it (an I/O error in its tier during its update) loses its state
// (OffloadedOptimizer's "Failures"); the others' updates stand and they throw rank_failed,
// after which every rank refuses steps (their states disagree) until load().
#pragma once

#include <tierstate/optimizer.hpp>
#include <tierstate/ranks/communicator.hpp>
#include <tierstate/ranks/detail/manifest.hpp>
#include <tierstate/ranks/partition.hpp>
#include <tierstate/step/checks.hpp>

#include <bit>
#include <string_view>
#include <type_traits>
#include <utility>
#include <cmath>
#include <cstdint>
#include <exception>
#include <filesystem>
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
  static_assert(!has_tensor_phase<typename Opt::rule_type>, "ranks::sharded: per-tensor statistics (Adafactor's) need whole tensors");
  static_assert(!std::is_same_v<typename Opt::precision_type::master_type, StochasticRounding>,
                "ranks::sharded: stochastic rounding draws its bits by tensor and offset, which pieces would change");

 public:
  using optimizer_type  = Opt;
  using param_type      = typename Opt::param_type;
  using grad_type       = typename Opt::grad_type;
  using hyperparameters = typename Opt::hyperparameters;
  using options         = typename Opt::options;
  using tensor_id       = std::size_t;
  using group_id        = std::size_t;
  /// Where the params and gradients are: the communicator's memory (host, or device for NCCL).
  static constexpr location memory = memory_of<Comm>();
  static_assert(memory == location::host || Opt::takes_device_params,
                "ranks::sharded: a communicator of device memory needs an optimizer that takes device params "
                "(CudaOverlapped or OnDevice)");

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
    if (how_.block == 0 || how_.block % 4096 != 0) {  // (the norm's blocks: a cut elsewhere would split one)
      throw invalid_option("block", std::to_string(how_.block), "must be a positive multiple of 4096");
    }
    groups_.push_back({defaults, {}});
    opts_.ranks.any_nonfinite = [this](bool f) { return agree_nonfinite(f, false); };
    opts_.ranks.norm          = [this](std::span<double const> s) { return agree_norm(s, false); };
  }
  sharded(sharded const&)            = delete;
  sharded& operator=(sharded const&) = delete;

  /// Registers a whole (replicated) param tensor, as OffloadedOptimizer::add_tensor, in the
  /// communicator's memory, in the same order on every rank; before the first step, save or load.
  tensor_id add_tensor(std::string name, param_type* param, std::size_t count)
  {
    check_open("add_tensor");
    if (param == nullptr || count == 0) {
      throw invalid_option("add_tensor", name, "needs a param array of at least one element");
    }
    if (name.empty() || name.find('\n') != std::string::npos) {  // (a manifest line holds it)
      throw invalid_option("add_tensor", "\"" + name + "\"", "a name is one line of at least one character");
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
  /// Every rank alike (a rank without the group's elements checks `h` all the same).
  void set_hyperparameters(group_id g, hyperparameters const& h)
  {
    if (g >= groups_.size()) { throw logic_error(detail::cat("set_hyperparameters: no group ", std::to_string(g))); }
    validate_hyperparameters<typename Opt::rule_type>(h);
    if (local_ && inner_group_[g]) { local_->set_hyperparameters(*inner_group_[g], h); }
    groups_[g].h = h;
  }

  /// Collective, once: makes this rank's optimizer and its state (a failure on any rank fails
  /// every rank, naming it), and gives every rank rank 0's params, as DDP does at its start.
  /// The first step, save or load calls it; local(), shares() and state_bytes() make what
  /// they need on this rank alone (no collective: a failure there is this rank's only).
  void prepare();

  /// One step from this rank's own gradients (host memory, one view per tensor, registration
  /// order; an empty view, on every rank alike: no gradient, as torch.optim's None, where DDP
  /// would reduce zeros). `grad_scale` as OffloadedOptimizer::step. The ranks' settings, the
  /// gradients they have and grad_scale must agree (else logic_error on every rank).
  step_result step(std::span<grad_view<grad_type> const> grads, double grad_scale = 1.0);

  /// Saves every rank's share into `dir` (existing, and one directory that every rank sees):
  /// rank r's optimizer into "rank{r}-of-{N}.{generation}.tsck" (OffloadedOptimizer::save), then
  /// rank 0's "manifest" (ranks/detail/manifest.hpp) naming each file, its elements and its
  /// checksum, renamed into place last: until then the previous save stays whole, and after
  /// it that save's files are removed. A rank's failure fails every rank and removes the
  /// files this save wrote.
  void save(std::filesystem::path const& dir);
  /// Loads what save() wrote, at any rank count: where the ranks own what they owned then,
  /// each loads its own file; else each re-partitions, reading its elements from the files
  /// that hold them. Everything is read and checked on every rank first (the manifest, each
  /// file's checksum, the tensors' names and sizes), so a refused load changes nothing on any
  /// rank; then the state, the step counts, the groups' hyper-parameters and (with a master,
  /// as OffloadedOptimizer::load) every param are replaced, and a disagreement (above) ends.
  void load(std::filesystem::path const& dir);

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

  using staged = std::vector<std::vector<float>>;  ///< a piece's slots (load)
  std::unique_ptr<Opt> open_rank_file(detail::manifest const& m, std::size_t q, std::filesystem::path const& dir,
                                      std::vector<std::vector<param_type>>& params);
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

  void build();  ///< the partition, this rank's optimizer over its pieces, and its groups
  /// This step's first agreement (one word per rank: its failure, or a hash of its settings
  /// and its step's arguments); throws on every rank where a rank failed or they differ.
  void agree_to_begin(std::exception_ptr failure, std::uint64_t shape, char const* what);
  bool agree_nonfinite(bool found, bool failed);
  double agree_norm(std::span<double const> sums, bool failed);
  [[noreturn]] void throw_aborted(std::size_t r) const;
  [[noreturn]] void fail(std::exception_ptr own, char const* what, std::vector<std::size_t> who);

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
  /// This rank's reduced gradients, its pieces back to back, in the communicator's memory.
  std::unique_ptr<grad_type, void (*)(grad_type*)> share_{nullptr, [](grad_type*) {}};
  std::vector<std::vector<std::size_t>> counts_;  ///< [tensor][rank]: its elements on each rank
  std::vector<std::size_t> offsets_;              ///< [tensor]: where its piece begins in share_
  std::uint64_t settings_ = 0;                    ///< a hash of what every rank must have alike
  bool prepared_          = false;
  round round_;
  std::int64_t steps_ = 0;
  std::optional<std::string> diverged_;
};

}  // namespace tierstate::ranks

#include <tierstate/ranks/detail/sharded_step.inl>
#include <tierstate/ranks/detail/sharded_checkpoint.inl>
