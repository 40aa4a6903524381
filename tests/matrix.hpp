// SPDX-License-Identifier: Apache-2.0
// The composition matrix: the type lists the composition tests run over, declared once.
//
// Each list is a std::tuple for Catch2's TEMPLATE_LIST_TEST_CASE. The full matrix is the
// default; -Dtest_matrix=reduced (TIERSTATE_TEST_MATRIX_REDUCED=1) keeps one or two entries
// per list, chosen so that every code path of the full list is still reached once: the
// mixed-precision path (a master beside bf16 params) covers the fp32 one's loads and
// stores, and one pipelined NvmeFile composition covers the synchronous one's I/O.
// tests/run-all.sh uses the reduced matrix in every build but gcc-native's, which runs the
// full one: the others are there for another compiler, -march or sanitizer, not for more
// compositions.
//
// The device compositions need Thrust: they are in device_matrix.hpp.
#pragma once

#include <tierstate/tierstate.hpp>

#include <tuple>
#include <type_traits>
#include <utility>

#ifndef TIERSTATE_TEST_MATRIX_REDUCED
#define TIERSTATE_TEST_MATRIX_REDUCED 0
#endif

namespace tierstate::test::matrix {

inline constexpr bool reduced = TIERSTATE_TEST_MATRIX_REDUCED != 0;

/// `Full`, or `Reduced` under the reduced matrix.
template <class Full, class Reduced>
using pick = std::conditional_t<reduced, Reduced, Full>;

/// The name of the matrix this build runs, for a test's INFO lines.
inline constexpr char const* name = reduced ? "reduced" : "full";

// --- the host compositions, by name -----------------------------------------------------

/// CPU training, state in RAM.
template <class P, class Rule = AdamW>
using HostSync = OffloadedOptimizer<Rule, P, PinnedHost, Synchronous>;
/// CPU training, state on NVMe, read and written in the step's own thread.
template <class P, class Rule = AdamW>
using NvmeSync = OffloadedOptimizer<Rule, P, NvmeFile, Synchronous>;
/// CPU training, state on NVMe, read ahead and written behind.
template <class P, unsigned Depth = 2, class Rule = AdamW>
using NvmePipelined = OffloadedOptimizer<Rule, P, NvmeFile, Pipelined<Depth>>;

// --- the axes ---------------------------------------------------------------------------

/// The precisions the host compositions run with (checkpoints, streaming, NvmeFile).
using precisions = pick<std::tuple<Fp32, Bf16Mixed>, std::tuple<Bf16Mixed>>;

/// The precisions of the device compositions' 50-step comparison: fp32 state, a master
/// beside bf16 params, and bf16 moments (reduced: the last, which takes every conversion
/// the other two take, and the state's to and from bf16).
using state_precisions = pick<std::tuple<Fp32, Bf16Mixed, Bf16MixedBf16State>, std::tuple<Bf16MixedBf16State>>;

/// The precisions of the kernel-level comparisons (the device kernel against the host's):
/// every named precision, bf16 params as their own master, and fp16 params with bf16 state.
using kernel_precisions =
  pick<std::tuple<Fp32, Bf16Mixed, Fp16Mixed, Bf16MixedBf16State, Precision<bf16, float>,
                  Precision<fp16, float, float, bf16>>,
       std::tuple<Bf16Mixed, Precision<fp16, float, float, bf16>>>;

/// (rule, precision) pairs of the optimizer-against-the-bare-kernel test.
using rules_x_precisions =
  pick<std::tuple<std::pair<AdamW, Bf16Mixed>, std::pair<Adam, Fp32>, std::pair<AdamWAmsgrad, Fp16Mixed>,
                  std::pair<AdamW, Bf16MixedBf16State>, std::pair<SGDMomentum, Bf16Mixed>, std::pair<Lion, Fp32>,
                  std::pair<Lion, Bf16MixedBf16State>, std::pair<SGD, Fp32>, std::pair<SGD, Bf16Mixed>>,
       std::tuple<std::pair<AdamW, Bf16Mixed>, std::pair<AdamWAmsgrad, Fp16Mixed>, std::pair<SGDMomentum, Fp32>,
                  std::pair<Lion, Bf16Mixed>, std::pair<SGD, Bf16Mixed>>>;

/// Whole host compositions (the refusal twins, the two-thread race).
using host_compositions =
  pick<std::tuple<HostSync<Bf16Mixed>, HostSync<Fp32>, NvmeSync<Bf16Mixed>, NvmePipelined<Bf16Mixed>>,
       std::tuple<HostSync<Bf16Mixed>, NvmePipelined<Bf16Mixed>>>;

/// The host compositions two threads race on (bf16 params, as the race's model has).
using race_compositions = pick<std::tuple<HostSync<Bf16Mixed>, NvmeSync<Bf16Mixed>, NvmePipelined<Bf16Mixed>>,
                               std::tuple<HostSync<Bf16Mixed>, NvmePipelined<Bf16Mixed>>>;

/// The transfers of the host routes.
using host_transfers = std::tuple<Synchronous, Pipelined<2>>;

}  // namespace tierstate::test::matrix
