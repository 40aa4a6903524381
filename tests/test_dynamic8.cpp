// SPDX-License-Identifier: Apache-2.0
// The 8-bit blockwise codecs (codecs/dynamic8.hpp) against a Python reference of the same
// math (tests/golden/make_golden_dynamic8.py): the maps value for value, blocks code for code,
// and AdamW, SGD with momentum and Lion whose moments are kept in 8 bits, after 30 steps,
// against torch.optim stepping on float32 moments that are re-stored in 8 bits after each step.
// The host's batch path (kernels/host/detail/codec_simd.hpp) against the codec's own encode at
// every midpoint of both maps.
#include "support.hpp"

#include <tierstate/codecs/dynamic8.hpp>

#include <catch2/catch.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string_view>
#include <vector>

using namespace tierstate;
using namespace tierstate::test;

namespace {

struct golden_block {
  bool is_signed;
  std::size_t n;
  double factor;
  float scale;
  std::vector<int> codes;
};

struct golden_run {
  char const* name;
  char const* rule;
  double lr_max, beta1, beta2, eps, weight_decay;
  int steps;
  std::vector<std::size_t> sizes;
  std::vector<float> params;
  std::vector<std::vector<float>> slots;
};

#include "golden/dynamic8_golden.inc"

using arch = xsimd::default_arch;

template <class C>
std::vector<std::byte> encoded_scalar(std::vector<float> const& v)
{
  std::vector<std::byte> b(C::block_bytes);
  C::encode(v.data(), v.size(), b.data());
  return b;
}

template <class C>
std::vector<std::byte> encoded_batches(std::vector<float> const& v)
{
  std::vector<std::byte> b(C::block_bytes, std::byte{0x5a});
  host::detail::encode_block<C, arch>(v.data(), v.size(), b.data());
  return b;
}

float scale_of(std::vector<std::byte> const& b) { return std::bit_cast<float>(std::uint32_t(b[0]) | std::uint32_t(b[1]) << 8 | std::uint32_t(b[2]) << 16 | std::uint32_t(b[3]) << 24); }

/// The code of the map value nearest x, of two as near the smaller magnitude: by brute force.
int nearest_code(codecs::dynamic_map const& m, float x)
{
  int best = 0;
  for (int c = 1; c < 256; ++c) {
    double const d = std::fabs(static_cast<double>(m.value[c]) - x), e = std::fabs(static_cast<double>(m.value[best]) - x);
    if (d < e || (d == e && std::fabs(m.value[c]) < std::fabs(m.value[best]))) { best = c; }
  }
  return best;
}

template <class C>
void check_every_midpoint()
{
  auto const& m = C::map();
  // Values that straddle every midpoint (and every map value), in blocks whose absmax is 1.
  std::vector<float> probes;
  for (int r = 0; r < m.rungs; ++r) {
    for (float const x : {m.midpoint[r], m.value[m.zero_code + r]}) {
      for (float const y : {std::nextafter(x, 0.0f), x, std::nextafter(x, 2.0f)}) {
        probes.push_back(y);
        if constexpr (C::is_signed) { probes.push_back(-y); }
      }
    }
  }
  for (float const y : {0.0f, -0.0f, 1e-30f, 1.0f, std::numeric_limits<float>::denorm_min()}) { probes.push_back(y); }
  std::size_t bad = 0, checked = 0;
  for (std::size_t b = 0; b < probes.size(); b += C::block - 1) {
    std::vector<float> v{1.0f};  // the absmax: the others are their own normalized values
    for (std::size_t i = b; i < std::min(probes.size(), b + C::block - 1); ++i) { v.push_back(probes[i]); }
    auto const s = encoded_scalar<C>(v), f = encoded_batches<C>(v);
    bad += s != f;
    for (std::size_t i = 0; i < v.size(); ++i) {
      bad += static_cast<int>(s[4 + i]) != nearest_code(m, v[i]);
      ++checked;
    }
  }
  INFO(C::name << ": " << checked << " values");
  CHECK(bad == 0);
}

}  // namespace

