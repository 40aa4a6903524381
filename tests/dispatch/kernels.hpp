// SPDX-License-Identifier: Apache-2.0
// The kernels test_dispatch's optimizers use: one list, shared by the test (built for plain
// x86-64) and its kernel units (unit.cpp, built once per level).
#pragma once

#include <tierstate/kernels/host/dispatch.hpp>
#include <tierstate/tierstate.hpp>

namespace dispatch_test {

using namespace tierstate;
using EightBit = Precision<bf16, bf16, Compensated, slot_codecs<codecs::dynamic8, codecs::udynamic8>>;
using LionSr   = Precision<bf16, bf16, StochasticRounding, bf16>;

using kernels = host_kernels<host_kernel<AdamW, Fp32>, host_kernel<AdamW, Bf16Mixed>, host_kernel<AdamW, EightBit>,
                             host_kernel<Lion, LionSr>, host_kernel<SGDMomentum, Fp16Mixed>,
                             host_kernel<Adafactor, Fp32>>;

}  // namespace dispatch_test
