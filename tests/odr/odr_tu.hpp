// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tierstate::test {

struct odr_result {
  std::string arch;
  std::vector<std::uint32_t> bits;
};

odr_result odr_baseline();
odr_result odr_native();
odr_result odr_avx2_fma();       ///< -mavx2 -mfma
odr_result odr_avx2_fma_f16c();  ///< the same with -mf16c: only F16C differs
odr_result odr_avx2();           ///< -march=x86-64-v3 (AVX2, FMA, F16C, BMI2)
odr_result odr_avx512();         ///< -march=x86-64-v4: x86-64-v3 and AVX-512
odr_result odr_avx512_vbmi();    ///< the same with -mavx512vbmi -mavx512ifma
odr_result odr_device_cpp();  ///< odr_device_tu.cpp with Thrust's CPP system
odr_result odr_device_omp();  ///< the same with its OMP system

}  // namespace tierstate::test
