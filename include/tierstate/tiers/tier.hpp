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
//     std::byte* device_data();                            // optional: device memory
//   };
//
// read and write throw on failure (tierstate::io_error for I/O) and leave the rest of the
// tier unchanged.
//
// Optional members let a transfer drive a tier faster:
//
//     void transfer(std::span<tier_io const> ops);   // batched: many reads and writes at once
//     int register_staging(std::span<std::byte>);     // the staging ring, told once; 0 or errno
//     void stream_start(tier_io const&, std::uint64_t tag);          // streaming: start one,
//     void stream_progress(bool wait, Done done);  // done(tag, exception_ptr) as each finishes
//     std::size_t stream_active() const;           // started and not finished
//
// `transfer` runs independent reads and writes (no two touch the same bytes) together and
// returns when all are done, throwing the first failure after all have finished.
// `register_staging` lets a tier prepare for transfers to and from one memory region (for
// NvmeFile: io_uring fixed buffers); refusing it must not stop transfers from working.
#pragma once

#include <tierstate/core/config.hpp>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <span>
#include <string_view>

namespace tierstate::inline TIERSTATE_ABI {

/// One read or write of a batch (see `batched_tier`).
struct tier_io {
  std::size_t offset = 0;
  std::byte* data    = nullptr;
  std::size_t length = 0;
  bool write         = false;
};

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

/// A tier whose bytes live in device memory (tiers/device.hpp): device kernels update it in
/// place through `device_data()`; the host reaches it only through read and write.
template <class T>
concept device_tier = tier<T> && requires(T& t) {
  { t.device_data() } -> std::same_as<std::byte*>;
};

/// A tier that runs a batch of independent reads and writes at once.
template <class T>
concept batched_tier = tier<T> && requires(T& t, std::span<tier_io const> ops) { t.transfer(ops); };

/// A tier whose reads and writes can be started one by one and finish one by one.
template <class T>
concept streaming_tier =
  tier<T> && requires(T& t, T const& ct, tier_io const& op, std::uint64_t tag,
                      void (*done)(std::uint64_t, std::exception_ptr)) {
    t.stream_start(op, tag);
    t.stream_progress(true, done);
    { ct.stream_active() } -> std::convertible_to<std::size_t>;
  };

/// A tier that wants to know the staging memory its transfers will use.
template <class T>
concept staging_aware_tier = tier<T> && requires(T& t, std::span<std::byte> region) {
  { t.register_staging(region) } -> std::same_as<int>;
};

/// A tier that can check its options before any memory or file is made: the optimizer's
/// constructor calls `T::preflight(options)`, so a bad place for the state (a missing or
/// read-only directory, a limit too small) fails there, not at the first step. It throws
/// what the constructor would (tierstate::invalid_option, tierstate::io_error) and leaves
/// nothing behind.
template <class T>
concept preflight_tier = tier<T> && requires(typename T::options const& o) { T::preflight(o); };

}  // namespace tierstate
