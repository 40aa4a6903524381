#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds the GPU binaries into BUNDLE/bin with nvcc, from this checkout and BUNDLE's headers
# and liburing.a: sm_90, release (never -G), host code for x86-64-v3, nothing to install.
#
#   bash bench/gpu_build.sh BUNDLE [NVCC]
set -euo pipefail
cd "$(dirname "$0")/.."
B=$1
NVCC=${2:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
flags=(-O3 -std=c++20 -gencode arch=compute_90,code=sm_90 -DTIERSTATE_ENABLE_CUDA
  --expt-relaxed-constexpr -Xcompiler -march=x86-64-v3,-pthread -Iinclude -isystem "$B/include")
build() {  # NAME SOURCE [EXTRA...]
  local name=$1 source=$2
  shift 2
  echo "nvcc: $name"
  "$NVCC" "${flags[@]}" "$@" "$source" -o "$B/bin/$name" "$B/lib/liburing.a" &
}
build test_device_cuda tests/test_device_cuda.cu tests/catch_session.cpp -Itests
build gpu_compositions_cuda examples/gpu_compositions.cu
build gpu_step_cuda bench/gpu_step.cu
build test_pinned_host_cuda tests/test_pinned_host_cuda.cpp
build pinned_alloc_cuda bench/pinned_alloc.cu
# The NVMe demo (host code; its text given with --text there), for a traced step on that machine.
build char_mlp examples/char_mlp.cpp -DTIERSTATE_SOURCE_DIR=\".\"
# The planner, with the CUDA runtime: it measures PCIe there.
build tierstate-plan tools/tierstate_plan.cpp
fail=0
for job in $(jobs -p); do wait "$job" || fail=1; done
exit $fail
