// SPDX-License-Identifier: Apache-2.0
// param_source: what the optimizer asks of params that rest somewhere it cannot point into
// (state/offloaded_params.hpp: a tier, streamed to the model layer by layer). A tensor
// registered with one (OffloadedOptimizer::add_tensor(source, id)) has no param pointer: the
// state's master is made from read(), and each step's update reads (when the precision keeps
// no master) and writes the params it changes through read() and write(), piece by piece.
#pragma once

#include <tierstate/core/config.hpp>

#include <cstddef>
#include <span>
#include <string>

namespace tierstate::inline TIERSTATE_ABI {

template <class Param>
class param_source {
 public:
  virtual ~param_source() = default;
  /// Elements [offset, offset + to.size()) of tensor `t` into `to`. Thread-safe.
  virtual void read(std::size_t t, std::size_t offset, std::span<Param> to) = 0;
  /// Replaces elements [offset, offset + from.size()) of tensor `t`. Thread-safe.
  virtual void write(std::size_t t, std::size_t offset, std::span<Param const> from) = 0;
  /// Waits for writes still in flight and throws the first that failed. The optimizer calls
  /// it at the end of each step, before the step counts as done.
  virtual void flush() {}
  /// Whether write_grad and read_grad keep gradients (the default: no).
  [[nodiscard]] virtual bool keeps_grads() const noexcept { return false; }
  /// Keeps tensor `t`'s whole gradient (from.size() is its size), replacing the one before;
  /// `from` may be reused once it returns. Thread-safe. A failure keeps nothing new: this
  /// call's, or, for a gradient written behind, wait_grad's and read_grad's for `t`.
  virtual void write_grad(std::size_t t, std::span<Param const> from)
  {
    (void)from;
    throw logic_error("param_source::write_grad('" + tensor_name(t) + "'): this source keeps no gradients");
  }
  /// Elements [offset, offset + to.size()) of the gradient last kept for tensor `t`. Thread-safe.
  virtual void read_grad(std::size_t t, std::size_t offset, std::span<Param> to)
  {
    (void)offset, (void)to;
    throw logic_error("param_source::read_grad('" + tensor_name(t) + "'): this source keeps no gradients");
  }
  /// Waits for the write_grads of tensor `t` still going on behind, and throws the last one's
  /// failure (as read_grad does, until the next write_grad of `t`).
  virtual void wait_grad(std::size_t t) { (void)t; }
  [[nodiscard]] virtual std::size_t tensor_size(std::size_t t) const = 0;
  [[nodiscard]] virtual std::string const& tensor_name(std::size_t t) const = 0;
};

}  // namespace tierstate