TEST_CASE("the maps are bitsandbytes' dynamic maps, as the Python reference makes them", "[dynamic8]")
{
  auto const& s = codecs::dynamic8::map();
  auto const& u = codecs::udynamic8::map();
  REQUIRE(golden_signed_map.size() == 256);
  REQUIRE(golden_unsigned_map.size() == 256);
  for (int c = 0; c < 256; ++c) {
    INFO("code " << c);
    CHECK(bits(s.value[c]) == bits(golden_signed_map[c]));
    CHECK(bits(u.value[c]) == bits(golden_unsigned_map[c]));
  }
  CHECK(s.value[127] == 0.0f);
  CHECK(s.value[255] == 1.0f);
  CHECK(u.value[0] == 0.0f);
  CHECK(u.value[255] == 1.0f);
  CHECK(codecs::dynamic8::block_bytes == 260);
  CHECK(codecs::dynamic8::name == "dynamic8_256");
  CHECK(codecs::udynamic8::name == "udynamic8_256");
}

TEST_CASE("blocks encode to the reference's codes on the codec's path and on the host's batches", "[dynamic8]")
{
  REQUIRE(golden_blocks.size() == 12);
  for (auto const& g : golden_blocks) {
    std::vector<float> v;
    for (std::size_t i = 0; i < g.n; ++i) {
      float const x = static_cast<float>(grad_value(i, 7) * g.factor);
      v.push_back(g.is_signed ? x : std::fabs(x));
    }
    INFO((g.is_signed ? "signed" : "unsigned") << " block of " << g.n << ", factor " << g.factor);
    auto const check = [&](std::vector<std::byte> const& b) {
      CHECK(bits(scale_of(b)) == bits(g.scale));
      std::size_t bad = 0;
      for (std::size_t i = 0; i < g.n; ++i) { bad += static_cast<int>(b[4 + i]) != g.codes[i]; }
      CHECK(bad == 0);
      std::vector<float> out(g.n);
      if (g.is_signed) {
        codecs::dynamic8::decode(b.data(), out.data(), g.n);
      } else {
        codecs::udynamic8::decode(b.data(), out.data(), g.n);
      }
      auto const& m = g.is_signed ? codecs::dynamic8::map() : codecs::udynamic8::map();
      for (std::size_t i = 0; i < g.n; ++i) { bad += bits(out[i]) != bits(m.value[g.codes[i]] * g.scale + 0.0f); }
      CHECK(bad == 0);
    };
    if (g.is_signed) {
      check(encoded_scalar<codecs::dynamic8>(v));
      check(encoded_batches<codecs::dynamic8>(v));
    } else {
      check(encoded_scalar<codecs::udynamic8>(v));
      check(encoded_batches<codecs::udynamic8>(v));
    }
  }
}

/// Floats in [0, 1.001]: every 509th, and 64 either side of every midpoint; in blocks under
/// the scale 1, the batches' codes (with AVX-512, the rungs by arithmetic and, near a
/// midpoint, the bucket table) against the codec's binary search. (Every float there was
/// checked once, 2026-12-04: none differs.)
template <class C>
void check_float_sweep()
{
  auto const& m = C::map();
  std::vector<float> probes;
  for (std::uint32_t u = 0; u <= std::bit_cast<std::uint32_t>(1.001f); u += 509) { probes.push_back(std::bit_cast<float>(u)); }
  for (int r = 0; r < m.rungs; ++r) {
    auto const mid = std::bit_cast<std::uint32_t>(m.midpoint[r]);
    for (std::uint32_t d = 0; d <= 128; ++d) { probes.push_back(std::bit_cast<float>(mid - 64 + d)); }
  }
  std::size_t bad = 0;
  for (std::size_t b = 0; b < probes.size(); b += C::block - 1) {
    std::vector<float> v{1.0f};
    for (std::size_t i = b; i < std::min(probes.size(), b + C::block - 1); ++i) {
      v.push_back(C::is_signed && i % 2 == 1 ? -probes[i] : probes[i]);
    }
    bad += encoded_scalar<C>(v) != encoded_batches<C>(v);
  }
  INFO(C::name << ": " << probes.size() << " values");
  CHECK(bad == 0);
}

TEST_CASE("the host's batches encode a sweep of floats in [0, 1] as the codec does", "[dynamic8]")
{
  check_float_sweep<codecs::dynamic8>();
  check_float_sweep<codecs::udynamic8>();
}

