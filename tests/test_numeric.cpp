// SPDX-License-Identifier: Apache-2.0
// bf16 and fp16 conversions: round to nearest even, NaN and infinity kept, and the host
// kernels' batch conversions bit-identical to the scalar ones on every architecture this
// build has.
#include "support.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstring>
#include <limits>

using namespace tierstate;
using tierstate::detail::bits_of;
using tierstate::detail::float_of;

namespace {

/// Nearest-even rounding of x to a sorted table of the non-negative finite values of a
/// format, computed in double: an independent reference. `overflow` is the threshold from
/// which values round to infinity (the midpoint between the largest finite value and the
/// next power of the exponent range).
std::uint16_t round_by_table(float x, std::vector<std::pair<double, std::uint16_t>> const& table,
                             double overflow, std::uint16_t inf_bits)
{
  double const a     = std::abs(static_cast<double>(x));
  std::uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  if (a >= overflow) { return sign | inf_bits; }
  auto hi = std::lower_bound(table.begin(), table.end(), std::make_pair(a, std::uint16_t{0}));
  if (hi == table.end()) { return sign | table.back().second; }  // below the overflow threshold
  if (hi->first == a || hi == table.begin()) { return sign | hi->second; }
  auto lo           = hi - 1;
  double const dlo  = a - lo->first;
  double const dhi  = hi->first - a;
  if (dlo < dhi) { return sign | lo->second; }
  if (dhi < dlo) { return sign | hi->second; }
  return sign | ((lo->second & 1) == 0 ? lo->second : hi->second);
}

template <class T>
std::vector<std::pair<double, std::uint16_t>> finite_table()
{
  std::vector<std::pair<double, std::uint16_t>> t;
  for (std::uint32_t b = 0; b < 0x8000; ++b) {
    float const f = static_cast<float>(T::from_bits(static_cast<std::uint16_t>(b)));
    if (std::isfinite(f)) { t.emplace_back(f, static_cast<std::uint16_t>(b)); }
  }
  std::sort(t.begin(), t.end());
  return t;
}

/// Float bit patterns: a stride through all 2^32, plus the neighbourhoods of the formats'
/// rounding boundaries and specials.
std::vector<std::uint32_t> sample_floats()
{
  std::vector<std::uint32_t> s;
  for (std::uint64_t u = 0; u < (std::uint64_t{1} << 32); u += 4099) { s.push_back(static_cast<std::uint32_t>(u)); }
  for (std::uint32_t base : {0x3f800000u, 0x00000000u, 0x7f7f0000u, 0x7f800000u, 0x477fe000u,
                             0x38800000u, 0x33000000u, 0x387fc000u, 0x00008000u, 0x3f808000u}) {
    for (std::uint32_t d = 0; d < 0x20000; d += 3) {
      s.push_back(base + d);
      s.push_back((base - d) | 0x80000000u);
    }
  }
  return s;
}

}  // namespace

TEST_CASE("bf16 rounds to nearest even and keeps NaN and infinity", "[numeric]")
{
  auto const b = [](std::uint32_t u) { return bf16(float_of(u)).bits; };
  CHECK(b(0x3f800000u) == 0x3f80);  // 1
  CHECK(b(0x3f808000u) == 0x3f80);  // tie, even stays
  CHECK(b(0x3f818000u) == 0x3f82);  // tie, odd rounds up
  CHECK(b(0x3f808001u) == 0x3f81);
  CHECK(b(0x3f807fffu) == 0x3f80);
  CHECK(b(0x7f7fffffu) == 0x7f80);  // FLT_MAX rounds to infinity
  CHECK(b(0x7f800000u) == 0x7f80);
  CHECK(b(0xff800000u) == 0xff80);
  CHECK(b(0x00008000u) == 0x0000);  // subnormal tie to even zero
  CHECK(b(0x00018000u) == 0x0002);
  CHECK(b(0x80000000u) == 0x8000);  // -0
  for (std::uint32_t nan : {0x7f800001u, 0x7fc00000u, 0xff800001u, 0x7fffffffu, 0x7f80ffffu}) {
    INFO(std::hex << nan);
    std::uint16_t const r = b(nan);
    CHECK((r & 0x7f80) == 0x7f80);
    CHECK((r & 0x007f) != 0);  // still a NaN, never infinity
    CHECK((r & 0x8000) == ((nan >> 16) & 0x8000));
  }
  // Widening is exact.
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    CHECK(bits_of(static_cast<float>(bf16::from_bits(static_cast<std::uint16_t>(h)))) == h << 16);
  }
}

