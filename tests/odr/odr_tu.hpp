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
odr_result odr_device_cpp();  ///< odr_device_tu.cpp with Thrust's CPP system
odr_result odr_device_omp();  ///< the same with its OMP system

}  // namespace tierstate::test
