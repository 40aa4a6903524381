// SPDX-License-Identifier: Apache-2.0
// The compositions most test files share, compiled once per build.
//
// Each is declared `extern` here, so a test file that uses one does not generate its code,
// and is instantiated (all its members) in one of tests/compositions_*.cpp, the
// `compositions` library every test links. Each took about 8 s of -O3 code generation in
// each file that used it, in up to ten files per build (measured: `nm` over a native build's
// test objects). The reduced matrix (tests/matrix.hpp) uses two of them; the others are
// declared only in full-matrix builds, so a reduced build compiles nothing it does not use.
//
// An `extern template` declaration must match the definition's flags: the library is
// compiled in the same build, with the same flags, as the tests (tests/meson.build). nvcc's
// translation units (test_device_cuda.cu includes test_device.cpp) declare nothing: their
// compositions live in another ABI namespace (core/config.hpp), which the library lacks.
#pragma once

#include "matrix.hpp"

#ifndef TIERSTATE_TEST_COMPILE_HOST
#define TIERSTATE_TEST_COMPILE_HOST extern
#endif
#ifndef TIERSTATE_TEST_COMPILE_NVME
#define TIERSTATE_TEST_COMPILE_NVME extern
#endif

#if !defined(__CUDACC__)
// (Explicit instantiations name the class template itself: an alias such as
// matrix::HostSync cannot be instantiated explicitly.)
TIERSTATE_TEST_COMPILE_HOST template class tierstate::OffloadedOptimizer<tierstate::AdamW, tierstate::Bf16Mixed,
                                                                         tierstate::PinnedHost, tierstate::Synchronous>;
TIERSTATE_TEST_COMPILE_NVME template class tierstate::OffloadedOptimizer<tierstate::AdamW, tierstate::Bf16Mixed,
                                                                         tierstate::NvmeFile, tierstate::Pipelined<2>>;
#if !TIERSTATE_TEST_MATRIX_REDUCED
TIERSTATE_TEST_COMPILE_HOST template class tierstate::OffloadedOptimizer<tierstate::AdamW, tierstate::Fp32,
                                                                         tierstate::PinnedHost, tierstate::Synchronous>;
TIERSTATE_TEST_COMPILE_NVME template class tierstate::OffloadedOptimizer<tierstate::AdamW, tierstate::Fp32,
                                                                         tierstate::NvmeFile, tierstate::Pipelined<2>>;
TIERSTATE_TEST_COMPILE_NVME template class tierstate::OffloadedOptimizer<tierstate::AdamW, tierstate::Bf16Mixed,
                                                                         tierstate::NvmeFile, tierstate::Synchronous>;
#endif
#endif
