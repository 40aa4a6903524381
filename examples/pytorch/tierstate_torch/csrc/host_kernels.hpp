// SPDX-License-Identifier: Apache-2.0
// The host kernels of every OnHost composition (shard_impl.hpp's for_rule and
// for_rule_compact), as one host_kernels list (kernels/host/dispatch.hpp). A package build
// dispatches them at run time: the compositions are compiled once for plain x86-64, and
// host_kernels.cpp once per x86-64 level (setup.py), so that one wheel runs on any x86-64 CPU
// at the speed of the widest level it has.
#pragma once

#include <tierstate/kernels/host/dispatch.hpp>
#include <tierstate/tierstate.hpp>

#include <type_traits>

namespace tierstate_torch::kernels {

using namespace tierstate;

template <class... L>
struct concat;
template <class... K>
struct concat<host_kernels<K...>> {
  using type = host_kernels<K...>;
};
template <class... A, class... B, class... L>
struct concat<host_kernels<A...>, host_kernels<B...>, L...> {
  using type = typename concat<host_kernels<A..., B...>, L...>::type;
};

/// for_rule's precisions for one param dtype: an fp32 master (fp32 params: their own), fp32
/// state, and bf16 state for a rule with slots.
template <class R, class Param>
using plain_of = std::conditional_t<R::slots.size() == 0, host_kernels<host_kernel<R, Precision<Param, Param, float, float>>>,
                                    host_kernels<host_kernel<R, Precision<Param, Param, float, float>>,
                                                 host_kernel<R, Precision<Param, Param, float, bf16>>>>;
template <class R>
using plain = typename concat<plain_of<R, float>, plain_of<R, bf16>, plain_of<R, fp16>>::type;

/// for_rule_compact's: 8-bit state with an fp32 master (any param dtype) or with bf16 params'
/// Kahan compensation or stochastic rounding, which also take fp32 and bf16 state.
template <class R>
using eight_bit = std::conditional_t<R::slots.size() == 2, slot_codecs<codecs::dynamic8, codecs::udynamic8>, codecs::dynamic8>;
template <class R, class Master>
using no_master = host_kernels<host_kernel<R, Precision<bf16, bf16, Master, eight_bit<R>>>,
                               host_kernel<R, Precision<bf16, bf16, Master, bf16>>,
                               host_kernel<R, Precision<bf16, bf16, Master, float>>>;
template <class R>
using compact = typename concat<host_kernels<host_kernel<R, Precision<float, float, float, eight_bit<R>>>,
                                             host_kernel<R, Precision<fp16, fp16, float, eight_bit<R>>>,
                                             host_kernel<R, Precision<bf16, bf16, float, eight_bit<R>>>>,
                                no_master<R, Compensated>, no_master<R, StochasticRounding>>::type;

using all = typename concat<plain<Adam>, plain<AdamW>, plain<AdamAmsgrad>, plain<AdamWAmsgrad>, plain<SGD>,
                            plain<SGDMomentum>, plain<Lion>, plain<Adafactor>, compact<Adam>, compact<AdamW>,
                            compact<Lion>, compact<SGDMomentum>>::type;

}  // namespace tierstate_torch::kernels
