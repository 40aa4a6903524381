// SPDX-License-Identifier: Apache-2.0
// The tier concept: where optimizer state rests between steps.
//
// A tier is a byte store of a fixed size, made when the optimizer first needs its state (the
// size is the layout's total_bytes()) and zero-filled. Every tier supports read and write of
// any byte range; a tier that can also hand out a pointer to its bytes (`data()`) is
// addressable, and transfers compute on it in place instead of staging chunks.
//
//   struct MyTier {
//     struct options { ... };                               // with defaults
//     static constexpr std::string_view name = "MyTier";
//     MyTier(std::size_t bytes, options const&);           // zero-filled
//     std::size_t size() const;
//     void read(std::size_t offset, std::span<std::byte> to) const;
//     void write(std::size_t offset, std::span<std::byte const> from);
//     std::byte* data();                                   // optional: addressable tiers
//   };
//
// read and write throw on failure (tierstate::io_error for I/O) and leave the rest of the
// tier unchanged.
#pragma once

#include <concepts>
#include <cstddef>
#include <span>
#include <string_view>

namespace tierstate {

template <class T>
concept tier = std::constructible_from<T, std::size_t, typename T::options const&> &&
               requires(T& t, T const& ct, std::size_t offset, std::span<std::byte> to,
                        std::span<std::byte const> from) {
                 { T::name } -> std::convertible_to<std::string_view>;
                 { ct.size() } -> std::same_as<std::size_t>;
                 ct.read(offset, to);
                 t.write(offset, from);
               };

/// A tier whose bytes the CPU can address directly: computed on in place.
template <class T>
concept addressable_tier = tier<T> && requires(T& t) {
  { t.data() } -> std::same_as<std::byte*>;
};

}  // namespace tierstate
