// SPDX-License-Identifier: Apache-2.0
// A baseline translation unit and a native one linked into one program: each runs its own
// architecture's kernels, and both compute the same bits (fma is fused, and conversions
// round the same way, on every architecture).
#include "odr_tu.hpp"

#include <catch2/catch.hpp>

using namespace tierstate::test;

TEST_CASE("baseline and native kernels coexist in one program and agree bit for bit", "[odr]")
{
  odr_result const base   = odr_baseline();
  odr_result const native = odr_native();
  INFO("baseline runs " << base.arch << ", native runs " << native.arch);
  CHECK(base.arch == "sse2");
  CHECK(native.arch != "");
  REQUIRE(base.bits.size() == native.bits.size());
  std::size_t differ = 0;
  for (std::size_t i = 0; i < base.bits.size(); ++i) { differ += base.bits[i] != native.bits[i]; }
  CHECK(differ == 0);
}

#if defined(TIERSTATE_TEST_ODR_X86_LEVELS)
#include <cpuid.h>

namespace {

/// F16C and BMI2 from CPUID (clang 14's __builtin_cpu_supports knows neither).
bool cpu_has_f16c()
{
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid(1, &a, &b, &c, &d) != 0 && (c & bit_F16C) != 0;
}
bool cpu_has_bmi2()
{
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid_count(7, 0, &a, &b, &c, &d) != 0 && (b & bit_BMI2) != 0;
}

std::size_t differences(odr_result const& a, odr_result const& b)
{
  if (a.bits.size() != b.bits.size()) { return a.bits.size() + b.bits.size(); }
  std::size_t n = 0;
  for (std::size_t i = 0; i < a.bits.size(); ++i) { n += a.bits[i] != b.bits[i]; }
  return n;
}

}  // namespace

// The translation units that differ in one flag only (F16C; AVX-512 over x86-64-v3; VBMI) run
// where this CPU has what they were built for; check_symbols.py checks their objects on
// any CPU.
TEST_CASE("translation units that differ only in F16C, only in AVX-512 or only in VBMI each run their own code and agree",
          "[odr]")
{
  odr_result const base = odr_baseline();
  __builtin_cpu_init();
  bool const avx2_fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx2_fma) {
    odr_result const plain = odr_avx2_fma();
    CHECK(plain.arch.find("avx2") != std::string::npos);  // xsimd 8: "fma3+avx2"
    CHECK(differences(plain, base) == 0);
  }
  if (avx2_fma && cpu_has_f16c()) {
    odr_result const f16c = odr_avx2_fma_f16c();
    CHECK(f16c.arch.find("avx2") != std::string::npos);
    CHECK(differences(f16c, base) == 0);
  }
  if (avx2_fma && cpu_has_f16c() && cpu_has_bmi2()) {
    odr_result const v3 = odr_avx2();
    CHECK(differences(v3, base) == 0);
  }
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")) {
    odr_result const v4 = odr_avx512();
    CHECK(v4.arch.rfind("avx512", 0) == 0);
    CHECK(differences(v4, base) == 0);
    if (__builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512ifma")) {
      odr_result const vbmi = odr_avx512_vbmi();
      CHECK(differences(vbmi, base) == 0);
    } else {
      WARN("this CPU has no AVX-512 VBMI and IFMA: odr_avx512_vbmi is linked and its symbols checked, not run");
    }
  } else {
    WARN("this CPU has no AVX-512: odr_avx512 (x86-64-v4) is linked and its symbols checked, not run");
  }
}
#endif

#if defined(TIERSTATE_TEST_DEVICE_ODR)
TEST_CASE("device kernels of Thrust's CPP and OMP systems coexist in one program and agree", "[odr][device]")
{
  odr_result const cpp = odr_device_cpp();
  odr_result const omp = odr_device_omp();
  CHECK(cpp.arch == "cpp");
  CHECK(omp.arch == "omp");
  CHECK(cpp.bits == omp.bits);
}
#endif
