// SPDX-License-Identifier: Apache-2.0
// A block codec written in the tests alone, against codecs/codec.hpp: each block of B
// elements stored as a float scale (the block's largest magnitude) and B signed 8-bit codes,
// value = code * scale / 127. It is not a good 8-bit optimizer state (that needs a nonlinear
// map for Adam's v, and is issue 19's); it is a format the library must carry through every
// route without knowing it: blocks that end inside a tensor's last block, scales that
// depend on the whole block, and bytes that are not a whole number of elements. Its two
// functions run on the host and in device kernels (nvcc: test_device_cuda.cu).
#pragma once

#include <tierstate/codecs/codec.hpp>
#include <tierstate/core/precision.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace tierstate::test {

template <std::size_t B>
struct AbsmaxInt8 {
  static constexpr std::string_view name = B == 64 ? "test_absmax_int8_64" : "test_absmax_int8_256";
  static constexpr std::size_t block       = B;
  static constexpr std::size_t block_bytes = sizeof(float) + B;

  TIERSTATE_HOST_DEVICE static void decode(std::byte const* from, float* out, std::size_t n) noexcept
  {
    float scale;
    std::memcpy(&scale, from, sizeof scale);
    float const step = scale / 127.0f;
    for (std::size_t i = 0; i < n; ++i) {
      auto const code = static_cast<std::int8_t>(from[sizeof(float) + i]);
      out[i]          = static_cast<float>(code) * step;
    }
  }

  TIERSTATE_HOST_DEVICE static void encode(float const* in, std::size_t n, std::byte* to) noexcept
  {
    float scale = 0.0f;
    for (std::size_t i = 0; i < n; ++i) { scale = std::fmax(scale, std::fabs(in[i])); }
    std::memcpy(to, &scale, sizeof scale);
    float const inverse = scale > 0.0f ? 127.0f / scale : 0.0f;
    for (std::size_t i = 0; i < B; ++i) {
      float const q = i < n ? std::nearbyint(in[i] * inverse) : 0.0f;
      to[sizeof(float) + i] = static_cast<std::byte>(static_cast<std::int8_t>(std::fmax(-127.0f, std::fmin(127.0f, q))));
    }
  }
};

static_assert(block_codec<AbsmaxInt8<64>> && block_codec<AbsmaxInt8<256>>);
static_assert(!element_codec<AbsmaxInt8<64>> && element_codec<codecs::bf16>);

// (Adam's v is not stored with it: a linear 8-bit v rounds small values to zero, and
// m / (sqrt(0) + eps) steps far; that is why 8-bit optimizers store v on another map.)

/// bf16 params, an fp32 master; m in 8-bit blocks of 256, v as fp32: one codec per slot.
using Bf16MixedInt8M = Precision<bf16, bf16, float, slot_codecs<AbsmaxInt8<256>, codecs::fp32>>;
/// fp32 params (their own master); m in 8-bit blocks of 64, v as bf16.
using Fp32Int8M = Precision<float, float, float, slot_codecs<AbsmaxInt8<64>, codecs::bf16>>;

}  // namespace tierstate::test
