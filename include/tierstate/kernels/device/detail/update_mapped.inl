// SPDX-License-Identifier: Apache-2.0
// The device step for precisions whose block-coded slots are all scaled_map_codecs (8-bit
// moments, codecs/dynamic8.hpp): a thread an element, then each block's scale, then each
// code (on a GPU, a warp a block for both). Included by update.inl after its helpers (load_weight, store_weight, the native
// types), whose update_async takes this path where elementwise_blocks holds.
#pragma once

#include <type_traits>
#include <vector>

namespace tierstate::inline TIERSTATE_ABI::device {
inline namespace TIERSTATE_DEVICE_ABI {
namespace detail {

/// Whether update_async gives each element a thread of its own where the precision has a
/// block codec: every block-coded slot's codec a scaled_map_codec, and no tensor phase. (A
/// thread a block, update_block, walks its block's elements in turn, reading and writing
/// memory a block apart from its neighbours': on an H200 the 8-bit AdamW step took 95 times
/// the fp32-state one that way.)
template <class R, class P, std::size_t Slots>
inline constexpr bool elementwise_blocks = []<std::size_t... J>(std::index_sequence<J...>) {
  return !has_tensor_phase<R> && tierstate::detail::state_block_v<P, Slots> > 1 &&
         ((!block_codec<typename P::template state_codec<J>> || scaled_map_codec<typename P::template state_codec<J>>) &&
          ...);
}(std::make_index_sequence<Slots>{});

/// The element-parallel step's first pass, element e: its block-coded slots decoded from their
/// codes and blocks' scales, updated as update_element does, the updated values of those
/// slots written to `scratch` (n floats a slot) for the scale and the codes, the others
/// stored.
template <class R, class P, std::size_t Slots>
struct update_mapped_element {
  using param_t = native_t<typename P::param_type>;
  using grad_t  = native_t<typename P::grad_type>;
  template <std::size_t J>
  using codec_t = typename P::template state_codec<J>;

  typename R::coefficients k;
  param_t* param;
  grad_t const* grad;
  float* master;
  param_t* compensation;
  void* state[Slots == 0 ? 1 : Slots];
  float* scratch;
  std::size_t n;
  std::size_t tensor_offset;  ///< with StochasticRounding: element 0's index in its tensor
  std::uint32_t rounding_key;

  TIERSTATE_HOST_DEVICE auto& lead_at(std::size_t e) const noexcept
  {
    if constexpr (P::has_master) {
      return master[e];
    } else if constexpr (P::has_compensation) {
      return compensation[e];
    } else {
      return param[e];
    }
  }

  template <std::size_t J>
  TIERSTATE_HOST_DEVICE float load(std::size_t e) const noexcept
  {
    using C = codec_t<J>;
    if constexpr (block_codec<C>) {
      auto const* block = tierstate::detail::codec_address<C>(static_cast<std::byte const*>(state[J]), e);
      float scale;
      std::memcpy(&scale, block, sizeof scale);
      // (a zero +0, as the concept says; never `* scale + 0.0f`, which nvcc fuses into an fma
      // that rounds an underflowing negative product to -0)
      float const r = C::map().value[static_cast<std::uint8_t>(block[sizeof(float) + e % C::block])] * scale;
      return r == 0.0f ? 0.0f : r;
    } else {
      return to_float(static_cast<slot_native_t<P, J> const*>(state[J])[e]);
    }
  }

  template <std::size_t J>
  TIERSTATE_HOST_DEVICE void store(std::size_t e, float v) const noexcept
  {
    if constexpr (block_codec<codec_t<J>>) {
      scratch[J * n + e] = v;
    } else {
      static_cast<slot_native_t<P, J>*>(state[J])[e] = from_float<slot_native_t<P, J>>(v);
    }
  }

  template <std::size_t... J>
  TIERSTATE_HOST_DEVICE void run(std::size_t e, std::index_sequence<J...>) const
  {
    float w       = load_weight<P>(param[e], lead_at(e));
    float const g = to_float(grad[e]);
    slot_values<float, Slots> s{load<J>(e)...};
    R::update(k, w, g, s);
    if constexpr (P::has_stochastic_rounding) {
      param[e] = bf16_from_bits<param_t>(codecs::round_stochastic_bf16(w, rounding_key, tensor_offset + e));
    } else {
      store_weight<P>(w, param[e], lead_at(e));
    }
    (store<J>(e, s[J]), ...);
  }

  TIERSTATE_HOST_DEVICE void operator()(std::size_t e) const { run(e, std::make_index_sequence<Slots>{}); }
};

/// The second pass, block b of a slot stored with C: its scale from the updated values, and
/// the zero code for the elements past n in the last block (as C::encode writes them).
template <class C>
struct mapped_scale {
  float const* values;  ///< the slot's n updated values
  std::byte* base;
  std::size_t n;
  TIERSTATE_HOST_DEVICE void operator()(std::size_t b) const noexcept
  {
    std::size_t const i = b * C::block;
    std::size_t const m = n - i < C::block ? n - i : C::block;
    typename C::extremes x;
    x.add(values + i, m);
    float const scale = x.scale();
    std::byte* block  = tierstate::detail::codec_address<C>(base, i);
    std::memcpy(block, &scale, sizeof scale);
    for (std::size_t q = m; q < C::block; ++q) { block[sizeof(float) + q] = static_cast<std::byte>(C::map().zero_code); }
  }
};

/// The third pass, element e of that slot: its code under its block's scale.
template <class C>
struct mapped_code {
  float const* values;
  std::byte* base;
  TIERSTATE_HOST_DEVICE void operator()(std::size_t e) const noexcept
  {
    std::byte* block = tierstate::detail::codec_address<C>(base, e);
    float scale;
    std::memcpy(&scale, block, sizeof scale);
    float const inverse = C::inverse_scale(scale);
    block[sizeof(float) + e % C::block] =
      static_cast<std::byte>(inverse != 0.0f ? C::code_of(C::map(), values[e] * inverse) : C::map().zero_code);
  }
};

#if defined(TIERSTATE_ENABLE_CUDA)
/// The second and third passes at once on a GPU, for a slot stored with C: a warp a block, its
/// lanes reading the block's values 32 apart (coalesced), combining their extremes with
/// shuffles into the block's scale (max and min are exact in any order, so it is
/// mapped_scale's), then writing the codes as mapped_code does. (A thread a block, mapped_scale
/// reads 256 values a block apart from its neighbours': on an H200 that pass was most of the
/// 8-bit step's 0.165 s for 1e9 elements, against 0.012 s with fp32 state.)
template <class C>
__global__ void mapped_encode_warps(float const* values, std::byte* base, std::size_t n)
{
  static_assert(C::block % 32 == 0);
  constexpr unsigned per_lane = C::block / 32;
  std::size_t const b         = (static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  unsigned const lane         = threadIdx.x % 32;
  std::size_t const i         = b * C::block;
  if (i >= n) { return; }  // (the whole warp: b is the warp's)
  std::size_t const m = n - i < C::block ? n - i : C::block;
  float v[per_lane];
  typename C::extremes x;
  for (unsigned q = 0; q < per_lane; ++q) {
    std::size_t const e = q * 32 + lane;
    v[q]                = e < m ? values[i + e] : 0.0f;
    x.add(&v[q], 1);  // (a zero past m changes no extreme)
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    float const hi = __shfl_xor_sync(0xFFFFFFFFu, x.hi, offset);
    float const lo = __shfl_xor_sync(0xFFFFFFFFu, x.lo, offset);
    x.nan          = __shfl_xor_sync(0xFFFFFFFFu, static_cast<int>(x.nan), offset) != 0 || x.nan;
    x.hi           = hi > x.hi ? hi : x.hi;
    x.lo           = lo < x.lo ? lo : x.lo;
  }
  float const scale = x.scale();
  std::byte* block  = tierstate::detail::codec_address<C>(base, i);
  if (lane == 0) { std::memcpy(block, &scale, sizeof scale); }
  float const inverse = C::inverse_scale(scale);
  auto const& map     = C::map();
  for (unsigned q = 0; q < per_lane; ++q) {
    std::size_t const e = q * 32 + lane;
    block[sizeof(float) + e] =
      static_cast<std::byte>(e < m && inverse != 0.0f ? C::code_of(map, v[q] * inverse) : map.zero_code);
  }
}
#endif

/// The element-parallel step's three passes over n elements, each `for_each(count, f)`
/// (f over [0, count)) run after the one before: the update, then each block-coded slot's
/// scales, then its codes, through `scratch` (n floats a slot).
template <class R, class P, std::size_t Slots, class ForEach, class Encode>
void mapped_passes(typename R::coefficients const& k, update_arrays<P, Slots> const& a, std::size_t n, float* scratch,
                   ForEach const& for_each, Encode const& encode)
{
  using f_t = update_mapped_element<R, P, Slots>;
  f_t f{k, reinterpret_cast<typename f_t::param_t*>(a.param), reinterpret_cast<typename f_t::grad_t const*>(a.grad),
        a.master, reinterpret_cast<typename f_t::param_t*>(a.compensation), {}, scratch, n, a.tensor_offset,
        a.rounding_key};
  for (std::size_t j = 0; j != Slots; ++j) { f.state[j] = a.state[j]; }
  for_each(n, f);
  host::detail::for_each_slot<Slots>([&](auto j) {
    using C = typename P::template state_codec<j>;
    if constexpr (block_codec<C>) {
      auto* const base = static_cast<std::byte*>(a.state[j]);
      if (!encode(std::type_identity<C>{}, scratch + j * n, base)) {
        for_each((n + C::block - 1) / C::block, mapped_scale<C>{scratch + j * n, base, n});
        for_each(n, mapped_code<C>{scratch + j * n, base});
      }
    }
  });
}

/// The element-parallel step (elementwise_blocks) on stream s. On a GPU, its scratch comes
/// from the stream-ordered allocator (cudaMallocAsync where the device has memory pools) and
/// goes back after the passes, with no wait; on the emulated device the passes are one task
/// of the stream, its scratch its own, so that nothing waits and a failure stays the stream's.
template <class R, class P, std::size_t Slots>
void update_mapped_async(stream_view s, typename R::coefficients const& k, update_arrays<P, Slots> const& a,
                         std::size_t n)
{
#if defined(TIERSTATE_ENABLE_CUDA)
  auto* const scratch = static_cast<float*>(allocate_async(Slots * n * sizeof(float), s));
  try {
    mapped_passes<R, P, Slots>(k, a, n, scratch, [&](std::size_t count, auto const& f) {
      auto const first = thrust::counting_iterator<std::size_t>(0);
      thrust::for_each(thrust::cuda::par_nosync.on(s.native()), first, first + static_cast<std::ptrdiff_t>(count), f);
      TIERSTATE_CUDA_TRY(cudaGetLastError());
    }, [&]<class C>(std::type_identity<C>, float const* values, std::byte* base) {
      // (blockwise8's extremes only: the warp combines their hi, lo and nan members, which the
      // scaled_map_codec concept does not ask of a user's codec)
      if constexpr (std::is_same_v<C, codecs::blockwise8<C::is_signed>> && C::block % 32 == 0) {
        constexpr unsigned threads = 256;  // 8 blocks of the codec a CUDA block
        std::size_t const warps    = (n + C::block - 1) / C::block;
        auto const grid            = static_cast<unsigned>((warps * 32 + threads - 1) / threads);
        mapped_encode_warps<C><<<grid, threads, 0, s.native()>>>(values, base, n);
        TIERSTATE_CUDA_TRY(cudaGetLastError());
        return true;
      } else {
        return false;
      }
    });
  } catch (...) {
    deallocate_async(scratch, s);
    throw;
  }
  deallocate_async(scratch, s);
#else
  runtime::detail::enqueue(s, [=] {
    std::vector<float> scratch(Slots * n);
    mapped_passes<R, P, Slots>(k, a, n, scratch.data(), [](std::size_t count, auto const& f) {
      auto const first = thrust::counting_iterator<std::size_t>(0);
      thrust::for_each(thrust::device, first, first + static_cast<std::ptrdiff_t>(count), f);
    }, [](auto, float const*, std::byte*) { return false; });
  });
#endif
}

}  // namespace detail
}  // namespace TIERSTATE_DEVICE_ABI
}  // namespace tierstate::device
