// SPDX-License-Identifier: Apache-2.0
// The device kernel: one rule's update over a range of elements, with Thrust.
//
//   device::update_async<Rule, Precision>(stream, k, arrays, n)   queued on `stream`
//   device::any_nonfinite(stream, x, n)                           waits for the answer
//
// The per-element math is the rule's own `update`, the text the host kernels run on xsimd
// batches, here on float inside a Thrust functor over a zip iterator of the arrays. On a
// CUDA build bf16 and fp16 are read and written as CUDA's __nv_bfloat16 and __half (the same
// bits as tierstate::bf16 and fp16), so the kernel uses the device's own conversions.
//
// Which device: with TIERSTATE_ENABLE_CUDA, a translation unit compiled by nvcc and Thrust's
// CUDA system (kernels run on the GPU, on the given stream). Without it, one of Thrust's host
// systems, chosen with THRUST_DEVICE_SYSTEM = THRUST_DEVICE_SYSTEM_CPP or _OMP (g++, clang
// and nvcc all build these), over the emulated device of core/device_runtime.hpp: the same
// functor text, run by the CPU, which is how machines without a GPU test it against the
// host kernels.
//
// Every element goes through the same float operations as in the host kernels (fused where
// the rule writes fma, IEEE division and square root), so with the host's conversions (the
// host backends) the results are the host kernels' bit for bit; CUDA's conversions agree
// except in NaN payloads. Never build with --use_fast_math: it replaces the division and
// square root with approximations.
#pragma once

#include <tierstate/core/config.hpp>

#if defined(TIERSTATE_ENABLE_CUDA) && !defined(__CUDACC__)
#error "tierstate/kernels/device: with TIERSTATE_ENABLE_CUDA the device kernels run on the GPU, and need nvcc: compile this translation unit as CUDA (a .cu file, or -x cu)."
#endif
#if !defined(TIERSTATE_ENABLE_CUDA) && !defined(THRUST_DEVICE_SYSTEM)
#error "tierstate/kernels/device: without TIERSTATE_ENABLE_CUDA the device kernels run on Thrust's host backend: define THRUST_DEVICE_SYSTEM=THRUST_DEVICE_SYSTEM_CPP (or THRUST_DEVICE_SYSTEM_OMP with OpenMP), or define TIERSTATE_ENABLE_CUDA and compile with nvcc for the GPU."
#endif

#include <thrust/execution_policy.h>

#if !defined(TIERSTATE_ENABLE_CUDA) && THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_CUDA
#error "tierstate/kernels/device: THRUST_DEVICE_SYSTEM is CUDA but TIERSTATE_ENABLE_CUDA is not defined: define it (and link cudart) for the GPU, or choose THRUST_DEVICE_SYSTEM_CPP / _OMP for the host backend."
#endif
#if defined(TIERSTATE_ENABLE_CUDA) && THRUST_DEVICE_SYSTEM != THRUST_DEVICE_SYSTEM_CUDA
#error "tierstate/kernels/device: with TIERSTATE_ENABLE_CUDA device memory is GPU memory, which Thrust's host backends cannot touch: leave THRUST_DEVICE_SYSTEM at CUDA."
#endif

#include <tierstate/codecs/dynamic8.hpp>  // blockwise8: the GPU's warp-per-block encode
#include <tierstate/core/concepts.hpp>
#include <tierstate/core/device_runtime.hpp>
#include <tierstate/core/numeric.hpp>
#include <tierstate/core/precision.hpp>
#include <tierstate/kernels/host/update.hpp>  // update_arrays, check_arrays
#include <tierstate/rules/rule.hpp>

#include <cstddef>

// The device kernels differ with Thrust's system: each system gets its own inline namespace,
// so a program that links a CPP and an OMP translation unit keeps both (see tests/odr).
#if THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_CUDA
#define TIERSTATE_DEVICE_ABI dev_cuda
#elif THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_OMP
#define TIERSTATE_DEVICE_ABI dev_omp
#elif THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_TBB
#define TIERSTATE_DEVICE_ABI dev_tbb
#else
#define TIERSTATE_DEVICE_ABI dev_cpp
#endif

namespace tierstate::inline TIERSTATE_ABI::device {
inline namespace TIERSTATE_DEVICE_ABI {

/// The name of Thrust's device system this translation unit runs kernels on: "cuda",
/// "omp", "tbb" or "cpp".
[[nodiscard]] constexpr char const* system_name() noexcept;

/// Queues the update of elements [0, n) of `a` on stream `s` and returns at once; `a`'s
/// arrays must be device memory and stay valid until the stream has run it. Checks the
/// arrays first (host::check_arrays's logic_error).
template <rule R, precision P>
void update_async(stream_view s, typename R::coefficients const& k,
                  update_arrays<P, R::slots.size()> const& a, std::size_t n);

/// Whether any of x[0, n) (device memory) is infinite or NaN, after the work queued on `s`;
/// waits for the answer.
template <storage_type T>
[[nodiscard]] bool any_nonfinite(stream_view s, T const* x, std::size_t n);

/// Queues on `s`, and returns at once: sets *flag (device memory) to 1 when any of x[0, n)
/// (device memory) is infinite or NaN; leaves it as it is otherwise. Looking at many
/// tensors this way costs one wait in all (for the flag), not one per tensor.
template <storage_type T>
void mark_nonfinite_async(stream_view s, T const* x, std::size_t n, std::uint32_t* flag);

}  // namespace TIERSTATE_DEVICE_ABI
}  // namespace tierstate::device

#include <tierstate/kernels/device/detail/update.inl>