TEST_CASE("bf16 and fp16 match a table-based nearest-even reference", "[numeric]")
{
  auto const bf16_table = finite_table<bf16>();
  auto const fp16_table = finite_table<fp16>();
  // Overflow thresholds: halfway between the largest finite value and the next binade.
  double const bf16_overflow = (0x1.fep127 + 0x1p128) / 2;
  double const fp16_overflow = 65520.0;
  std::size_t bad_bf16 = 0, bad_fp16 = 0;
  for (std::uint32_t const u : sample_floats()) {
    float const x = float_of(u);
    if (std::isnan(x)) { continue; }
    if (bf16(x).bits != round_by_table(x, bf16_table, bf16_overflow, 0x7f80) && bad_bf16 < 5) { UNSCOPED_INFO(std::hex << u << " bf16 " << bf16(x).bits << " table " << round_by_table(x, bf16_table, bf16_overflow, 0x7f80)); }
    bad_bf16 += bf16(x).bits != round_by_table(x, bf16_table, bf16_overflow, 0x7f80);
    bad_fp16 += fp16(x).bits != round_by_table(x, fp16_table, fp16_overflow, 0x7c00);
  }
  CHECK(bad_bf16 == 0);
  CHECK(bad_fp16 == 0);
}

TEST_CASE("fp16 keeps NaN, infinity, subnormals and the sign", "[numeric]")
{
  auto const h = [](float x) { return fp16(x).bits; };
  CHECK(h(1.0f) == 0x3c00);
  CHECK(h(65504.0f) == 0x7bff);
  CHECK(h(65519.99f) == 0x7bff);
  CHECK(h(65520.0f) == 0x7c00);
  CHECK(h(std::numeric_limits<float>::infinity()) == 0x7c00);
  CHECK(h(-std::numeric_limits<float>::infinity()) == 0xfc00);
  CHECK(h(0x1p-24f) == 0x0001);
  CHECK(h(0x1p-25f) == 0x0000);          // tie to even zero
  CHECK(h(0x1.8p-24f) == 0x0002);        // tie to even two
  CHECK(h(0x1.ff8p-15f) == 0x03ff);      // 1023 units of 2^-24, exact
  CHECK(h(0x1.ffcp-15f) == 0x0400);      // 1023.5 units: tie, rounds up into the normals
  CHECK(h(-0.0f) == 0x8000);
  for (std::uint32_t nan : {0x7f800001u, 0x7fc00000u, 0xff800001u, 0x7fffffffu}) {
    std::uint16_t const r = h(float_of(nan));
    CHECK((r & 0x7c00) == 0x7c00);
    CHECK((r & 0x03ff) != 0);
  }
  for (std::uint32_t b = 0; b < 0x10000; ++b) {
    auto const x = fp16::from_bits(static_cast<std::uint16_t>(b));
    float const f = static_cast<float>(x);
    if (std::isnan(f)) {
      CHECK(((b & 0x7c00) == 0x7c00 && (b & 0x3ff) != 0));
    } else {
      CHECK(fp16(f).bits == b);  // round trip is exact
    }
  }
}

