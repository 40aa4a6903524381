// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/iterator/zip_iterator.h>
#include <thrust/logical.h>
#include <thrust/tuple.h>

#if defined(TIERSTATE_ENABLE_CUDA)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <thrust/system/cuda/execution_policy.h>
#endif

#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

namespace tierstate::inline TIERSTATE_ABI::device {
inline namespace TIERSTATE_DEVICE_ABI {

constexpr char const* system_name() noexcept
{
#if THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_CUDA
  return "cuda";
#elif THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_OMP
  return "omp";
#elif THRUST_DEVICE_SYSTEM == THRUST_DEVICE_SYSTEM_TBB
  return "tbb";
#else
  return "cpp";
#endif
}

namespace detail {

/// The type a kernel reads and writes for a storage type: CUDA's own on a CUDA build.
template <class T>
struct native {
  using type = T;
};
#if defined(TIERSTATE_ENABLE_CUDA)
template <>
struct native<bf16> {
  using type = __nv_bfloat16;
};
template <>
struct native<fp16> {
  using type = __half;
};
static_assert(sizeof(__nv_bfloat16) == sizeof(bf16) && sizeof(__half) == sizeof(fp16));
#endif
template <class T>
using native_t = typename native<T>::type;

TIERSTATE_HOST_DEVICE float to_float(float x) noexcept { return x; }
TIERSTATE_HOST_DEVICE float to_float(bf16 x) noexcept { return static_cast<float>(x); }
TIERSTATE_HOST_DEVICE float to_float(fp16 x) noexcept { return static_cast<float>(x); }
#if defined(TIERSTATE_ENABLE_CUDA)
__host__ __device__ inline float to_float(__nv_bfloat16 x) noexcept { return __bfloat162float(x); }
__host__ __device__ inline float to_float(__half x) noexcept { return __half2float(x); }
#endif

template <class T>
TIERSTATE_HOST_DEVICE T from_float(float x) noexcept
{
#if defined(TIERSTATE_ENABLE_CUDA)
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16_rn(x);
  } else if constexpr (std::is_same_v<T, __half>) {
    return __float2half_rn(x);
  } else {
    return convert<T>(x);
  }
#else
  return convert<T>(x);
#endif
}

/// A bf16 (native) from its bits.
template <class T>
TIERSTATE_HOST_DEVICE T bf16_from_bits(std::uint16_t bits) noexcept
{
#if defined(TIERSTATE_ENABLE_CUDA)
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    __nv_bfloat16_raw raw;
    raw.x = bits;
    return T(raw);
  } else
#endif
  {
    return T::from_bits(bits);
  }
}

/// The type a kernel reads and writes for slot J, stored with an element codec.
template <class P, std::size_t J>
using slot_native_t = native_t<typename P::template state_codec<J>::element_type>;

/// The weight an element's update starts from: its master, its param plus its compensation
/// (Compensated), or its param. `lead` is the master or the compensation (unused without).
template <class P, class Param, class Lead>
TIERSTATE_HOST_DEVICE float load_weight(Param const& param, Lead const& lead) noexcept
{
  if constexpr (P::has_master) {
    return lead;
  } else if constexpr (P::has_compensation) {
    return to_float(param) + to_float(lead);
  } else {
    return to_float(param);
  }
}

/// Where the updated weight goes: the master (when kept), the param (rounded) and, for
/// Compensated, what the rounding lost (w - param is exact in float).
template <class P, class Param, class Lead>
TIERSTATE_HOST_DEVICE void store_weight(float w, Param& param, Lead& lead) noexcept
{
  if constexpr (P::has_master) { lead = w; }
  Param const p = from_float<Param>(w);
  param         = p;
  if constexpr (P::has_compensation) { lead = from_float<Param>(w - to_float(p)); }
}

/// One element: the tuple holds (param, grad, [master or compensation,] slot 0, slot 1, ...)
/// references.
template <class R, class P>
struct update_element {
  static constexpr std::size_t slots = R::slots.size();
  static constexpr std::size_t first = P::leading_slots + 2;  ///< tuple index of slot 0
  using param_t = native_t<typename P::param_type>;