TEST_CASE("the host's batches encode every midpoint's neighbours as the codec does, to the nearest value", "[dynamic8]")
{
  check_every_midpoint<codecs::dynamic8>();
  check_every_midpoint<codecs::udynamic8>();
}

TEMPLATE_TEST_CASE("a block with a non-finite value decodes to NaN; zeros and fresh bytes to zeros", "[dynamic8]",
                   codecs::dynamic8, codecs::udynamic8)
{
  using C = TestType;
  for (float const bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    for (std::size_t const at : {std::size_t{0}, std::size_t{37}, std::size_t{200}}) {
      std::vector<float> v(201, 0.25f);
      v[at] = bad;
      auto const s = encoded_scalar<C>(v), f = encoded_batches<C>(v);
      CHECK(s == f);
      std::vector<float> out(v.size());
      C::decode(s.data(), out.data(), out.size());
      for (float const x : out) { CHECK(std::isnan(x)); }
    }
  }
  std::vector<float> zeros(256, 0.0f), out(256, 1.0f);
  auto const z = encoded_batches<C>(zeros);
  CHECK(z == encoded_scalar<C>(zeros));
  C::decode(z.data(), out.data(), 256);
  for (float const x : out) { CHECK(bits(x) == 0u); }
  std::vector<std::byte> fresh(C::block_bytes);
  C::decode(fresh.data(), out.data(), 256);
  for (float const x : out) { CHECK(bits(x) == 0u); }  // +0, not -0
  host::detail::decode_block<C, arch>(fresh.data(), out.data(), 256);
  for (float const x : out) { CHECK(bits(x) == 0u); }
  // A subnormal scale (a moment decaying for hundreds of steps): its reciprocal overflows, and
  // every path makes the zero code everywhere, whole batches and tails alike.
  for (std::size_t const n : {std::size_t{256}, std::size_t{37}}) {
    std::vector<float> tiny(n, 0.0f);
    tiny[1] = 1e-40f;
    tiny[2] = -0.0f;
    tiny[n - 1] = C::is_signed ? -5e-41f : 5e-41f;
    auto const s = encoded_scalar<C>(tiny);
    CHECK(s == encoded_batches<C>(tiny));
    for (std::size_t i = 0; i < n; ++i) { CHECK(static_cast<int>(s[4 + i]) == C::map().zero_code); }
  }
  // Scales far from 1 in both directions, through the reciprocal: both paths agree.
  for (float const scale : {3e-38f, 1e-20f, 7.5e30f}) {
    std::vector<float> v(256);
    for (std::size_t i = 0; i < v.size(); ++i) {
      auto const x = static_cast<float>(grad_value(i, 11)) * 4.0f * scale;
      v[i]         = C::is_signed ? x : std::fabs(x);
    }
    INFO("scale " << scale);
    CHECK(encoded_scalar<C>(v) == encoded_batches<C>(v));
  }
}

TEMPLATE_TEST_CASE("the host's batches decode every code at every position as the codec does", "[dynamic8]",
                   codecs::dynamic8, codecs::udynamic8)
{
  using C = TestType;
  // Code (i + r) mod 256 at position i, for each r: every code at every position of a whole
  // block (the byte-permute path where the host has AVX-512 VBMI) and of a short one (the
  // gathers and the scalar tail), under scales of both signs, zero, subnormal and NaN.
  std::vector<std::byte> block(C::block_bytes);
  std::vector<float> want(C::block), got(C::block);
  std::size_t bad = 0;
  for (float const scale : {1.0f, -2.5f, 0.0f, 3e-41f, 7.5e30f, std::numeric_limits<float>::quiet_NaN()}) {
    std::memcpy(block.data(), &scale, sizeof scale);
    for (std::size_t r = 0; r < 256; ++r) {
      for (std::size_t i = 0; i < C::block; ++i) { block[4 + i] = static_cast<std::byte>((i + r) & 255u); }
      for (std::size_t const n : {C::block, std::size_t{77}}) {
        C::decode(block.data(), want.data(), n);
        host::detail::decode_block<C, arch>(block.data(), got.data(), n);
        for (std::size_t i = 0; i < n; ++i) { bad += bits(got[i]) != bits(want[i]); }
      }
    }
  }
  CHECK(bad == 0);
}