namespace {

template <class A>
void check_batch_conversions()
{
  using namespace tierstate::host::detail;
  constexpr std::size_t n = xsimd::batch<float, A>::size;
  INFO("arch " << A::name());

  // Every 16-bit pattern, widened.
  std::vector<std::uint16_t> all(0x10000);
  for (std::uint32_t i = 0; i < all.size(); ++i) { all[i] = static_cast<std::uint16_t>(i); }
  std::size_t bad = 0;
  for (std::size_t i = 0; i < all.size(); i += n) {
    alignas(64) float out_b[n], out_h[n];
    load_as_float<A>(reinterpret_cast<bf16 const*>(all.data() + i)).store_unaligned(out_b);
    load_as_float<A>(reinterpret_cast<fp16 const*>(all.data() + i)).store_unaligned(out_h);
    for (std::size_t j = 0; j < n; ++j) {
      auto const h = all[i + j];
      bad += bits_of(out_b[j]) != bits_of(static_cast<float>(bf16::from_bits(h)));
      bad += bits_of(out_h[j]) != bits_of(static_cast<float>(fp16::from_bits(h)));
    }
  }
  CHECK(bad == 0);

  // Narrowing, on the sampled float patterns (NaN included).
  auto const samples = sample_floats();
  bad = 0;
  for (std::size_t i = 0; i + n <= samples.size(); i += n) {
    alignas(64) float in[n];
    for (std::size_t j = 0; j < n; ++j) { in[j] = float_of(samples[i + j]); }
    auto const x = xsimd::batch<float, A>::load_unaligned(in);
    bf16 ob[n];
    fp16 oh[n];
    store_rounded<A>(ob, x);
    store_rounded<A>(oh, x);
    for (std::size_t j = 0; j < n; ++j) {
      bad += ob[j].bits != bf16(in[j]).bits;
      bad += oh[j].bits != fp16(in[j]).bits;
    }
  }
  CHECK(bad == 0);
}

template <class A>
void check_batch_math()
{
  using V = xsimd::batch<float, A>;
  constexpr std::size_t n = V::size;
  INFO("arch " << A::name());
  std::size_t bad = 0;
  for (std::uint64_t k = 0; k < 200000; k += n) {
    alignas(64) float a[n], b[n], c[n], r[n], mx[n];
    for (std::size_t j = 0; j < n; ++j) {
      // Products that need the fused rounding: a*b close to -c.
      a[j] = 1.0f + test::unit(k + j, 1) * 0x1p-12f;
      b[j] = 1.0f + test::unit(k + j, 2) * 0x1p-12f;
      c[j] = -(a[j] * b[j]) + test::unit(k + j, 3) * 0x1p-30f;
    }
    math::fma(V::load_unaligned(a), V::load_unaligned(b), V::load_unaligned(c)).store_unaligned(r);
    math::maximum(V::load_unaligned(a), V::load_unaligned(b)).store_unaligned(mx);
    for (std::size_t j = 0; j < n; ++j) {
      bad += bits_of(r[j]) != bits_of(std::fma(a[j], b[j], c[j]));
      bad += bits_of(mx[j]) != bits_of(math::maximum(a[j], b[j]));
    }
  }
  CHECK(bad == 0);
  float const nan = std::numeric_limits<float>::quiet_NaN();
  alignas(64) float a[n], b[n], r[n];
  for (std::size_t j = 0; j < n; ++j) {
    a[j] = j % 2 ? nan : 1.0f;
    b[j] = j % 2 ? 1.0f : nan;
  }
  math::maximum(V::load_unaligned(a), V::load_unaligned(b)).store_unaligned(r);
  for (std::size_t j = 0; j < n; ++j) { CHECK(std::isnan(r[j])); }
}

}  // namespace

TEST_CASE("batch conversions and math are bit-identical to the scalar ones", "[numeric][simd]")
{
  check_batch_conversions<xsimd::default_arch>();
  check_batch_math<xsimd::default_arch>();
#if XSIMD_WITH_SSE2
  // The four-lane SSE2 path, which has no FMA instruction, in every x86-64 build.
  check_batch_conversions<xsimd::sse2>();
  check_batch_math<xsimd::sse2>();
#endif
}

TEST_CASE("convert and type names", "[numeric]")
{
  STATIC_REQUIRE(type_name_v<float> == "fp32");
  STATIC_REQUIRE(type_name_v<bf16> == "bf16");
  STATIC_REQUIRE(type_name_v<fp16> == "fp16");
  STATIC_REQUIRE(convert<bf16>(1.0f).bits == 0x3f80);
  STATIC_REQUIRE(convert<float>(fp16::from_bits(0x3c00)) == 1.0f);
  STATIC_REQUIRE(convert<fp16>(bf16::from_bits(0x3f80)).bits == 0x3c00);
  CHECK(Bf16Mixed::name() == "bf16/bf16/fp32/fp32");
  CHECK(Bf16MixedBf16State::name() == "bf16/bf16/fp32/bf16");
  CHECK(Fp32::name() == "fp32/fp32/fp32/fp32");
  STATIC_REQUIRE(!Fp32::has_master);
  STATIC_REQUIRE(Fp16Mixed::has_master);
}
