// SPDX-License-Identifier: Apache-2.0
// tierstate: offloaded optimizer state for training, as a C++20 header-only library.
// The umbrella header: everything public that needs no more than a C++20 compiler (and,
// with TIERSTATE_ENABLE_CUDA, the CUDA runtime). The device kernels, and the OnDevice
// compute that runs them, need Thrust: include <tierstate/kernels/device/on_device.hpp>. Across
// ranks, include <tierstate/ranks/sharded.hpp> and a communicator's header (ranks/mpi.hpp,
// ranks/nccl.hpp): they are left out here, as a trainer on one process need not compile them.
#pragma once

#include <tierstate/core/config.hpp>  // first: it stops a compiler that is not in C++20 mode

#include <tierstate/checkpoint/format.hpp>
#include <tierstate/codecs/codec.hpp>
#include <tierstate/codecs/dynamic8.hpp>
#include <tierstate/core/concepts.hpp>
#include <tierstate/core/config.hpp>
#include <tierstate/core/device_runtime.hpp>
#include <tierstate/core/error.hpp>
#include <tierstate/core/layout.hpp>
#include <tierstate/core/math.hpp>
#include <tierstate/core/notice.hpp>
#include <tierstate/core/numeric.hpp>
#include <tierstate/core/precision.hpp>
#include <tierstate/core/stats.hpp>
#include <tierstate/core/tensor.hpp>
#include <tierstate/core/thread_pool.hpp>
#include <tierstate/io/engine.hpp>
#include <tierstate/io/error.hpp>
#include <tierstate/io/fault.hpp>
#include <tierstate/kernels/host/finite.hpp>
#include <tierstate/kernels/host/on_host.hpp>
#include <tierstate/kernels/host/update.hpp>
#include <tierstate/optimizer.hpp>
#include <tierstate/ranks/partition.hpp>
#include <tierstate/rules/adafactor.hpp>
#include <tierstate/rules/adam.hpp>
#include <tierstate/rules/lion.hpp>
#include <tierstate/rules/rule.hpp>
#include <tierstate/rules/sgd.hpp>
#include <tierstate/state/offloaded_params.hpp>
#include <tierstate/tiers/device.hpp>
#include <tierstate/tiers/nvme_file.hpp>
#include <tierstate/tiers/pinned_host.hpp>
#include <tierstate/tiers/tier.hpp>
#include <tierstate/transfer/concept.hpp>
#include <tierstate/transfer/cuda_overlapped.hpp>
#include <tierstate/transfer/pipelined.hpp>
#include <tierstate/transfer/routes/route.hpp>
#include <tierstate/transfer/synchronous.hpp>
