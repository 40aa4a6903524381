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
  for (std::size_t s = 0; s < Slots; ++s) {
    TIERSTATE_EXPECTS(a.state[s] != nullptr,
                      "update_arrays.state[" + std::to_string(s) + "] is null");
  }
}

namespace detail {

/// One batch at element i: load, update, store.
template <class R, class P, class Arch, std::size_t Slots>
TIERSTATE_ALWAYS_INLINE void update_batch(typename R::coefficients const& k,
                                          update_arrays<P, Slots> const& a, std::size_t i) noexcept
{
#if !defined(__CUDA_ARCH__)
  // (nvcc's device pass skips this host-only body: the rule's update is __host__ __device__,
  // and would otherwise be instantiated for the device on a SIMD batch, which it cannot hold.)
  using V = xsimd::batch<float, Arch>;
  V w;
  if constexpr (P::has_master) {
    w = detail::load_as_float<Arch>(a.master + i);
  } else {
    w = detail::load_as_float<Arch>(a.param + i);
  }
  V const g = detail::load_as_float<Arch>(a.grad + i);
  V s[Slots];
  for (std::size_t j = 0; j < Slots; ++j) { s[j] = detail::load_as_float<Arch>(a.state[j] + i); }

  R::update(k, w, g, s);

  if constexpr (P::has_master) { detail::store_rounded<Arch>(a.master + i, w); }
  detail::store_rounded<Arch>(a.param + i, w);
  for (std::size_t j = 0; j < Slots; ++j) { detail::store_rounded<Arch>(a.state[j] + i, s[j]); }
#else
  (void)k, (void)a, (void)i;
#endif
}

/// The last m < batch elements from i: through zero-padded copies, same instructions.
template <class R, class P, class Arch, std::size_t Slots>
void update_tail(typename R::coefficients const& k, update_arrays<P, Slots> const& a,
                 std::size_t i, std::size_t m) noexcept
{
  constexpr std::size_t n = xsimd::batch<float, Arch>::size;
  using param_t = typename P::param_type;
  using grad_t  = typename P::grad_type;
  using state_t = typename P::state_type;

  alignas(64) param_t param[n] = {};
  alignas(64) grad_t grad[n]   = {};
  alignas(64) float master[n]  = {};
  alignas(64) state_t state[Slots][n] = {};

  update_arrays<P, Slots> t;
  t.param = param;
  t.grad  = grad;
  t.master = master;
  for (std::size_t j = 0; j < Slots; ++j) { t.state[j] = state[j]; }

  if constexpr (P::has_master) {
    std::memcpy(master, a.master + i, m * sizeof(float));
  } else {
    std::memcpy(param, a.param + i, m * sizeof(param_t));
  }
  std::memcpy(grad, a.grad + i, m * sizeof(grad_t));
  for (std::size_t j = 0; j < Slots; ++j) { std::memcpy(state[j], a.state[j] + i, m * sizeof(state_t)); }

  update_batch<R, P, Arch>(k, t, 0);

  if constexpr (P::has_master) { std::memcpy(a.master + i, master, m * sizeof(float)); }
  std::memcpy(a.param + i, param, m * sizeof(param_t));
  for (std::size_t j = 0; j < Slots; ++j) { std::memcpy(a.state[j] + i, state[j], m * sizeof(state_t)); }
}

/// Whether R::update takes xsimd batches of Arch, as it takes floats (a rule whose update is
/// written for float alone does not).
template <class R, class Arch>
concept updates_batches = requires(typename R::coefficients const& k, xsimd::batch<float, Arch>& w,
                                   xsimd::batch<float, Arch> g, xsimd::batch<float, Arch> (&s)[R::slots.size()]) {
  R::update(k, w, g, s);
};

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
    constexpr std::size_t n = xsimd::batch<float, Arch>::size;
    // Local copies: the stores below cannot alias them, so the compiler keeps the pointers
    // and the broadcast coefficients in registers across the loop.
    auto const kl = k;
    auto const al = a;
    std::size_t i = begin;
    for (; i + n <= end; i += n) { detail::update_batch<R, P, Arch>(kl, al, i); }
    if (i < end) { detail::update_tail<R, P, Arch>(kl, al, i, end - i); }
  }
}

template <rule R, precision P, class Arch>
void update(thread_pool& pool, typename R::coefficients const& k,
            update_arrays<P, R::slots.size()> const& a, std::size_t n)
{
  check_arrays(a, n);
  // Parts start on multiples of 64 batches: cache-line aligned, and large enough that no
  // two threads write the same line.
  pool.parallel_for(n, 64 * batch_size<Arch>, [&](std::size_t b, std::size_t e) {
    update_range<R, P, Arch>(k, a, b, e);
  });
}

}  // namespace tierstate::host
