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

}  // namespace tierstate::test