  typename R::coefficients k;

  template <class Tuple, std::size_t... I>
  TIERSTATE_HOST_DEVICE void run(Tuple&& t, std::index_sequence<I...>) const
  {
    auto&& param  = thrust::get<0>(t);
    auto&& lead   = thrust::get<P::leading_slots == 1 ? 2 : 0>(t);  // (without a master or a compensation: unused)
    float w       = load_weight<P>(param, lead);
    float const g = to_float(thrust::get<1>(t));
    slot_values<float, slots> s{to_float(thrust::get<first + I>(t))...};

    R::update(k, w, g, s);

    store_weight<P>(w, param, lead);
    ((thrust::get<first + I>(t) = from_float<slot_native_t<P, I>>(s[I])), ...);
  }

  template <class Tuple>
  TIERSTATE_HOST_DEVICE void operator()(Tuple t) const
  {
    run(t, std::make_index_sequence<slots>{});
  }
};

/// One block of B elements (the precision's largest codec block), where a slot has a block
/// codec: its block-coded slots decoded into scratch, each element updated as update_element
/// does, the blocks encoded back. The last block may be partial (m < B). A tensor-phase rule
/// and StochasticRounding always run here (B = 1 without a block codec): each element's
/// place in its tensor is its index.
template <class R, class P, std::size_t Slots>
struct update_block {
  static constexpr std::size_t B = tierstate::detail::state_block_v<P, Slots>;
  using param_t = native_t<typename P::param_type>;
  using grad_t  = native_t<typename P::grad_type>;

  typename R::coefficients k;
  param_t* param;
  grad_t const* grad;
  float* master;
  param_t* compensation;
  void* state[Slots == 0 ? 1 : Slots];
  std::size_t n;
  float const* tensor_state;  ///< a tensor-phase rule: its tensor's state, shape and element 0's index
  tensor_shape shape;
  std::size_t tensor_offset;  ///< (and with StochasticRounding, element 0's index and the tensor's key)
  std::uint32_t rounding_key;

  template <std::size_t J>
  using codec_t = typename P::template state_codec<J>;

  template <std::size_t... J>
  TIERSTATE_HOST_DEVICE void run(std::size_t i, std::size_t m, std::index_sequence<J...>) const
  {
    float scratch[Slots == 0 ? 1 : Slots][B];
    (load_slot<J>(scratch[J], i, m), ...);
    for (std::size_t e = 0; e < m; ++e) {
      float w       = load_weight<P>(param[i + e], lead_at(i + e));
      float const g = to_float(grad[i + e]);
      slot_values<float, Slots> s{scratch[J][e]...};
      if constexpr (has_tensor_phase<R>) {
        std::size_t const at = tensor_offset + i + e;
        R::update(k, w, g, s, tensor_position<float>{tensor_state, shape, at / shape.columns, at % shape.columns, 1});
      } else {
        R::update(k, w, g, s);
      }
      if constexpr (P::has_stochastic_rounding) {
        param[i + e] = bf16_from_bits<param_t>(codecs::round_stochastic_bf16(w, rounding_key, tensor_offset + i + e));
      } else {
        store_weight<P>(w, param[i + e], lead_at(i + e));
      }
      ((scratch[J][e] = s[J]), ...);
    }
    (store_slot<J>(scratch[J], i, m), ...);
  }

  /// Element i's master or compensation (without either: its param, unused).
  TIERSTATE_HOST_DEVICE auto& lead_at(std::size_t i) const noexcept
  {
    if constexpr (P::has_master) {
      return master[i];
    } else if constexpr (P::has_compensation) {
      return compensation[i];
    } else {
      return param[i];
    }
  }

