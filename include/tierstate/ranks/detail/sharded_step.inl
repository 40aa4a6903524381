// SPDX-License-Identifier: Apache-2.0
// ranks::sharded's step and its agreements (the bottom half of ranks/sharded.hpp). Every rank
// makes the same collectives in the same order, whatever fails where:
//   begin      a gather of one word per rank: its failure, or a hash of its settings, its
//              groups' hyper-parameters and its step's arguments (all must be alike)
//   reduce     a reduce-scatter per tensor with gradients
//   check      (on_nonfinite not ignore) a max of {non-finite, failure}: the inner optimizer's
//              any_nonfinite hook, or played for it where it made none (it owns nothing, or failed)
//   norm       (max_grad_norm, the step not skipped, no failure heard of) a gather of each
//              rank's block-sum count (or a failure), then of the sums: the norm hook, or played
//   status     a gather of one word per rank: its failure
//   params     (the step not skipped) an all-gather per tensor with gradients
#pragma once

#include <cstring>

namespace tierstate::inline TIERSTATE_ABI::ranks {

#define TIERSTATE_SHARDED_TEMPLATE                                                                                   \
  template <class Opt, class Comm>                                                                                     \
    requires communicator_for<Comm, typename Opt::grad_type> && communicator_for<Comm, typename Opt::param_type>

namespace detail {
/// FNV-1a's step, for the settings' and arguments' hash.
[[nodiscard]] constexpr std::uint64_t mix(std::uint64_t h, std::uint64_t v) noexcept
{
  return (h ^ v) * 1099511628211ULL;
}
[[nodiscard]] inline std::uint64_t mix(std::uint64_t h, std::string_view s) noexcept
{
  for (char const c : s) { h = mix(h, static_cast<unsigned char>(c)); }
  return mix(h, s.size());
}
}  // namespace detail

TIERSTATE_SHARDED_TEMPLATE
void sharded<Opt, Comm>::build()
{
  if (built_) { return; }
  if (tensors_.empty()) { throw logic_error("ranks::sharded: no tensor is registered"); }
  std::vector<std::size_t> sizes;
  std::uint64_t h = detail::mix(14695981039346656037ULL, size_);
  for (auto const& t : tensors_) {
    sizes.push_back(t.count);
    h = detail::mix(detail::mix(h, t.name), t.count);
  }
  for (auto const& g : groups_) {
    h = detail::mix(h, g.names.size());
    for (auto const& n : g.names) { h = detail::mix(h, n); }
  }
  h = detail::mix(detail::mix(h, how_.block), how_.average ? 1 : 0);
  h = detail::mix(detail::mix(h, static_cast<std::uint64_t>(opts_.on_nonfinite)),
                  std::bit_cast<std::uint64_t>(opts_.max_grad_norm));
  auto p = partition_elements(sizes, size_, how_.block);
  std::vector<std::vector<std::size_t>> counts(tensors_.size(), std::vector<std::size_t>(size_, 0));
  std::vector<std::size_t> offsets(tensors_.size(), 0);
  std::size_t at = 0;
  for (std::size_t r = 0; r < size_; ++r) {
    for (auto const& pc : p.pieces[r]) {
      counts[pc.tensor][r] = pc.count;
      if (r == rank_) {
        offsets[pc.tensor] = at;
        at += pc.count;
      }
    }
  }
  auto const& mine = p.pieces[rank_];
  std::vector<std::optional<std::size_t>> inner(groups_.size(), std::nullopt);
  std::unique_ptr<Opt> opt;
  if (!mine.empty()) {
    opt = std::make_unique<Opt>(groups_[0].h, opts_);
    for (auto const& pc : mine) {
      opt->add_tensor(piece_name(pc), tensors_[pc.tensor].param + pc.begin, pc.count, memory);
    }
    inner[0] = 0;
    for (std::size_t g = 1; g < groups_.size(); ++g) {
      std::vector<std::string> names;
      for (auto const& pc : mine) {
        for (auto const& n : groups_[g].names) {
          if (tensors_[pc.tensor].name == n) { names.push_back(piece_name(pc)); }
        }
      }
      if (!names.empty()) { inner[g] = opt->add_group(groups_[g].h, names); }
    }
  }
  if (std::size_t const n = p.elements(rank_); n > 0 && memory == location::host) {
    share_ = {new grad_type[n], [](grad_type* g) { delete[] g; }};
  } else if (n > 0) {  // (on the legacy default stream, and waited for: the communicator's stream may be any)
    share_ = {static_cast<grad_type*>(device::allocate_async(n * sizeof(grad_type), {})),
              [](grad_type* g) { device::deallocate_async(g, {}); }};
    device::stream_view{}.synchronize();
  }
  part_        = std::move(p);
  counts_      = std::move(counts);
  offsets_     = std::move(offsets);
  inner_group_ = std::move(inner);
  local_       = std::move(opt);
  settings_    = h;
  built_       = true;
}

TIERSTATE_SHARDED_TEMPLATE
void sharded<Opt, Comm>::agree_to_begin(std::exception_ptr failure, std::uint64_t shape, char const* what)
{
  constexpr std::uint64_t failed_word = ~std::uint64_t{0};
  if (!failure && shape == failed_word) { shape = 0; }
  std::vector<std::uint64_t> words(size_);
  comm_.gather(failure ? failed_word : shape, std::span(words));
  std::vector<std::size_t> failed;
  std::optional<std::uint64_t> first;
  bool differ = false;
  for (std::size_t r = 0; r < size_; ++r) {
    if (words[r] == failed_word) {
      failed.push_back(r);
    } else if (!first) {
      first = words[r];
    } else {
      differ = differ || words[r] != *first;
    }
  }
  if (!failed.empty()) { fail(failure, what, failed); }
  if (differ) {
    throw logic_error(std::string("ranks::sharded: the ranks differ in their tensors, groups or options, or in this "
                                  "call's arguments (a step's gradients and grad_scale; a load's manifest)"));
  }
}

TIERSTATE_SHARDED_TEMPLATE
void sharded<Opt, Comm>::prepare()
{
  if (prepared_) { return; }
  std::exception_ptr failure;
  try {
    build();
  } catch (...) {
    failure = std::current_exception();
  }
  agree_to_begin(failure, settings_, "could not make its optimizer");
  for (std::size_t t = 0; t < tensors_.size(); ++t) {  // rank 0's params everywhere: an all-gather from it alone
    std::vector<std::size_t> from_zero(size_, 0);
    from_zero[0] = tensors_[t].count;
    comm_.all_gather(tensors_[t].param, std::span<std::size_t const>(from_zero));
  }
  try {
    if (local_) { (void)local_->state_layout(); }  // (made from those params)
  } catch (...) {
    failure = std::current_exception();
  }
  std::vector<std::uint64_t> words(size_);
  comm_.gather(failure ? detail::failure_word(rank_) : 0, std::span(words));
  if (auto const failed = detail::failed_in(words); !failed.empty()) { fail(failure, "could not make its state", failed); }
  prepared_ = true;
}

TIERSTATE_SHARDED_TEMPLATE
step_result sharded<Opt, Comm>::step(std::span<grad_view<grad_type> const> grads, double grad_scale)
{
  prepare();
  round_ = {};
  std::exception_ptr failure;
  std::uint64_t shape = settings_;
  try {
    if (diverged_) { throw logic_error("step: " + *diverged_); }
    // Without a check or a norm, nothing is agreed between here and the update: a state lost
    // (a failed load or update) is heard of here, before any rank changes anything.
    if (local_ && opts_.on_nonfinite == nonfinite_policy::ignore && opts_.max_grad_norm == 0) {
      (void)local_->state_layout();
    }
    if (grads.size() != tensors_.size()) {
      throw invalid_option("step", std::to_string(grads.size()) + " gradients",
                           detail::cat("this rank registered ", std::to_string(tensors_.size()), " tensors"));
    }
    for (std::size_t t = 0; t < grads.size(); ++t) {
      auto const& g = grads[t];
      if (g.size != 0 && (g.size != tensors_[t].count || g.data == nullptr || g.where != memory)) {
        throw invalid_option("step", detail::cat("gradient of '", tensors_[t].name, "'"),
                             g.where != memory
                               ? detail::cat("is not in the communicator's memory (",
                                              memory == location::host ? "host" : "device", ")")
                               : detail::cat("has ", std::to_string(g.size), " elements; the tensor has ",
                                              std::to_string(tensors_[t].count)));
      }
      shape = detail::mix(shape, g.size != 0 ? 1 : 0);
    }
    shape = detail::mix(shape, std::bit_cast<std::uint64_t>(grad_scale));
    for (auto const& g : groups_) {  // (a schedule set on one rank only would step the shards differently)
      for (double const v : hyperparameter_values<typename Opt::rule_type>(g.h)) {
        shape = detail::mix(shape, std::bit_cast<std::uint64_t>(v));
      }
    }
  } catch (...) {
    failure = std::current_exception();
  }
  agree_to_begin(failure, shape, "failed before its step began");
  // The reduced gradients of this rank's pieces, and its views of them.
  std::vector<grad_view<grad_type>> mine;
  for (auto const& pc : part_.pieces[rank_]) {
    mine.push_back(grads[pc.tensor].size == 0
                     ? grad_view<grad_type>{}
                     : grad_view<grad_type>{share_.get() + offsets_[pc.tensor], pc.count, memory});
  }
  for (std::size_t t = 0; t < tensors_.size(); ++t) {
    if (grads[t].size == 0) { continue; }
    comm_.reduce_scatter(std::span<grad_type const>(grads[t].data, grads[t].size),
                         std::span<grad_type>(share_.get() + offsets_[t], counts_[t][rank_]),
                         std::span<std::size_t const>(counts_[t]));
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
  // The collectives this rank's optimizer did not make (it owns nothing, or it failed before
  // them), as the agreed outcome says every rank makes them.
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
    if (!round_.aborted && !failure && !skipped) {  // it failed after the updates began
      diverged_ = detail::rank_list(failed) + " failed during its update while the others' were applied: the "
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
      if (grads[t].size != 0) { comm_.all_gather(tensors_[t].param, std::span<std::size_t const>(counts_[t])); }
    }
  }
  result.step = steps_;
  return result;
}

TIERSTATE_SHARDED_TEMPLATE
bool sharded<Opt, Comm>::agree_nonfinite(bool found, bool failed)
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

TIERSTATE_SHARDED_TEMPLATE
double sharded<Opt, Comm>::agree_norm(std::span<double const> sums, bool failed)
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
  std::vector<std::size_t> const n(counts.begin(), counts.end());
  std::size_t total = 0;
  for (auto const c : n) { total += c; }
  std::vector<double> all(total);
  comm_.gather(sums, std::span(all), std::span<std::size_t const>(n));
  // Every rank's sums in rank order are one process's in its (tensor, block) order (partition.hpp).
  round_.norm = std::sqrt(tierstate::detail::pairwise_sum(all.data(), all.size()));
  return round_.norm;
}

TIERSTATE_SHARDED_TEMPLATE
void sharded<Opt, Comm>::throw_aborted(std::size_t r) const
{
  std::vector<std::size_t> const who{r};
  throw rank_failed(who, detail::cat("rank ", std::to_string(rank_), ": the step was refused on every rank: ",
                                      detail::rank_list(who), " failed in it (its own error says why)"));
}

TIERSTATE_SHARDED_TEMPLATE
void sharded<Opt, Comm>::fail(std::exception_ptr own, char const* what, std::vector<std::size_t> who)
{
  if (own) { std::rethrow_exception(own); }
  std::string const list = detail::rank_list(who);
  throw rank_failed(who, detail::cat("rank ", std::to_string(rank_), ": ", list, " ", what, " (its own error says why); ",
                                      diverged_ ? std::string_view(*diverged_)
                                                : std::string_view("this rank refused it, with nothing changed")));
}

#undef TIERSTATE_SHARDED_TEMPLATE

}  // namespace tierstate::ranks
