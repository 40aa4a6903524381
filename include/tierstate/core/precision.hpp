// SPDX-License-Identifier: Apache-2.0
// The precision policy: which storage type each array of a step uses.
#pragma once

#include <tierstate/codecs/codec.hpp>
#include <tierstate/codecs/stochastic_rounding.hpp>
#include <tierstate/core/concepts.hpp>
#include <tierstate/core/numeric.hpp>

#include <algorithm>
#include <cstddef>
#include <string>
#include <type_traits>
#include <utility>

namespace tierstate::inline TIERSTATE_ABI {

/// A precision's Master where a bf16 param is its own master: no fp32 copy, but a bf16
/// compensation slot that holds what the last rounding of the param lost (Kahan's
/// compensated summation). The update reads param + compensation as the weight and stores
/// the param rounded and the new rounding error: about 16 bits of mantissa for 4 bytes per
/// element, where an fp32 master takes 6 (param and master).
struct Compensated {};

/// The types of one optimizer step.
///
///   Param   what the model computes with and the optimizer writes back: float, bf16, fp16
///   Grad    what backward produces: float, bf16, fp16
///   Master  float: the fp32 master copy, which exists only when Param is not float (with
///           fp32 params the param is its own master and is updated in place); or
///           Compensated (bf16 params only): no master, a bf16 compensation slot instead; or
///           StochasticRounding (bf16 params only): no master and no slot, the param rounded
///           stochastically (codecs/stochastic_rounding.hpp)
///   State   how the rule's slots (Adam's m and v) are stored: float, bf16, a codec
///           (codecs/codec.hpp: every slot with it), or slot_codecs<C...> (one per slot)
///
/// Arithmetic is always float; narrower storage is converted on load and rounded to nearest
/// even on store (a block codec encodes and decodes whole blocks).
template <class Param, class Grad = Param, class Master = float, class State = float>
struct Precision {
  static_assert(storage_type<Param>,
                "tierstate::Precision: Param must be float, tierstate::bf16 or tierstate::fp16.");
  static_assert(storage_type<Grad>,
                "tierstate::Precision: Grad must be float, tierstate::bf16 or tierstate::fp16.");
  static_assert(std::is_same_v<Master, float> ||
                  ((std::is_same_v<Master, Compensated> || std::is_same_v<Master, StochasticRounding>) &&
                   std::is_same_v<Param, bf16>),
                "tierstate::Precision: Master must be float (an fp32 master copy), or, with bf16 params only, "
                "Compensated (a bf16 compensation slot instead of the master) or StochasticRounding (the param "
                "rounded stochastically, no master).");
  static_assert(detail::state_format_traits<State>::valid,
                "tierstate::Precision: State must be float, tierstate::bf16, a codec or tierstate::slot_codecs<C...> "
                "of codecs (codecs/codec.hpp: a block codec has name, block (a power of two up to 2048), "
                "block_bytes, decode and encode).");

  using param_type  = Param;
  using grad_type   = Grad;
  using master_type = Master;
  using state_type  = State;  ///< as given: a storage type, a codec or slot_codecs

  /// The codec of the rule's slot J.
  template <std::size_t J>
  using state_codec = typename detail::state_format_traits<State>::template codec_at<J>;
  /// The number of slots State names (slot_codecs), or 0 where it suits any rule.
  static constexpr std::size_t state_codec_count = detail::state_format_traits<State>::count;

  /// Whether a separate fp32 master slot is kept (only when the param is not fp32).
  static constexpr bool has_master = !std::is_same_v<Param, float> && std::is_same_v<Master, float>;
  /// Whether the param is its own master with a compensation slot (Compensated).
  static constexpr bool has_compensation = std::is_same_v<Master, Compensated>;
  /// Whether the param is its own master, rounded stochastically (StochasticRounding).
  static constexpr bool has_stochastic_rounding = std::is_same_v<Master, StochasticRounding>;
  /// The slots the layout keeps before the rule's: the master or the compensation, or none.
  static constexpr std::size_t leading_slots = has_master || has_compensation ? 1 : 0;
  /// The leading slot, where there is one, and how it is stored: the master in fp32, or the
  /// compensation in bf16.
  static constexpr slot leading_slot = has_compensation ? slot::compensation : slot::master;
  using leading_codec                = std::conditional_t<has_compensation, codecs::bf16, codecs::fp32>;

  /// "param/grad/master/state", for example "bf16/bf16/fp32/fp32".
  [[nodiscard]] static std::string name()
  {
    std::string n(type_name_v<Param>);
    n += '/';
    n += type_name_v<Grad>;
    n += '/';
    if constexpr (has_compensation) {
      n += "comp";
    } else if constexpr (has_stochastic_rounding) {
      n += "sr";
    } else {
      n += type_name_v<Master>;
    }
    n += '/';
    n += detail::state_format_traits<State>::name();
    return n;
  }
};

namespace detail {

/// The largest codec block among the first N slots of P's state (1: element codecs only).
/// Blocks are powers of two, so this is also their least common multiple.
template <class P, std::size_t N>
inline constexpr std::size_t state_block_v = []<std::size_t... J>(std::index_sequence<J...>) {
  std::size_t b = 1;
  ((b = std::max<std::size_t>(b, P::template state_codec<J>::block)), ...);
  return b;
}(std::make_index_sequence<N>{});

}  // namespace detail

/// fp32 params, grads and state: the param is its own master.
using Fp32 = Precision<float, float, float, float>;
/// bf16 params and grads, fp32 master and state: the usual mixed-precision recipe.
using Bf16Mixed = Precision<bf16, bf16, float, float>;
/// fp16 params and grads, fp32 master and state (pair with loss scaling).
using Fp16Mixed = Precision<fp16, fp16, float, float>;
/// bf16 params and grads, no master but a bf16 compensation slot, fp32 m and v.
using Bf16Compensated = Precision<bf16, bf16, Compensated, float>;
/// bf16 params and grads, no master and no slot but stochastic rounding, fp32 m and v.
using Bf16Stochastic = Precision<bf16, bf16, StochasticRounding, float>;
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
