#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Prepares, on a machine with the CUDA toolkit and tierstate's dependencies, the bundle that
# bench/gpu_script.sh runs on a lent GPU machine (which has nvcc but no package registry and
# none of xsimd, Catch2 or liburing):
#
#   gpu-bundle/bin/      test_device_cuda, gpu_compositions_cuda, gpu_step_cuda: nvcc,
#                        sm_90, host code for x86-64-v3, liburing linked statically
#   gpu-bundle/include/  the headers they need (xsimd, Catch2, liburing, xxHash), so that
#   gpu-bundle/lib/      the script can rebuild there (with liburing.a) if a binary does not start
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
ls -la "$B/bin"
du -sh "$B"
