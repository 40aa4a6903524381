#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Prepares, on a machine with the CUDA toolkit and tierstate's dependencies, the bundle that
# bench/gpu_script.sh runs on a lent GPU machine (which has nvcc but no package registry and
# none of xsimd, Catch2 or liburing):
#
#   gpu-bundle/bin/      test_device_cuda, gpu_compositions_cuda, gpu_step_cuda: nvcc,
#                        sm_90, host code for x86-64-v3, liburing linked statically
#   gpu-bundle/include/  the headers they need (xsimd, Catch2, liburing, xxHash), so that
#   gpu-bundle/lib/      the script can rebuild there (with liburing.a) if a binary does not start;
#                        and tierstate_torch_C_cuda.so.xz, the PyTorch extension's CUDA build (sm_90,
#                        x86-64-v3), when PyTorch 2.11.0 is here (TORCH_PYTHON, default the
#                        pytorch test stage's environment)
#
#   bash bench/gpu_prepare.sh [BUNDLE_DIR]     (default gpu-bundle; then carry it)
set -euo pipefail
cd "$(dirname "$0")/.."
B=${1:-gpu-bundle}
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
rm -rf "$B" && mkdir -p "$B/bin" "$B/include" "$B/lib"
cp -r /usr/include/xsimd /usr/include/catch2 /usr/include/liburing /usr/include/liburing.h \
  /usr/include/xxhash.h "$B/include/"
cp /usr/lib/x86_64-linux-gnu/liburing.a "$B/lib/"
bash bench/gpu_build.sh "$B" "$NVCC"
PY=${TORCH_PYTHON:-$HOME/.cache/tierstate/torch-2.11.0/bin/python}
if "$PY" -c "import torch" 2>/dev/null; then
  TORCH_EXTENSIONS_DIR="$PWD/$B/torch-build" TIERSTATE_TORCH_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0 \
    TIERSTATE_TORCH_CFLAGS="-O3 -march=x86-64-v3" TIERSTATE_TORCH_LDFLAGS="$PWD/$B/lib/liburing.a" \
    "$PY" -c "import sys; sys.path.insert(0, 'examples/pytorch')
from tierstate_torch._build import load_extension
load_extension()"
  # Stripped and xz-compressed (about 10x), so that the bundle fits what a device run carries
  # (64 MiB with the checkout); gpu_script.sh unpacks it with Python's lzma.
  strip --strip-unneeded -o "$B/lib/tierstate_torch_C_cuda.so" "$B/torch-build/tierstate_torch_C_cuda/tierstate_torch_C_cuda.so"
  xz -T0 -6 -f "$B/lib/tierstate_torch_C_cuda.so"
  rm -rf "$B/torch-build"
else
  echo "no PyTorch at $PY: the bundle has no PyTorch extension (gpu_script.sh then builds it there)"
fi
strip --strip-unneeded "$B"/bin/*
ls -la "$B/bin" "$B/lib"
du -sh "$B"
size=$(du -sm "$B" | cut -f1)
[ "$size" -lt 60 ] || { echo "gpu_prepare: the bundle is $size MiB: over what a device run carries (64 MiB with the checkout)"; exit 1; }
