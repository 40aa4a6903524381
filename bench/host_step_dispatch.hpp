// SPDX-License-Identifier: Apache-2.0
// host_step's portable build (host_step_dispatch.cpp): AdamW's optimizer as a program built
// for plain x86-64 runs it, with the dispatched kernels (kernels/host/dispatch.hpp) or with
// its own SSE2 ones. Plain types only: that file is built with other flags than host_step.cpp,
// so no tierstate type can cross (core/config.hpp).
#pragma once

#include <cstddef>
#include <functional>
#include <string>

namespace host_step_portable {

enum class kernels { dispatched, baseline };

/// A step of OffloadedOptimizer<AdamW, Fp32 or Bf16Mixed, PinnedHost, Synchronous> without
/// the non-finite check, over the tensors `sizes` laid end to end in `params` (float or bf16)
/// and `grads`; lr 1e-4.
std::function<void()> adamw_step(kernels k, bool bf16, void* params, void const* grads, std::size_t const* sizes,
                                 std::size_t count, std::size_t threads);

/// The level the dispatched kernels run at ("x86-64-v4", ...), and the xsimd architecture of
/// the portable build's own kernels ("sse2").
std::string dispatched_level();
std::string baseline_arch();

}  // namespace host_step_portable
