#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The GPU run, for a lent GPU machine (an H200: sm_90, 16 cores, Python 3.12 with PyTorch), in
# two parts, each one device run of under 10 minutes:
#
#   bash bench/gpu_script.sh [BUNDLE_DIR]         the GPU tests, pinned_alloc (cudaHostAlloc
#       against mmap'ed huge pages registered with cudaHostRegister), the example, and the
#       gpu_step benchmark (1e9 elements in memory, 1e8 on NVMe under /tmp; fp32 and 8-bit
#       state), the NVMe demo's traced step (trace_char_mlp.json in OUT), the example's traced
#       device steps (trace_1.json ... trace_5.json in OUT), and tierstate-plan with PCIe
#       measured: about 3 minutes;
#   bash bench/gpu_script.sh [BUNDLE_DIR] torch   the PyTorch parity test on the GPU (8-bit
#       state included), the extension built there unless the bundle has one for that
#       Python. On 2026-12-04 the build alone took more than 330 s on 16 cores, so this part
#       has a run of its own: 560 s for the build and the test together.
#
# Needs the bundle made beforehand by bench/gpu_prepare.sh (carried with the checkout);
# rebuilds the binaries there with nvcc and the bundle's headers if one does not start.
#
# What it finds goes to stdout and to two files in OUT (default gpu-out): script.log (every
# log, each under a "---" stamp) and results.jsonl (the benchmarks' JSON lines). Two files,
# because a device run brings back only a few; and run it without a pipe to `tail`, which
# would print nothing if the run is cut off.
set -uo pipefail
cd "$(dirname "$0")/.."
B=${1:-gpu-bundle}
PART=${2:-native}
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
LOG="$OUT/script.log"
JSON="$OUT/results.jsonl"
: >"$LOG"
: >"$JSON"
start=$(date +%s)
stamp() { echo "--- $(($(date +%s) - start))s: $*" | tee -a "$LOG"; }
# Runs "$@" under a timeout of $1 seconds, its output to stdout and the log, then its exit code.
logged() {
  local limit=$1
  shift
  timeout "$limit" "$@" 2>&1 | tee -a "$LOG"
  echo "rc ${PIPESTATUS[0]}" | tee -a "$LOG"
}

stamp "machine"
{ nvidia-smi -L; nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv;
  nproc; free -g; df -h /tmp; uname -r; command -v nvcc && nvcc --version | tail -1; python3 --version; } 2>&1 | tee -a "$LOG"

if [ "$PART" = native ]; then
# A binary "starts" when it runs to an exit code of its own (Catch2's --list-tests returns the
# number of tests), not a loader's 126 or 127, nor a signal such as an illegal instruction.
starts() {
  "$@" >/dev/null 2>&1
  [ $? -lt 126 ]
}
if ! starts "$B/bin/test_pinned_host_cuda" || ! starts "$B/bin/test_device_cuda" --list-tests || ! starts "$B/bin/gpu_step_cuda" --steps 0 ||
   ! starts "$B/bin/gpu_compositions_cuda" --steps 0 || ! starts "$B/bin/pinned_alloc_cuda" --reps 1 --bytes 2097152 ||
   ! starts "$B/bin/char_mlp" --help || ! starts "$B/bin/tierstate-plan" --help; then
  stamp "a bundled binary does not start here: rebuilding with this machine's nvcc"
  bash bench/gpu_build.sh "$B" 2>&1 | tee -a "$LOG"
fi

stamp "GPU tests"
logged 30 "$B/bin/test_pinned_host_cuda"
logged 90 "$B/bin/test_device_cuda"

stamp "nccl: ranks::sharded over NCCL, one rank (NCCL refuses two ranks on one GPU)"
# Built here: libnccl (about 200 MB) is not carried. The toolkit's, else PyTorch's (nvidia-nccl).
nccl_dir=""
for d in /usr/local/cuda /usr/local/cuda-*; do [ -f "$d/include/nccl.h" ] && nccl_dir=$d && break; done
if [ -z "$nccl_dir" ]; then
  nccl_dir=$(python3 -c "import nvidia.nccl as n; print(list(n.__path__)[0])" 2>/dev/null || true)
