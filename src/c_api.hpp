// SPDX-License-Identifier: Apache-2.0
// What libtierstate_c's two files share: c_api.cpp, the entry points, and c_api_unit.cpp, the
// optimizers behind them, which throw nothing across: every failure becomes a status and a
// message. The host kernels are dispatched at run time (kernels/host/dispatch.hpp): both files
// are compiled once (for baseline x86-64 there), and the kernels once per x86-64 level
// (c_kernels.cpp, src/meson.build).
#pragma once

#include <tierstate/c.h>

#include <cstddef>
#include <cstdint>

// The handle C code holds, made by c_api_unit.cpp. Each call returns a status and has
// reported a failure through tierstate_c::fail already.
struct tierstate_optimizer {
  tierstate_optimizer()                                      = default;
  tierstate_optimizer(tierstate_optimizer const&)            = delete;
  tierstate_optimizer& operator=(tierstate_optimizer const&) = delete;
  virtual ~tierstate_optimizer()                             = default;

  virtual tierstate_status add_tensor(char const* name, void* param, std::size_t elements) noexcept            = 0;
  virtual tierstate_status set_hyperparameters(tierstate_adamw const& h) noexcept                              = 0;
  virtual tierstate_status set_lr(double lr) noexcept                                                          = 0;
  virtual tierstate_status step(void const* const* grads, std::size_t count, double scale, int* skipped) noexcept = 0;
  [[nodiscard]] virtual std::int64_t step_count() const noexcept                                               = 0;
  virtual tierstate_status save(char const* path) noexcept                                                     = 0;
  virtual tierstate_status load(char const* path) noexcept                                                     = 0;
  virtual tierstate_status copy_moment(char const* name, int slot, float* to, std::size_t elements) noexcept    = 0;
};

namespace tierstate_c {

/// Records `message` as this thread's last error (tierstate_last_error) and returns `s`.
tierstate_status fail(tierstate_status s, char const* message) noexcept;

/// Validates `o`, and makes the optimizer or fails.
tierstate_status create(tierstate_options const& o, tierstate_optimizer** out) noexcept;

}  // namespace tierstate_c
