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