fi
nccl_lib=$(ls "$nccl_dir"/lib*/libnccl.so* 2>/dev/null | head -1)
if [ -n "$nccl_dir" ] && [ -n "$nccl_lib" ]; then
  nvcc -O2 -std=c++20 -DTIERSTATE_ENABLE_CUDA -Xcompiler -march=x86-64-v3,-pthread -Iinclude -isystem "$B/include" \
    -isystem "$nccl_dir/include" tests/test_nccl.cpp -o "$B/bin/test_nccl" "$nccl_lib" "$B/lib/liburing.a" \
    -Xlinker -rpath="$(dirname "$nccl_lib")" 2>&1 | tail -20 | tee -a "$LOG"
  logged 60 "$B/bin/test_nccl"
else
  echo "no NCCL here (nccl.h and libnccl under a CUDA toolkit or PyTorch's nvidia.nccl): not run" | tee -a "$LOG"
fi

stamp "pinned_alloc"
timeout 45 "$B/bin/pinned_alloc_cuda" 2>&1 | tee -a "$JSON"
echo "rc ${PIPESTATUS[0]}" | tee -a "$LOG"

stamp "example"
# 100 steps (its default), by which the loss must fall to a tenth, or it fails.
# Each composition's last step traced (issue 24: the device routes' streams), into OUT.
logged 60 "$B/bin/gpu_compositions_cuda" --elements 4000000 --trace "$OUT"

stamp "tierstate-plan with PCIe measured on this GPU (issue 24), and its check against measured steps"
logged 60 "$B/bin/tierstate-plan" --params 7B --nvme /tmp
timeout 60 "$B/bin/tierstate-plan" --params 7B --nvme /tmp --json 2>&1 | tee -a "$JSON"
timeout 90 "$B/bin/tierstate-plan" --check /tmp 2>&1 | tee -a "$JSON"

stamp "trace: the NVMe demo's last step on this machine's cores and disk (issue 24)"
logged 120 "$B/bin/char_mlp" --text README.md --steps 120 --path /tmp --trace "$OUT/trace_char_mlp.json"
python3 -c "import json, sys; d = json.load(open(sys.argv[1])); print(json.dumps({'bench': 'trace', 'events': sum(e['ph'] == 'X' for e in d['traceEvents']), 'dropped': d['otherData']['dropped_events']}))" \
  "$OUT/trace_char_mlp.json" 2>&1 | tee -a "$JSON"

stamp "gpu_step"
timeout 150 "$B/bin/gpu_step_cuda" --steps 3 --nvme-elements 100000000 2>&1 | tee -a "$JSON"
echo "rc ${PIPESTATUS[0]}" | tee -a "$LOG"

fi

if [ "$PART" = torch ]; then
stamp "PyTorch parity on the GPU"
# The bundle's prebuilt extension where it imports here (it must be built for this Python),
# else a build here against the bundle's headers.
py=$(command -v python3 || command -v python)
ext="$B/lib/tierstate_torch_C_cuda.so"
if [ -f "$ext.xz" ] && [ ! -f "$ext" ]; then
  "$py" -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" "$ext.xz" "$ext"
fi
if [ ! -f "$ext" ] || ! TIERSTATE_TORCH_PREBUILT="$ext" "$py" -c "import sys; sys.path.insert(0, 'examples/pytorch')
from tierstate_torch._build import load_extension; load_extension()" >>"$LOG" 2>&1; then
  stamp "no prebuilt extension imports here: building it (MAX_JOBS=$(nproc))"
  ext=""
fi
TIERSTATE_TORCH_PREBUILT="$ext" TIERSTATE_TORCH_CUDA=1 TORCH_EXTENSIONS_DIR="$PWD/$OUT/torch-build" MAX_JOBS=$(nproc) \
  TIERSTATE_TORCH_DEPS_CFLAGS="-isystem $PWD/$B/include" TIERSTATE_TORCH_LDFLAGS="$PWD/$B/lib/liburing.a" \
  TIERSTATE_TEST_DIR=/tmp logged 560 "$py" tests/pytorch/test_parity_cuda.py
# Each unit's compile time (ninja's log: start and end in ms), for sizing the next run.
cat "$OUT"/torch-build/*/.ninja_log 2>/dev/null | tee -a "$LOG"
rm -rf "$OUT/torch-build"
fi
stamp "done"