  template <std::size_t J>
  TIERSTATE_HOST_DEVICE void load_slot(float* to, std::size_t i, std::size_t m) const
  {
    using C = codec_t<J>;
    if constexpr (block_codec<C>) {
      auto const* base = static_cast<std::byte const*>(state[J]);
      for (std::size_t q = 0; q < m; q += C::block) {
        C::decode(tierstate::detail::codec_address<C>(base, i + q), to + q, m - q < C::block ? m - q : C::block);
      }
    } else {
      auto const* from = static_cast<slot_native_t<P, J> const*>(state[J]) + i;
      for (std::size_t e = 0; e < m; ++e) { to[e] = to_float(from[e]); }
    }
  }

  template <std::size_t J>
  TIERSTATE_HOST_DEVICE void store_slot(float const* from, std::size_t i, std::size_t m) const
  {
    using C = codec_t<J>;
    if constexpr (block_codec<C>) {
      auto* base = static_cast<std::byte*>(state[J]);
      for (std::size_t q = 0; q < m; q += C::block) {
        C::encode(from + q, m - q < C::block ? m - q : C::block, tierstate::detail::codec_address<C>(base, i + q));
      }
    } else {
      auto* to = static_cast<slot_native_t<P, J>*>(state[J]) + i;
      for (std::size_t e = 0; e < m; ++e) { to[e] = from_float<slot_native_t<P, J>>(from[e]); }
    }
  }

  TIERSTATE_HOST_DEVICE void operator()(std::size_t block) const
  {
    std::size_t const i = block * B;
    run(i, n - i < B ? n - i : B, std::make_index_sequence<Slots>{});
  }
};

/// An infinity or NaN: an exponent of all ones, in every storage type.
template <class Bits, Bits Exponent>
struct is_nonfinite_bits {
  TIERSTATE_HOST_DEVICE bool operator()(Bits v) const noexcept { return (v & Exponent) == Exponent; }
};

/// Sets *flag when it sees an infinity or NaN (every writer writes the same 1; on the host
/// backends, whose threads are C++ threads, as an atomic store).
template <class Bits, Bits Exponent>
struct mark_nonfinite_bits {
  std::uint32_t* flag;
  TIERSTATE_HOST_DEVICE void operator()(Bits v) const noexcept
  {
    if (!is_nonfinite_bits<Bits, Exponent>{}(v)) { return; }
#if defined(__CUDA_ARCH__)
    *flag = 1;
#else
    std::atomic_ref<std::uint32_t>(*flag).store(1, std::memory_order_relaxed);
#endif
  }
};

/// The bits of a storage type, and its exponent mask.
template <storage_type T>
struct nonfinite_traits {
  using bits_t = std::conditional_t<std::is_same_v<T, float>, std::uint32_t, std::uint16_t>;
  static constexpr bits_t exponent = std::is_same_v<T, float>  ? bits_t(0x7f800000u)
                                     : std::is_same_v<T, bf16> ? bits_t(0x7f80u)
                                                               : bits_t(0x7c00u);
};

template <class P, std::size_t S, std::size_t... I>
auto zip_begin(update_arrays<P, S> const& a, std::index_sequence<I...>)
{
  using param_t = native_t<typename P::param_type>;
  using grad_t  = native_t<typename P::grad_type>;
  auto* param   = reinterpret_cast<param_t*>(a.param);
  auto* grad    = reinterpret_cast<grad_t const*>(a.grad);
  if constexpr (P::has_master) {
    return thrust::make_zip_iterator(thrust::make_tuple(param, grad, a.master,
                                                        static_cast<slot_native_t<P, I>*>(a.state[I])...));
  } else if constexpr (P::has_compensation) {
    return thrust::make_zip_iterator(thrust::make_tuple(param, grad, reinterpret_cast<param_t*>(a.compensation),
                                                        static_cast<slot_native_t<P, I>*>(a.state[I])...));
  } else {
    return thrust::make_zip_iterator(thrust::make_tuple(param, grad, static_cast<slot_native_t<P, I>*>(a.state[I])...));
  }
}

}  // namespace detail
}  // namespace TIERSTATE_DEVICE_ABI
}  // namespace tierstate::device

