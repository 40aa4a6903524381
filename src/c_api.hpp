// SPDX-License-Identifier: Apache-2.0
// What libtierstate_c's units share. The library is one dispatching unit (c_api.cpp,
// compiled for baseline x86-64) and one kernel unit per CPU level (c_api_unit.cpp, compiled
// once per level with its -march). tierstate's C++ names differ per level (its ABI
// namespace, core/config.hpp), so the units' copies never mix; only what is declared here
// crosses between them, and it holds C types only: no tierstate type, no exception.
#pragma once

#include <tierstate/c.h>

#include <cstddef>
#include <cstdint>

// The handle C code holds, made by a kernel unit: its calls are that unit's code. Each
// returns a status and has reported a failure through tierstate_c::fail already.
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

/// A kernel unit's constructor: validates `o`, and makes the optimizer or fails.
using factory = tierstate_status (*)(tierstate_options const& o, tierstate_optimizer** out) noexcept;

// One per kernel unit (meson.build defines TIERSTATE_C_UNIT for each).
tierstate_status create_x86_64_v2(tierstate_options const& o, tierstate_optimizer** out) noexcept;
tierstate_status create_x86_64_v3(tierstate_options const& o, tierstate_optimizer** out) noexcept;
tierstate_status create_x86_64_v4(tierstate_options const& o, tierstate_optimizer** out) noexcept;
tierstate_status create_build(tierstate_options const& o, tierstate_optimizer** out) noexcept;

}  // namespace tierstate_c
