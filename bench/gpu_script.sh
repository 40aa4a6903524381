#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The GPU run, for a lent GPU machine (an H200: sm_90). Needs the bundle made beforehand by
# bench/gpu_prepare.sh (carried with the checkout); rebuilds a binary there with nvcc and
# the bundle's headers if it does not start. Runs the GPU tests, pinned_alloc (cudaHostAlloc
# against mmap'ed huge pages registered with cudaHostRegister), the example, the PyTorch
# parity test on the GPU (8-bit state included), then the gpu_step benchmark (1e9 elements in
# memory, 2.5e8 on NVMe under /tmp; fp32 and 8-bit state), each under a timeout, all within
# 10 minutes (a build of the PyTorch extension there included). Logs and JSON lines go to OUT
# (default gpu-out).
#
#   bash bench/gpu_script.sh [BUNDLE_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
B=${1:-gpu-bundle}
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
start=$(date +%s)
stamp() { echo "--- $(($(date +%s) - start))s: $*" | tee -a "$OUT/script.log"; }

stamp "machine"
{ nvidia-smi -L; nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv;
  nproc; free -g; df -h /tmp; uname -r; command -v nvcc && nvcc --version | tail -1; } >"$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

# A binary "starts" when it runs to its own exit code (0, 1, 2 or 77), not a loader error
# or an illegal instruction.
starts() {
  "$@" >/dev/null 2>&1
  local rc=$?
  [ $rc -eq 0 ] || [ $rc -eq 1 ] || [ $rc -eq 2 ] || [ $rc -eq 77 ]
}
if ! starts "$B/bin/test_pinned_host_cuda" || ! starts "$B/bin/test_device_cuda" --list-tests || ! starts "$B/bin/gpu_step_cuda" --steps 0 ||
   ! starts "$B/bin/gpu_compositions_cuda" --steps 0 || ! starts "$B/bin/pinned_alloc_cuda" --reps 1 --bytes 2097152; then
  stamp "a bundled binary does not start here: rebuilding with this machine's nvcc"
  bash bench/gpu_build.sh "$B" 2>&1 | tee "$OUT/rebuild.log"
fi

stamp "GPU tests"
timeout 30 "$B/bin/test_pinned_host_cuda" 2>&1 | tee "$OUT/test_pinned_host_cuda.log"
echo "rc ${PIPESTATUS[0]}" | tee -a "$OUT/test_pinned_host_cuda.log"
timeout 90 "$B/bin/test_device_cuda" 2>&1 | tail -40 | tee "$OUT/test_device_cuda.log"
echo "rc ${PIPESTATUS[0]}" | tee -a "$OUT/test_device_cuda.log"

stamp "pinned_alloc"
timeout 45 "$B/bin/pinned_alloc_cuda" 2>&1 | tee "$OUT/pinned_alloc.jsonl"
echo "rc ${PIPESTATUS[0]}" | tee -a "$OUT/script.log"

stamp "example"
timeout 30 "$B/bin/gpu_compositions_cuda" --elements 20000000 --steps 20 2>&1 | tee "$OUT/gpu_compositions.log"
echo "rc ${PIPESTATUS[0]}" | tee -a "$OUT/gpu_compositions.log"

stamp "PyTorch parity on the GPU"
# The bundle's prebuilt extension, or (if it does not import) a build here against the
# bundle's headers.
py=$(command -v python3 || command -v python)
ext="$B/lib/tierstate_torch_C_cuda.so"
if [ -f "$ext.xz" ] && [ ! -f "$ext" ]; then
  "$py" -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" "$ext.xz" "$ext"
fi
if ! TIERSTATE_TORCH_PREBUILT="$ext" "$py" -c "import sys; sys.path.insert(0, 'examples/pytorch')
from tierstate_torch._build import load_extension; load_extension()" >"$OUT/pytorch_import.log" 2>&1; then
  stamp "the prebuilt extension does not import here (pytorch_import.log): building it"
  ext=""
fi
TIERSTATE_TORCH_PREBUILT="$ext" TIERSTATE_TORCH_CUDA=1 TORCH_EXTENSIONS_DIR="$PWD/$OUT/torch-build" \
  TIERSTATE_TORCH_DEPS_CFLAGS="-isystem $PWD/$B/include" TIERSTATE_TORCH_LDFLAGS="$PWD/$B/lib/liburing.a" \
  TIERSTATE_TEST_DIR=/tmp timeout 200 "$py" tests/pytorch/test_parity_cuda.py 2>&1 | tee "$OUT/pytorch_parity_cuda.log"
echo "rc ${PIPESTATUS[0]}" | tee -a "$OUT/pytorch_parity_cuda.log"
rm -rf "$OUT/torch-build"

stamp "gpu_step"
timeout 180 "$B/bin/gpu_step_cuda" --steps 3 2>&1 | tee "$OUT/gpu_step.jsonl"
echo "rc ${PIPESTATUS[0]}" | tee -a "$OUT/script.log"
stamp "done"
