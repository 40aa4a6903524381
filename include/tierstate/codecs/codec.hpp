// SPDX-License-Identifier: Apache-2.0
// Codecs: how a slot of optimizer state is stored.
//
// A codec stores a slot's elements in blocks of `block` elements, each `block_bytes` bytes.
// Two kinds model the `codec` concept:
//
//   - an element codec (block 1) stores each element as a storage type: `codecs::fp32`,
//     `codecs::bf16`. The kernels load and store it with their SIMD conversions, rounding to
//     nearest even;
//   - a block codec (block > 1, a power of two up to 2048) stores a block as it likes, for
//     example 8-bit codes with a per-block scale. It is two functions, callable on the host
//     and in a device kernel:
//
//       static void decode(std::byte const* block, float* out, std::size_t n) noexcept;
//       static void encode(float const* in, std::size_t n, std::byte* block) noexcept;
//
//     decode writes the block's first n values (n <= block); encode makes the block's bytes,
//     all block_bytes of them, from its first n values alone (the block's last elements may
//     be past a tensor's end). Both must be deterministic, and a block of zero bytes must
//     decode to zeros (fresh state is zero bytes).
//
// The library keeps every block within one tensor and one chunk: a tensor starts on a block
// boundary of the layout (the elements between tensors are padding that no step touches), and
// chunks hold whole blocks. So a tensor's state means the same whatever the chunk size, and
// copy_state/write_state read and write a tensor's blocks whole.
//
// A precision's State (core/precision.hpp) is float, tierstate::bf16, a codec (every slot
// stored with it), or slot_codecs<C...> (slot j of the rule stored with the j-th codec).
#pragma once

#include <tierstate/core/config.hpp>
#include <tierstate/core/numeric.hpp>

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>

namespace tierstate::inline TIERSTATE_ABI {

/// The largest block a codec may have: chunks are a multiple of it (core/layout.hpp).
inline constexpr std::size_t max_codec_block = 2048;

namespace codecs {

/// Each element stored as the storage type T (float, bf16).
template <storage_type T>
struct element {
  using element_type                         = T;
  static constexpr std::string_view name     = type_name_v<T>;
  static constexpr std::size_t block         = 1;
  static constexpr std::size_t block_bytes   = sizeof(T);
};

using fp32 = element<float>;
using bf16 = element<tierstate::bf16>;

}  // namespace codecs

/// An element codec: a storage type per element (codecs::element).
template <class C>
concept element_codec = requires {
  typename C::element_type;
  { C::name } -> std::convertible_to<std::string_view>;
} && storage_type<typename C::element_type> && C::block == 1 && C::block_bytes == sizeof(typename C::element_type);

/// A block codec: decode and encode whole blocks (see the file comment).
template <class C>
concept block_codec = requires(std::byte* b, std::byte const* cb, float* f, float const* cf, std::size_t n) {
  { C::name } -> std::convertible_to<std::string_view>;
  { C::block } -> std::convertible_to<std::size_t>;
  { C::block_bytes } -> std::convertible_to<std::size_t>;
  C::decode(cb, f, n);
  C::encode(cf, n, b);
} && (C::block > 1) && (C::block <= max_codec_block) && ((C::block & (C::block - 1)) == 0) && (C::block_bytes > 0);

template <class C>
concept codec = element_codec<C> || block_codec<C>;

/// A block codec whose block is a float scale, then one byte per element whose value is
/// map().value[code] * scale, a zero product +0 (codecs/dynamic8.hpp), with the scale from its `extremes` and
/// each code from code_of(map(), x * inverse_scale(scale)): its elements decode and encode
/// one by one, so that the device kernels give each element a thread of its own, the block's
/// scale found between the update and the encoding, rather than a block a thread. A codec
/// says so (`scaled_map = true`): its decode and encode must then be exactly that, which
/// members of the same names need not promise.
template <class C>
concept scaled_map_codec = block_codec<C> && C::scaled_map && requires(float x, float const* in, std::size_t n) {
  { C::map().value[0] } -> std::convertible_to<float>;
  { C::map().zero_code } -> std::convertible_to<int>;
  requires requires(typename C::extremes e) {
    e.add(in, n);
    { e.scale() } -> std::same_as<float>;
  };
  { C::inverse_scale(x) } -> std::same_as<float>;
  { C::code_of(C::map(), x) } -> std::same_as<std::uint8_t>;
} && C::block_bytes == sizeof(float) + C::block;

/// State stored with a codec per slot: the rule's slot j with the j-th codec (each C a
/// `codec`: the precision that holds them says so where one is not).
template <class... C>
struct slot_codecs {};

namespace detail {

template <class S>
struct state_format_traits {
  static constexpr bool valid = false;
};
template <class S>
  requires storage_type<S> && (!std::is_same_v<S, fp16>)
struct state_format_traits<S> {
  static constexpr bool valid = true;
  template <std::size_t J>
  using codec_at = codecs::element<S>;
  static constexpr std::size_t count = 0;  ///< any number of slots
  static std::string name() { return std::string(type_name_v<S>); }
};
template <codec C>
  requires(!storage_type<C>)
struct state_format_traits<C> {
  static constexpr bool valid = true;
  template <std::size_t J>
  using codec_at = C;
  static constexpr std::size_t count = 0;
  static std::string name() { return std::string(C::name); }
};
template <class... C>
struct state_format_traits<slot_codecs<C...>> {
  static constexpr bool valid = sizeof...(C) > 0 && (codec<C> && ...);
  template <std::size_t J>
  using codec_at = std::tuple_element_t<J, std::tuple<C...>>;
  static constexpr std::size_t count = sizeof...(C);
  static std::string name()
  {
    std::string n = "(";
    ((n += std::string(C::name) + ","), ...);
    n.back() = ')';
    return n;
  }
};

/// Elements of a slot stored with C before element e (a multiple of C::block, or any e for
/// an element codec), in bytes.
template <codec C>
TIERSTATE_HOST_DEVICE constexpr std::size_t codec_offset(std::size_t e) noexcept
{
  return e / C::block * C::block_bytes;
}

/// The address of element e of a slot array stored with C that starts at `base`.
template <codec C, class Byte>
TIERSTATE_HOST_DEVICE Byte* codec_address(Byte* base, std::size_t e) noexcept
{
  return base + codec_offset<C>(e);
}

}  // namespace detail
}  // namespace tierstate
