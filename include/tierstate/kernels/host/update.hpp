// SPDX-License-Identifier: Apache-2.0
// The host kernel: one rule's update over a range of elements, with xsimd.
//
//   host::update_range<Rule, Precision, Arch>(k, arrays, begin, end)   one thread
//   host::update<Rule, Precision, Arch>(pool, k, arrays, n)            the pool's threads
//
// Arch is an xsimd architecture tag; its default, xsimd::default_arch, is the best one the
// translation unit's compiler flags allow (-march=native gives AVX-512 on such a CPU, a
// plain x86-64 build gives SSE2). Every element goes through the same instruction sequence:
// the tail of a range is copied into a zero-padded batch, computed like the body, and
// copied back. So results are bit-identical for any split of the range, any thread count,
// and any chunking a caller chooses.
#pragma once

#include <tierstate/core/concepts.hpp>
#include <tierstate/core/error.hpp>
#include <tierstate/core/precision.hpp>
#include <tierstate/core/thread_pool.hpp>
#include <tierstate/kernels/host/detail/codec_simd.hpp>
#include <tierstate/kernels/host/detail/prefetch.hpp>
#include <tierstate/kernels/host/detail/simd.hpp>
#include <tierstate/rules/rule.hpp>

#include <array>
#include <cstddef>
#include <cstring>
#include <utility>

namespace tierstate::inline TIERSTATE_ABI {

/// The arrays of one update, all indexed by the same element index.
///
/// `param` is read when the precision has no master (fp32 params are their own master) and
/// always written; `master` is used only when Precision::has_master (else it may be null),
/// `compensation` only when Precision::has_compensation (the weight is then param +
/// compensation);
/// `state[j]` is the rule's slot `Rule::slots[j]`, stored with `P::state_codec<j>`
/// (codecs/codec.hpp): an array of its element type for an element codec, the bytes of its
/// first block for a block codec (element 0 then starts a block).
/// For a rule with a tensor phase (rules/rule.hpp), the elements are part of one tensor:
/// `shape` is its shape, `tensor_offset` the index of element 0 in it, and `tensor_state`
/// its state (in the memory the kernel runs in). With StochasticRounding, element i's random
/// bits are codecs::rounding_bits(rounding_key, tensor_offset + i): a caller of the kernels
/// gives a new key each step (codecs::rounding_key), or each element rounds the same way
/// every step.
template <precision P, std::size_t Slots>
struct update_arrays {
  typename P::param_type* param = nullptr;
  typename P::grad_type const* grad = nullptr;
  float* master = nullptr;
  std::array<void*, Slots> state{};
  bf16* compensation = nullptr;
  float const* tensor_state = nullptr;
  tensor_shape shape{};
  std::size_t tensor_offset = 0;
  std::uint32_t rounding_key = 0;  ///< StochasticRounding: this tensor's key at this step
};

namespace host {

/// The xsimd architecture name ("avx512bw", "sse2", ...) a kernel built for Arch uses.
template <class Arch = xsimd::default_arch>
[[nodiscard]] constexpr char const* arch_name() noexcept
{
  return Arch::name();
}

/// Elements per SIMD batch for Arch: range splits at multiples of this keep every part's
/// batches aligned like the whole range's.
template <class Arch = xsimd::default_arch>
inline constexpr std::size_t batch_size = xsimd::batch<float, Arch>::size;

/// Checks that `a` has every array the precision and rule need for `n` > 0 elements;
/// throws tierstate::logic_error naming the missing one.
template <precision P, std::size_t Slots>
void check_arrays(update_arrays<P, Slots> const& a, std::size_t n);

/// Updates elements [begin, end) on the calling thread. Where a slot has a block codec,
/// `begin` is a multiple of the largest block (detail::state_block_v), and so is every split
/// a caller makes of a range.
template <rule R, precision P, class Arch = xsimd::default_arch>
void update_range(typename R::coefficients const& k,
                  update_arrays<P, R::slots.size()> const& a, std::size_t begin,
                  std::size_t end) noexcept;

/// Updates elements [0, n) with the pool's threads; blocks until done. Checks the arrays
/// first (see check_arrays).
template <rule R, precision P, class Arch = xsimd::default_arch>
void update(thread_pool& pool, typename R::coefficients const& k,
            update_arrays<P, R::slots.size()> const& a, std::size_t n);

}  // namespace host
}  // namespace tierstate

#include <tierstate/kernels/host/detail/update.inl>