// The element-parallel step for 8-bit (scaled_map_codec) slots: elementwise_blocks and
// update_mapped_async.
#include <tierstate/kernels/device/detail/update_mapped.inl>

namespace tierstate::inline TIERSTATE_ABI::device {
inline namespace TIERSTATE_DEVICE_ABI {

template <rule R, precision P>
void update_async(stream_view s, typename R::coefficients const& k,
                  update_arrays<P, R::slots.size()> const& a, std::size_t n)
{
  host::check_arrays(a, n);
  if (n == 0) { return; }
  constexpr std::size_t slots = R::slots.size();
  if constexpr (detail::elementwise_blocks<R, P, slots>) {
    detail::update_mapped_async<R, P, slots>(s, k, a, n);
  } else if constexpr (tierstate::detail::state_block_v<P, slots> > 1 || has_tensor_phase<R> || P::has_stochastic_rounding) {
    using block_f = detail::update_block<R, P, slots>;
    block_f f{k, reinterpret_cast<typename block_f::param_t*>(a.param),
              reinterpret_cast<typename block_f::grad_t const*>(a.grad), a.master,
              reinterpret_cast<typename block_f::param_t*>(a.compensation), {}, n,
              a.tensor_state, a.shape, a.tensor_offset, a.rounding_key};
    for (std::size_t j = 0; j != slots; ++j) { f.state[j] = a.state[j]; }
    auto const first = thrust::counting_iterator<std::size_t>(0);
    auto const last  = first + static_cast<std::ptrdiff_t>((n + block_f::B - 1) / block_f::B);
#if defined(TIERSTATE_ENABLE_CUDA)
    thrust::for_each(thrust::cuda::par_nosync.on(s.native()), first, last, f);
    TIERSTATE_CUDA_TRY(cudaGetLastError());
#else
    runtime::detail::enqueue(s, [=] { thrust::for_each(thrust::device, first, last, f); });
#endif
  } else {
    auto const begin = detail::zip_begin(a, std::make_index_sequence<R::slots.size()>{});
    auto const end   = begin + static_cast<std::ptrdiff_t>(n);
    detail::update_element<R, P> const f{k};
#if defined(TIERSTATE_ENABLE_CUDA)
    thrust::for_each(thrust::cuda::par_nosync.on(s.native()), begin, end, f);
    TIERSTATE_CUDA_TRY(cudaGetLastError());
#else
    runtime::detail::enqueue(s, [=] { thrust::for_each(thrust::device, begin, end, f); });
#endif
  }
}

template <storage_type T>
bool any_nonfinite(stream_view s, T const* x, std::size_t n)
{
  if (n == 0) { return false; }
  using traits = detail::nonfinite_traits<T>;
  using bits_t = typename traits::bits_t;
  auto const* b = reinterpret_cast<bits_t const*>(x);
  detail::is_nonfinite_bits<bits_t, traits::exponent> const pred{};
#if defined(TIERSTATE_ENABLE_CUDA)
  return thrust::any_of(thrust::cuda::par.on(s.native()), b, b + n, pred);
#else
  s.synchronize();
  return thrust::any_of(thrust::device, b, b + n, pred);
#endif
}

template <storage_type T>
void mark_nonfinite_async(stream_view s, T const* x, std::size_t n, std::uint32_t* flag)
{
  if (n == 0) { return; }
  using traits = detail::nonfinite_traits<T>;
  using bits_t = typename traits::bits_t;
  auto const* b = reinterpret_cast<bits_t const*>(x);
  detail::mark_nonfinite_bits<bits_t, traits::exponent> const f{flag};
#if defined(TIERSTATE_ENABLE_CUDA)
  thrust::for_each(thrust::cuda::par_nosync.on(s.native()), b, b + n, f);
  TIERSTATE_CUDA_TRY(cudaGetLastError());
#else
  runtime::detail::enqueue(s, [=] { thrust::for_each(thrust::device, b, b + n, f); });
#endif
}

}  // namespace TIERSTATE_DEVICE_ABI
}  // namespace tierstate::device
