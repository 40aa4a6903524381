#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Prepares, on a machine with the CUDA toolkit and tierstate's dependencies, the bundle that
# bench/gpu_script.sh runs on a lent GPU machine (which has nvcc but no package registry and
# none of xsimd, Catch2 or liburing):
#
#   gpu-bundle/bin/      test_device_cuda, test_pinned_host_cuda, gpu_compositions_cuda, gpu_step_cuda,
#                        pinned_alloc_cuda, char_mlp, tierstate-plan: nvcc,
#                        sm_90, host code for x86-64-v3, liburing linked statically
#   gpu-bundle/include/  the headers they need (xsimd, Catch2, liburing, xxHash), so that
#   gpu-bundle/lib/      the script can rebuild there (with liburing.a) if a binary does not start;
#                        and, with GPU_TORCH_PREBUILD=1, tierstate_torch_C_cuda.so.xz, the PyTorch
#                        extension's CUDA build (sm_90, x86-64-v3) for TORCH_PYTHON (default the
#                        pytorch test stage's environment). Off by default: it takes about 23
#                        minutes on 2 cores, and an extension imports only into the Python it was
#                        built for (here 3.11; the lent machine ran 3.12 on 2026-12-04, and
#                        gpu_script.sh builds it there in about 3 minutes on 16 cores)
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
if [ "${GPU_TORCH_PREBUILD:-0}" = 1 ] && "$PY" -c "import torch" 2>/dev/null; then
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
  echo "no prebuilt PyTorch extension (GPU_TORCH_PREBUILD=1 and PyTorch at $PY make one): gpu_script.sh builds it there"
fi
ls -la "$B/bin" "$B/lib"
du -sh "$B"
size=$(du -sm "$B" | cut -f1)
[ "$size" -lt 60 ] || { echo "gpu_prepare: the bundle is $size MiB: over what a device run carries (64 MiB with the checkout)"; exit 1; }
