// SPDX-License-Identifier: Apache-2.0
// The precision policy: which storage type each array of a step uses.
#pragma once

#include <tierstate/core/numeric.hpp>

#include <string>
#include <type_traits>

namespace tierstate::inline TIERSTATE_ABI {

/// The types of one optimizer step.
///
///   Param   what the model computes with and the optimizer writes back: float, bf16, fp16
///   Grad    what backward produces: float, bf16, fp16
///   Master  the fp32 master copy, which exists only when Param is not float (with fp32
///           params the param is its own master and is updated in place)
///   State   the rule's slots (Adam's m and v): float or bf16
///
/// Arithmetic is always float; narrower storage is converted on load and rounded to nearest
/// even on store.
template <class Param, class Grad = Param, class Master = float, class State = float>
struct Precision {
  static_assert(storage_type<Param>,
                "tierstate::Precision: Param must be float, tierstate::bf16 or tierstate::fp16.");
  static_assert(storage_type<Grad>,
                "tierstate::Precision: Grad must be float, tierstate::bf16 or tierstate::fp16.");
  static_assert(std::is_same_v<Master, float>,
                "tierstate::Precision: the master copy is fp32; Master must be float.");
  static_assert(std::is_same_v<State, float> || std::is_same_v<State, bf16>,
                "tierstate::Precision: State must be float or tierstate::bf16.");

  using param_type  = Param;
  using grad_type   = Grad;
  using master_type = Master;
  using state_type  = State;

  /// Whether a separate fp32 master slot is kept (only when the param is not fp32).
  static constexpr bool has_master = !std::is_same_v<Param, float>;

  /// "param/grad/master/state", for example "bf16/bf16/fp32/fp32".
  [[nodiscard]] static std::string name()
  {
    std::string n(type_name_v<Param>);
    n += '/';
    n += type_name_v<Grad>;
    n += '/';
    n += type_name_v<Master>;
    n += '/';
    n += type_name_v<State>;
    return n;
  }
};

/// fp32 params, grads and state: the param is its own master.
using Fp32 = Precision<float, float, float, float>;
/// bf16 params and grads, fp32 master and state: the usual mixed-precision recipe.
using Bf16Mixed = Precision<bf16, bf16, float, float>;
/// fp16 params and grads, fp32 master and state (pair with loss scaling).
using Fp16Mixed = Precision<fp16, fp16, float, float>;
/// bf16 params and grads, fp32 master, bf16 m and v: 4 bytes of state per element less.
using Bf16MixedBf16State = Precision<bf16, bf16, float, bf16>;

template <class T>
inline constexpr bool is_precision_v = false;
template <class P, class G, class M, class S>
inline constexpr bool is_precision_v<Precision<P, G, M, S>> = true;

/// Satisfied by the instantiations of tierstate::Precision.
template <class T>
concept precision = is_precision_v<T>;

}  // namespace tierstate
