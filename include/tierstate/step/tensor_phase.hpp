// SPDX-License-Identifier: Apache-2.0
// A rule's tensor phase (rules/rule.hpp): each tensor's own state, kept on the host, and the
// passes over each tensor's gradient that update it before the step's chunks are updated.
//
// A step reduces into a copy (`next`), which the update reads; the copy becomes the state only
// when the step has updated every chunk (commit). So a step refused, skipped or failed
// before any chunk changed leaves the tensor state as it was. For a rule without a tensor
// phase every member does nothing.
#pragma once

#include <tierstate/core/error.hpp>
#include <tierstate/core/tensor.hpp>
#include <tierstate/core/thread_pool.hpp>
#include <tierstate/rules/rule.hpp>

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace tierstate::inline TIERSTATE_ABI::detail {

template <class Rule>
class tensor_phase {
 public:
  static constexpr bool active = has_tensor_phase<Rule>;

  [[nodiscard]] bool made() const noexcept { return !offset_.empty(); }

  /// Every tensor's state, zeros, sized from its shape (with the optimizer's state; once).
  template <class Entry>
  void make(std::span<Entry const> tensors)
  {
    if constexpr (active) {
      if (made()) { return; }
      std::vector<std::size_t> offset{0};
      offset.reserve(tensors.size() + 1);
      for (auto const& e : tensors) { offset.push_back(offset.back() + Rule::tensor_state_size(e.shape)); }
      current_.assign(offset.back(), 0.0f);
      next_.assign(offset.back(), 0.0f);
      offset_ = std::move(offset);
    } else {
      (void)tensors;
    }
  }

  /// This step's passes over every tensor that has a gradient, into `next`. Host gradients
  /// (and params, for a rule whose passes read them) are read where they are; `fetch(void*
  /// to, void const* from, std::size_t bytes)` copies device memory to the host. A tensor of
  /// one block (see blocks_of) is reduced on one thread, beside others; a larger one by all
  /// the threads, block by block.
  template <class Grad, class Entry, class Coefficients, class Fetch>
  void reduce(std::span<grad_view<Grad> const> grads, std::span<Entry const> tensors,
              std::vector<Coefficients> const& k, thread_pool& pool, Fetch&& fetch)
  {
    if constexpr (active) {
      using Param = std::remove_cvref_t<decltype(*tensors[0].param)>;
      next_ = current_;
      // Where tensor t's gradient and param are on the host (fetched there if on the device).
      auto sources = [&](std::size_t t, scratch<Grad, Param>& buffers) {
        auto const& g   = grads[t];
        Grad const* src = g.data;
        if (g.where == location::device) {
          buffers.grad.resize(g.size);
          fetch(buffers.grad.data(), g.data, g.size * sizeof(Grad));
          src = buffers.grad.data();
        }
        Param const* param = nullptr;
        if constexpr (reads_params) {
          auto const& e = tensors[t];
          param         = e.param;
          if (e.where == location::device) {
            buffers.param.resize(e.count);
            fetch(buffers.param.data(), e.param, e.count * sizeof(Param));
            param = buffers.param.data();
          }
        }
        return std::pair{src, param};
      };
      auto const on_device = [&](std::size_t t) {
        return grads[t].where == location::device || (reads_params && tensors[t].where == location::device);
      };
      std::vector<std::size_t> small, large;  // with a gradient; one block and more
      for (std::size_t t = 0; t < grads.size(); ++t) {
        if (grads[t].data == nullptr) { continue; }  // no gradient: its state stays
        (blocks_of(tensors[t].shape) == 1 && !on_device(t) ? small : large).push_back(t);
      }
      pool.parallel_for(small.size(), 1, [&](std::size_t b, std::size_t e) {
        scratch<Grad, Param> buffers;
        for (std::size_t i = b; i < e; ++i) {
          std::size_t const t = small[i];
          auto const [g, p]   = sources(t, buffers);
          reduce_tensor(k[t], tensors[t].shape, g, p, next_.data() + offset_[t], nullptr);
        }
      });
      scratch<Grad, Param> buffers;
      for (std::size_t const t : large) {
        auto const [g, p] = sources(t, buffers);
        reduce_tensor(k[t], tensors[t].shape, g, p, next_.data() + offset_[t], &pool);
      }
    } else {
      (void)grads, (void)tensors, (void)k, (void)pool, (void)fetch;
    }
  }

  /// The blocks of rows a tensor's passes are cut into: a function of its shape alone (never
  /// of the threads), so its sums are the same bits on any machine. Each block reduces into
  /// statistics of its own, added in block order: about 64 Ki elements a block, at most 64
  /// blocks, and one where 64 sets of statistics would pass 64 MiB.
  [[nodiscard]] static std::size_t blocks_of(tensor_shape s) noexcept
  {
    if constexpr (active) {
      std::size_t const rows = s.total_rows();
      if (rows <= 1) { return 1; }
      std::size_t max_stats = 0;
      for (unsigned pass = 0; pass < static_cast<unsigned>(Rule::reduce_passes); ++pass) {
        max_stats = std::max(max_stats, Rule::statistics_size(s, pass));
      }
      if (max_stats * sizeof(double) * 64 > (std::size_t{64} << 20)) { return 1; }
      std::size_t const per = std::max(std::max<std::size_t>(1, (std::size_t{1} << 16) / std::max<std::size_t>(s.columns, 1)),
                                       (rows + 63) / 64);
      return (rows + per - 1) / per;
    } else {
      (void)s;
      return 1;
    }
  }

  /// The step updated every chunk: what it reduced is the state now.
  void commit() noexcept
  {
    if constexpr (active) { current_.swap(next_); }
  }

  /// What this step's update reads: every tensor's state after the passes, and tensor t's.
  [[nodiscard]] std::span<float const> next() const noexcept { return next_; }
  [[nodiscard]] float const* next_of(std::size_t t) const noexcept { return next_.data() + offset_[t]; }
  [[nodiscard]] std::size_t offset_of(std::size_t t) const noexcept { return offset_[t]; }

  /// Tensor t's state (as of the last step).
  [[nodiscard]] std::span<float> state(std::size_t t) noexcept
  {
    return {current_.data() + offset_[t], offset_[t + 1] - offset_[t]};
  }
  [[nodiscard]] std::span<float const> state(std::size_t t) const noexcept
  {
    return {current_.data() + offset_[t], offset_[t + 1] - offset_[t]};
  }
  [[nodiscard]] std::size_t floats() const noexcept { return current_.size(); }

 private:
  static constexpr bool reads_params = detail::rule_reduce_reads_params<Rule>;

  /// A thread's buffers: device gradients and params copied to the host, and a row as float.
  template <class Grad, class Param>
  struct scratch {
    std::vector<Grad> grad;
    std::vector<Param> param;
    std::vector<float> grad_row, param_row;
  };

  /// Row r of `from` as float: the memory itself when it is float, else converted into `to`.
  template <class T>
  static std::span<float const> row_of(T const* from, std::size_t columns, std::vector<float>& to)
  {
    if constexpr (std::same_as<T, float>) {
      return {from, columns};
    } else {
      to.resize(columns);
      for (std::size_t c = 0; c < columns; ++c) { to[c] = static_cast<float>(from[c]); }
      return to;
    }
  }

  /// Rows [begin, end) of one pass into `statistics`.
  template <class Coefficients, class Grad, class Param>
  static void reduce_rows(Coefficients const& k, unsigned pass, tensor_shape shape, Grad const* g, Param const* p,
                          float const* state, std::size_t begin, std::size_t end, double* statistics,
                          scratch<Grad, Param>& buffers)
  {
    std::size_t const columns = shape.columns;
    for (std::size_t r = begin; r < end; ++r) {
      auto const grad_row = row_of(g + r * columns, columns, buffers.grad_row);
      if constexpr (reads_params) {
        auto const param_row = row_of(p + r * columns, columns, buffers.param_row);
        Rule::reduce_row(k, pass, shape, state, r, grad_row, param_row, statistics);
      } else {
        (void)p;
        Rule::reduce_row(k, pass, shape, state, r, grad_row, statistics);
      }
    }
  }

  /// Every pass over one tensor: its blocks (blocks_of) on the pool's threads when `pool` is
  /// given, else on this one, each into its own statistics, added in block order.
  template <class Coefficients, class Grad, class Param>
  static void reduce_tensor(Coefficients const& k, tensor_shape shape, Grad const* g, Param const* p, float* state,
                            thread_pool* pool)
  {
    std::size_t const rows   = shape.total_rows();
    std::size_t const blocks = blocks_of(shape);
    std::size_t const per    = (rows + blocks - 1) / std::max<std::size_t>(blocks, 1);
    std::vector<std::vector<double>> partial(blocks);
    for (unsigned pass = 0; pass < static_cast<unsigned>(Rule::reduce_passes); ++pass) {
      std::size_t const n = Rule::statistics_size(shape, pass);
      auto run = [&](std::size_t b, std::size_t e) {
        scratch<Grad, Param> buffers;
        for (std::size_t block = b; block < e; ++block) {
          partial[block].assign(n, 0.0);
          reduce_rows(k, pass, shape, g, p, state, block * per, std::min(rows, (block + 1) * per),
                      partial[block].data(), buffers);
        }
      };
      if (pool != nullptr && blocks > 1) {
        pool->parallel_for(blocks, 1, run);
      } else {
        run(0, blocks);
      }
      for (std::size_t block = 1; block < blocks; ++block) {
        for (std::size_t i = 0; i < n; ++i) { partial[0][i] += partial[block][i]; }
      }
      Rule::finish_pass(k, pass, shape, partial[0].data(), state);
    }
  }

  std::vector<std::size_t> offset_;   ///< tensor t's state is [offset_[t], offset_[t + 1])
  std::vector<float> current_, next_;
};

}  // namespace tierstate::detail
