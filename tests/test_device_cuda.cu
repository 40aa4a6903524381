// SPDX-License-Identifier: Apache-2.0
// test_device.cpp on the GPU: built by nvcc with TIERSTATE_ENABLE_CUDA and Thrust's CUDA
// system. Without a CUDA device it exits 77 (Meson's SKIP) and says why.
#include <catch2/catch.hpp>

#include "catch_session.hpp"

#include "test_device.cpp"

#include <cstdio>

int main(int argc, char** argv)
{
  if (tierstate::device::count() == 0) {
    std::printf("SKIP: %s\n", tierstate::device::describe().c_str());
    return 77;
  }
  std::printf("device: %s\n", tierstate::device::describe().c_str());
  return tierstate::test::run_catch(argc, argv);
}