TEMPLATE_TEST_CASE("a decoded block encodes to the same bytes, its largest magnitude exactly, of either sign", "[dynamic8]",
                   codecs::dynamic8, codecs::udynamic8)
{
  using C = TestType;
  for (std::size_t const n : {std::size_t{1}, std::size_t{19}, std::size_t{256}}) {
    for (double const sign : {1.0, -1.0}) {
      std::vector<float> v(n);
      for (std::size_t i = 0; i < n; ++i) {
        double const x = grad_value(i, 3) + (i == n / 2 ? 2.0 * sign : 0.0);  // the largest: element n / 2
        v[i]           = static_cast<float>(C::is_signed ? x : std::fabs(x));
      }
      INFO(n << " values, the largest of sign " << sign);
      auto const first = encoded_batches<C>(v);
      std::vector<float> decoded(n);
      C::decode(first.data(), decoded.data(), n);
      CHECK(decoded[n / 2] == v[n / 2]);
      CHECK(encoded_batches<C>(decoded) == first);
      CHECK(encoded_scalar<C>(decoded) == first);
    }
  }
}

namespace {

/// One golden run: each tensor its own update, its slots in 8-bit blocks.
template <class R, class P>
void run_golden(golden_run const& g, typename R::hyperparameters h, std::size_t threads)
{
  constexpr std::size_t S = R::slots.size();
  REQUIRE(g.slots.size() == S);
  thread_pool pool(threads);
  std::size_t base = 0, bad_params = 0, bad_slots = 0, checked = 0;
  double worst = 0.0;
  for (std::size_t const n : g.sizes) {
    std::vector<float> w(n), grad(n);
    for (std::size_t i = 0; i < n; ++i) { w[i] = init_value(base + i); }
    std::size_t const blocks = (n + 255) / 256;
    std::vector<std::vector<std::byte>> state(S, std::vector<std::byte>(blocks * 260));
    update_arrays<P, S> a;
    a.param = w.data();
    a.grad  = grad.data();
    for (std::size_t j = 0; j < S; ++j) { a.state[j] = state[j].data(); }
    for (int t = 1; t <= g.steps; ++t) {
      for (std::size_t i = 0; i < n; ++i) { grad[i] = grad_value(base + i, t); }
      h.lr = lr_at(g.lr_max, t, g.steps);
      host::update<R, P>(pool, R::coefficients_for(h, t), a, n);
    }
    for (std::size_t j = 0; j < S; ++j) {
      std::vector<float> got(n);
      for (std::size_t b = 0; b < blocks; ++b) {
        std::size_t const m = std::min<std::size_t>(256, n - b * 256);
        if (j == 1) {
          codecs::udynamic8::decode(state[j].data() + b * 260, got.data() + b * 256, m);
        } else {
          codecs::dynamic8::decode(state[j].data() + b * 260, got.data() + b * 256, m);
        }
      }
      for (std::size_t i = 0; i < n; ++i) {
        float const want = g.slots[j][base + i];
        // Within one step of the map at the larger of the two (a code may round the other way
        // where torch's float32 moment and ours differ in the last bit).
        auto const& map = j == 1 ? codecs::udynamic8::map() : codecs::dynamic8::map();
        float const block_absmax = [&] {
          float a2 = 0.0f;
          std::size_t const b0 = i / 256 * 256;
          for (std::size_t q = b0; q < std::min(n, b0 + 256); ++q) { a2 = std::max(a2, std::fabs(g.slots[j][base + q])); }
          return a2;
        }();
        int const c = nearest_code(map, block_absmax > 0.0f ? std::max(std::fabs(got[i]), std::fabs(want)) / block_absmax : 0.0f);
        float const step = block_absmax * (map.value[std::min(c + 1, 255)] - map.value[std::max(c - 1, 0)]);
        bad_slots += std::fabs(got[i] - want) > step * 1.01f;
        checked += bits(got[i]) == bits(want);
      }
    }
    for (std::size_t i = 0; i < n; ++i) {
      double const d = std::fabs(static_cast<double>(w[i]) - g.params[base + i]) / (std::fabs(g.params[base + i]) + g.lr_max);
      worst          = std::max(worst, d);
      bad_params += d > 1e-5;  // (measured: 8.3e-7 for AdamW, 0 for SGD and Lion)
    }
    base += n;
  }
  INFO(g.name << " with " << threads << " threads: worst relative param difference " << worst << ", "
              << checked << " moments bit-equal to the reference's");
  CHECK(bad_slots == 0);
  CHECK(bad_params == 0);
  // Most moments are the reference's bits: the codec is the same function (measured: all of
  // them; SGD's and Lion's params too, their rules rounding as torch does).
  CHECK(checked * 100 >= 99 * base * S);
  if (std::string_view(g.rule) != "adamw") { CHECK(worst == 0.0); }
}

}  // namespace

