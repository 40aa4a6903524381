// SPDX-License-Identifier: Apache-2.0
#pragma once

namespace tierstate::inline TIERSTATE_ABI::host {

template <precision P, std::size_t Slots>
void check_arrays(update_arrays<P, Slots> const& a, std::size_t n)
{
  if (n == 0) { return; }
  TIERSTATE_EXPECTS(a.param != nullptr, "update_arrays.param is null");
  TIERSTATE_EXPECTS(a.grad != nullptr, "update_arrays.grad is null");
  if constexpr (P::has_master) {
    TIERSTATE_EXPECTS(a.master != nullptr,
                      "update_arrays.master is null, but precision " + P::name() +
                        " keeps an fp32 master");
  }
  if constexpr (P::has_compensation) {
    TIERSTATE_EXPECTS(a.compensation != nullptr,
                      "update_arrays.compensation is null, but precision " + P::name() +
                        " keeps a compensation slot");
  }
  for (std::size_t s = 0; s != Slots; ++s) {
    TIERSTATE_EXPECTS(a.state[s] != nullptr,
                      "update_arrays.state[" + std::to_string(s) + "] is null");
  }
}

namespace detail {

/// The element type of slot J, stored with an element codec.
template <class P, std::size_t J>
using slot_element_t = typename P::template state_codec<J>::element_type;

/// Calls f(std::integral_constant<std::size_t, J>{}) for each J in [0, N), in order.
template <std::size_t N, class F>
TIERSTATE_ALWAYS_INLINE void for_each_slot(F&& f)
{
  [&]<std::size_t... J>(std::index_sequence<J...>) {
    (f(std::integral_constant<std::size_t, J>{}), ...);
  }(std::make_index_sequence<N>{});
}

/// Where a batch's values lie in their tensor, for a tensor-phase rule: one row, lanes from
/// `column` on, `lanes` of them the tensor's.
struct lane_place {
  std::size_t row = 0, column = 0, lanes = 0;
};

/// Every stream of `a` read some pages ahead of element i (prefetch_ahead), where a batch
/// from i crosses a multiple of 1024 elements: once per 4 KiB page of the 4-byte streams,
/// twice of the 2-byte ones.
template <class P, class Arch, std::size_t Slots>
TIERSTATE_ALWAYS_INLINE void prefetch_streams(update_arrays<P, Slots> const& a, std::size_t i) noexcept
{
  constexpr std::size_t n = xsimd::batch<float, Arch>::size, every = 1024;
  if (i % every >= n) { return; }
  prefetch_page_ahead(a.grad + i);
  prefetch_page_ahead(P::has_master ? static_cast<void const*>(a.master + i) : static_cast<void const*>(a.param + i));
  if constexpr (P::has_compensation) { prefetch_page_ahead(a.compensation + i); }
  for_each_slot<Slots>([&](auto j) { prefetch_page_ahead(static_cast<slot_element_t<P, j> const*>(a.state[j]) + i); });
}

/// One batch at element i: load, update, store (element codecs only). StreamParam: the
/// param's store is non-temporal (see stream_params).
template <class R, class P, class Arch, std::size_t Slots, bool StreamParam = false>
TIERSTATE_ALWAYS_INLINE void update_batch(typename R::coefficients const& k,
                                          update_arrays<P, Slots> const& a, std::size_t i,
                                          lane_place const& at = {}) noexcept
{
#if !defined(__CUDA_ARCH__)
  // (nvcc's device pass skips this host-only body: the rule's update is __host__ __device__,
  // and would otherwise be instantiated for the device on a SIMD batch, which it cannot hold.)
  using V = xsimd::batch<float, Arch>;
  V w;
  if constexpr (P::has_master) {
    w = detail::load_as_float<Arch>(a.master + i);
  } else if constexpr (P::has_compensation) {
    w = detail::load_as_float<Arch>(a.param + i) + detail::load_as_float<Arch>(a.compensation + i);
  } else {
    w = detail::load_as_float<Arch>(a.param + i);
  }
  V const g = detail::load_as_float<Arch>(a.grad + i);
  slot_values<V, Slots> s;
  for_each_slot<Slots>([&](auto j) {
    s[j] = detail::load_as_float<Arch>(static_cast<slot_element_t<P, j> const*>(a.state[j]) + i);
  });

  if constexpr (has_tensor_phase<R>) {
    R::update(k, w, g, s, tensor_position<V>{a.tensor_state, a.shape, at.row, at.column, at.lanes});
  } else {
    (void)at;
    R::update(k, w, g, s);
  }

  if constexpr (P::has_master) { detail::store_rounded<Arch>(a.master + i, w); }
  if constexpr (P::has_stochastic_rounding) {
    detail::store_stochastic<Arch>(a.param + i, w, a.rounding_key, a.tensor_offset + i);
  } else {
    detail::store_rounded<Arch, typename P::param_type, StreamParam>(a.param + i, w);
  }
  if constexpr (P::has_compensation) {  // what the rounding lost (w - param is exact in float)
    detail::store_rounded<Arch>(a.compensation + i, w - detail::load_as_float<Arch>(a.param + i));
  }
  for_each_slot<Slots>([&](auto j) {
    detail::store_rounded<Arch>(static_cast<slot_element_t<P, j>*>(a.state[j]) + i, s[j]);
  });
#else
  (void)k, (void)a, (void)i, (void)at;
#endif
}

/// The last m < batch elements from i: through zero-padded copies, same instructions.
template <class R, class P, class Arch, std::size_t Slots>
void update_tail(typename R::coefficients const& k, update_arrays<P, Slots> const& a,
                 std::size_t i, std::size_t m, lane_place const& at = {}) noexcept
{
  constexpr std::size_t n = xsimd::batch<float, Arch>::size;
  using param_t = typename P::param_type;
  using grad_t  = typename P::grad_type;

  alignas(64) param_t param[n] = {};
  alignas(64) grad_t grad[n]   = {};
  alignas(64) float master[n]  = {};
  alignas(64) bf16 compensation[n] = {};
  alignas(64) std::byte state[Slots == 0 ? 1 : Slots][n * sizeof(float)] = {};

  update_arrays<P, Slots> t;
  t.param = param;
  t.grad  = grad;
  t.master = master;
  t.compensation = compensation;
  t.tensor_state = a.tensor_state;
  t.shape        = a.shape;
  t.tensor_offset = a.tensor_offset + i;
  t.rounding_key  = a.rounding_key;

  if constexpr (P::has_master) {
    std::memcpy(master, a.master + i, m * sizeof(float));
  } else {
    std::memcpy(param, a.param + i, m * sizeof(param_t));
  }
  if constexpr (P::has_compensation) { std::memcpy(compensation, a.compensation + i, m * sizeof(bf16)); }
  std::memcpy(grad, a.grad + i, m * sizeof(grad_t));
  for_each_slot<Slots>([&](auto j) {
    using T = slot_element_t<P, j>;
    t.state[j] = state[j];
    std::memcpy(state[j], static_cast<T const*>(a.state[j]) + i, m * sizeof(T));
  });

  update_batch<R, P, Arch>(k, t, 0, at);

  if constexpr (P::has_master) { std::memcpy(a.master + i, master, m * sizeof(float)); }
  if constexpr (P::has_compensation) { std::memcpy(a.compensation + i, compensation, m * sizeof(bf16)); }
  std::memcpy(a.param + i, param, m * sizeof(param_t));
  for_each_slot<Slots>([&](auto j) {
    using T = slot_element_t<P, j>;
    std::memcpy(static_cast<T*>(a.state[j]) + i, state[j], m * sizeof(T));
  });
}

/// Whether R::update takes xsimd batches of Arch, as it takes floats (a rule whose update is
/// written for float alone does not).
template <class R, class Arch>
concept updates_plain_batches = requires(typename R::coefficients const& k, xsimd::batch<float, Arch>& w,
                                         xsimd::batch<float, Arch> g,
                                         slot_values<xsimd::batch<float, Arch>, R::slots.size()>& s) {
  R::update(k, w, g, s);
};
template <class R, class Arch>
concept updates_positioned_batches =
  requires(typename R::coefficients const& k, xsimd::batch<float, Arch>& w, xsimd::batch<float, Arch> g,
           slot_values<xsimd::batch<float, Arch>, R::slots.size()>& s,
           tensor_position<xsimd::batch<float, Arch>> const& at) {
    R::update(k, w, g, s, at);
  };
template <class R, class Arch>
concept updates_batches = (has_tensor_phase<R> && updates_positioned_batches<R, Arch>) ||
                          (!has_tensor_phase<R> && updates_plain_batches<R, Arch>);

/// Whether the params of a range are stored non-temporally: 16-bit params with an fp32
/// master (written by the step, never read by it), where a batch of them is one vector
/// (can_stream_16), in ranges of at least `stream_bytes` of params. Such a range is larger
/// than a core's L2, so its first params would be out of the caches by the time anything
/// reads them again; storing past the caches saves reading each line before writing it
/// (2 of the step's 28 bytes per element with bf16 params).
template <class P, class Arch>
inline constexpr bool stream_params =
  P::has_master && !P::has_compensation && sizeof(typename P::param_type) == 2 && can_stream_16<Arch>;
inline constexpr std::size_t stream_bytes = std::size_t{1} << 20;

/// [begin, end) with element codecs: whole batches, then the tail.
template <class R, class P, class Arch, std::size_t Slots>
TIERSTATE_ALWAYS_INLINE void update_elements(typename R::coefficients const& k, update_arrays<P, Slots> const& a,
                                             std::size_t begin, std::size_t end) noexcept
{
  constexpr std::size_t n = xsimd::batch<float, Arch>::size;
  // Local copies: the stores below cannot alias them, so the compiler keeps the pointers
  // and the broadcast coefficients in registers across the loop.
  auto const kl = k;
  auto const al = a;
  std::size_t i = begin;
  if constexpr (stream_params<P, Arch> && !has_tensor_phase<R>) {
    using param_t             = typename P::param_type;
    constexpr std::size_t vec = n * sizeof(param_t);  // one batch of params: the store's alignment
    auto const at             = reinterpret_cast<std::uintptr_t>(al.param + i);
    if ((end - begin) * sizeof(param_t) >= stream_bytes && at % sizeof(param_t) == 0) {
      // Up to the first aligned batch through the tail's path (the same instructions, so the
      // same bits), then streamed batches, then the tail.
      std::size_t const head = std::min(end - i, (vec - at % vec) % vec / sizeof(param_t));
      if (head > 0) { update_tail<R, P, Arch>(kl, al, i, head); }
      for (i += head; i + n <= end; i += n) {
        prefetch_streams<P, Arch>(al, i);
        update_batch<R, P, Arch, Slots, true>(kl, al, i);
      }
      stream_fence();  // the streamed stores before whatever the caller does next
      if (i < end) { update_tail<R, P, Arch>(kl, al, i, end - i); }
      return;
    }
  }
  if constexpr (has_tensor_phase<R>) {
    // Row by row: a batch never holds two rows, so its row's values are one broadcast.
    std::size_t const cols = al.shape.columns;
    while (i < end) {
      std::size_t const at  = al.tensor_offset + i;
      lane_place place{at / cols, at % cols, n};
      std::size_t const row_end = std::min(end, i + (cols - place.column));
      for (; i + n <= row_end; i += n, place.column += n) {
        prefetch_streams<P, Arch>(al, i);
        update_batch<R, P, Arch>(kl, al, i, place);
      }
      if (i < row_end) {
        place.lanes = row_end - i;
        update_tail<R, P, Arch>(kl, al, i, row_end - i, place);
        i = row_end;
      }
    }
  } else {
    for (; i + n <= end; i += n) {
      prefetch_streams<P, Arch>(al, i);
      update_batch<R, P, Arch>(kl, al, i);
    }
    if (i < end) { update_tail<R, P, Arch>(kl, al, i, end - i); }
  }
}

/// A block codec's slot is computed in an fp32 scratch block; element codecs stay.
template <class C>
using scratch_codec_t = std::conditional_t<block_codec<C>, codecs::fp32, C>;
template <class P, std::size_t... J>
auto scratch_precision(std::index_sequence<J...>)
  -> Precision<typename P::param_type, typename P::grad_type, typename P::master_type,
               slot_codecs<scratch_codec_t<typename P::template state_codec<J>>...>>;
template <class P, std::size_t Slots>
using scratch_precision_t = decltype(scratch_precision<P>(std::make_index_sequence<Slots>{}));

/// [begin, end) with a block codec among the slots, one block B (the largest) at a time:
/// its block-coded slots decoded into fp32 scratch, updated as element codecs are, encoded
/// back. `begin` is a multiple of B, so every block is whole but the range's last.
template <class R, class P, class Arch, std::size_t Slots>
void update_blocks(typename R::coefficients const& k, update_arrays<P, Slots> const& a, std::size_t begin,
                   std::size_t end) noexcept
{
  constexpr std::size_t B = tierstate::detail::state_block_v<P, Slots>;
  using SP                = scratch_precision_t<P, Slots>;
  alignas(64) float scratch[Slots == 0 ? 1 : Slots][B];
  for (std::size_t i = begin; i < end; i += B) {
    std::size_t const m = std::min(B, end - i);
    update_arrays<SP, Slots> t;
    t.param  = a.param + i;
    t.grad   = a.grad + i;
    t.master       = a.master != nullptr ? a.master + i : nullptr;
    t.compensation = a.compensation != nullptr ? a.compensation + i : nullptr;
    t.tensor_state  = a.tensor_state;
    t.shape         = a.shape;
    t.tensor_offset = a.tensor_offset + i;
    t.rounding_key  = a.rounding_key;
    for_each_slot<Slots>([&](auto j) {
      using C = typename P::template state_codec<j>;
      if constexpr (block_codec<C>) {
        auto const* base = static_cast<std::byte const*>(a.state[j]);
        // The blocks some pages ahead, as prefetch_streams does for element-coded streams
        // (prefetch_page_ahead adds the distance as an integer: no pointer past the array).
        auto const* blocks = tierstate::detail::codec_address<C>(base, i);
        for (std::size_t b = 0; b < C::block_bytes * ((m + C::block - 1) / C::block); b += 64) {
          prefetch_page_ahead(reinterpret_cast<void const*>(reinterpret_cast<std::uintptr_t>(blocks) + b));
        }
        for (std::size_t q = 0; q < m; q += C::block) {
          decode_block<C, Arch>(tierstate::detail::codec_address<C>(base, i + q), scratch[j] + q, std::min(C::block, m - q));
        }
        t.state[j] = scratch[j];
      } else {
        t.state[j] = static_cast<typename C::element_type*>(a.state[j]) + i;
      }
    });
    update_elements<R, SP, Arch>(k, t, 0, m);
    for_each_slot<Slots>([&](auto j) {
      using C = typename P::template state_codec<j>;
      if constexpr (block_codec<C>) {
        auto* base = static_cast<std::byte*>(a.state[j]);
        for (std::size_t q = 0; q < m; q += C::block) {
          encode_block<C, Arch>(scratch[j] + q, std::min(C::block, m - q), tierstate::detail::codec_address<C>(base, i + q));
        }
      }
    });
  }
}

}  // namespace detail

template <rule R, precision P, class Arch>
void update_range(typename R::coefficients const& k, update_arrays<P, R::slots.size()> const& a,
                  std::size_t begin, std::size_t end) noexcept
{
  static_assert(detail::updates_batches<R, Arch>,
                "tierstate: the rule's update must also take xsimd::batch<float, Arch>, the host kernels' "
                "value type: make it `template <class V> static void update(coefficients const&, V& weight, "
                "V grad, V (&state)[slots.size()])` and write its math with tierstate::math (math::fma, "
                "math::sqrt, math::maximum) and V(...) constants (rules/rule.hpp)");
  if constexpr (detail::updates_batches<R, Arch>) {  // (else: the sentence above is the only error)
    constexpr std::size_t slots = R::slots.size();
    if constexpr (tierstate::detail::state_block_v<P, slots> > 1) {
      detail::update_blocks<R, P, Arch>(k, a, begin, end);
    } else {
      detail::update_elements<R, P, Arch>(k, a, begin, end);
    }
  }
}

template <rule R, precision P, class Arch>
void update(thread_pool& pool, typename R::coefficients const& k,
            update_arrays<P, R::slots.size()> const& a, std::size_t n)
{
  check_arrays(a, n);
  if constexpr (has_tensor_phase<R>) {
    TIERSTATE_EXPECTS(n == 0 || (a.shape.columns > 0 && a.tensor_offset + n <= a.shape.elements()),
                      "update_arrays: elements [" + std::to_string(a.tensor_offset) + ", " +
                        std::to_string(a.tensor_offset + n) + ") do not lie in a tensor of " +
                        std::to_string(a.shape.batches) + " x " + std::to_string(a.shape.rows) + " x " +
                        std::to_string(a.shape.columns));
  }
  // Parts start on multiples of 64 batches (and of the largest codec block): cache-line
  // aligned, and large enough that no two threads write the same line.
  constexpr std::size_t grain = std::max(64 * batch_size<Arch>, tierstate::detail::state_block_v<P, R::slots.size()>);
  pool.parallel_for(n, grain, [&](std::size_t b, std::size_t e) {
    update_range<R, P, Arch>(k, a, b, e);
  });
}

}  // namespace tierstate::host
