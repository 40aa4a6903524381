// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <thrust/for_each.h>
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

/// One element: the tuple holds (param, grad, [master,] slot 0, slot 1, ...) references.
template <class R, class P>
struct update_element {
  static constexpr std::size_t slots = R::slots.size();
  static constexpr std::size_t first = P::has_master ? 3 : 2;  ///< tuple index of slot 0
  using param_t = native_t<typename P::param_type>;
  using state_t = native_t<typename P::state_type>;

  typename R::coefficients k;

  template <class Tuple, std::size_t... I>
  TIERSTATE_HOST_DEVICE void run(Tuple&& t, std::index_sequence<I...>) const
  {
    float w;
    if constexpr (P::has_master) {
      w = thrust::get<2>(t);
    } else {
      w = to_float(thrust::get<0>(t));
    }
    float const g = to_float(thrust::get<1>(t));
    float s[slots]{to_float(thrust::get<first + I>(t))...};

    R::update(k, w, g, s);

    if constexpr (P::has_master) { thrust::get<2>(t) = w; }
    thrust::get<0>(t) = from_float<param_t>(w);
    ((thrust::get<first + I>(t) = from_float<state_t>(s[I])), ...);
  }

  template <class Tuple>
  TIERSTATE_HOST_DEVICE void operator()(Tuple t) const
  {
    run(t, std::make_index_sequence<slots>{});
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
  using state_t = native_t<typename P::state_type>;
  auto* param   = reinterpret_cast<param_t*>(a.param);
  auto* grad    = reinterpret_cast<grad_t const*>(a.grad);
  if constexpr (P::has_master) {
    return thrust::make_zip_iterator(thrust::make_tuple(param, grad, a.master,
                                                        reinterpret_cast<state_t*>(a.state[I])...));
  } else {
    return thrust::make_zip_iterator(thrust::make_tuple(param, grad, reinterpret_cast<state_t*>(a.state[I])...));
  }
}

}  // namespace detail

template <rule R, precision P>
void update_async(stream_view s, typename R::coefficients const& k,
                  update_arrays<P, R::slots.size()> const& a, std::size_t n)
{
  host::check_arrays(a, n);
  if (n == 0) { return; }
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