TEST_CASE("AdamW, SGD with momentum and Lion with 8-bit moments follow torch stepping on re-stored moments", "[dynamic8]")
{
  REQUIRE(golden_runs.size() == 4);
  using P8  = Precision<float, float, float, slot_codecs<codecs::dynamic8, codecs::udynamic8>>;
  using P8m = Precision<float, float, float, codecs::dynamic8>;
  for (auto const& g : golden_runs) {
    std::string_view const rule = g.rule;
    for (std::size_t const threads : {1u, 2u}) {
      if (rule == "adamw") {
        AdamW::hyperparameters h;
        h.betas        = {g.beta1, g.beta2};
        h.eps          = g.eps;
        h.weight_decay = g.weight_decay;
        run_golden<AdamW, P8>(g, h, threads);
      } else if (rule == "sgd") {
        run_golden<SGDMomentum, P8m>(g, hyperparameters_from_values<SGDMomentum>(std::vector<double>{g.lr_max, g.beta1, 0.0, g.weight_decay, 0, 0}), threads);
      } else {
        REQUIRE(rule == "lion");
        run_golden<Lion, P8m>(g, hyperparameters_from_values<Lion>(std::vector<double>{g.lr_max, g.beta1, g.beta2, g.weight_decay, 0}), threads);
      }
    }
  }
}

TEST_CASE("stochastic rounding: the host's batches round as the codec does, and round up with the probability of the distance", "[stochastic]")
{
  constexpr std::size_t N = host::batch_size<arch>;
  std::vector<float> w;
  for (float const x : {1.0f, -1.0f, 1.00390625f, 3.0e38f, -3.3895314e38f, 1e-40f, -1e-40f, 0.0f, -0.0f,
                        std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                        std::numeric_limits<float>::quiet_NaN(), std::bit_cast<float>(0x7F800001u), 0.1f, -7.3e-5f}) {
    w.push_back(x);
  }
  while (w.size() % N != 0) { w.push_back(static_cast<float>(w.size()) * 0.37f); }
  std::uint32_t const key = codecs::rounding_key(99, 7, 3);
  for (std::size_t const base : {std::size_t{0}, std::size_t{1} << 32, (std::size_t{1} << 32) - 5}) {
    std::vector<bf16> got(w.size());
    for (std::size_t i = 0; i < w.size(); i += N) {
      host::detail::store_stochastic<arch>(got.data() + i, xsimd::batch<float, arch>::load_unaligned(w.data() + i), key, base + i);
    }
    for (std::size_t i = 0; i < w.size(); ++i) {
      INFO("element " << base + i << ", value " << w[i]);
      CHECK(got[i].bits == codecs::round_stochastic_bf16(w[i], key, base + i));
    }
  }
  // 1 + 1/4 of a bf16 ulp rounds up a quarter of the time; infinities and NaN as nearest.
  std::size_t up = 0, trials = 1 << 16;
  float const x = std::bit_cast<float>(0x3F804000u);  // 1 + ulp/4 (the ulp is 2^-7)
  for (std::size_t i = 0; i < trials; ++i) { up += codecs::round_stochastic_bf16(x, key, i) == 0x3F81; }
  CHECK(std::fabs(static_cast<double>(up) / static_cast<double>(trials) - 0.25) < 0.01);
  CHECK(codecs::round_stochastic_bf16(std::numeric_limits<float>::infinity(), 0xFFFFFFFFu) == 0x7F80);
  CHECK((codecs::round_stochastic_bf16(std::numeric_limits<float>::quiet_NaN(), 0xFFFFFFFFu) & 0x7FC0) == 0x7FC0);
  CHECK(codecs::round_stochastic_bf16(1.0f, 0xFFFFFFFFu) == 0x3F80);  // exact values stay
}
