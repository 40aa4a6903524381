// SPDX-License-Identifier: Apache-2.0
// gpu_compositions.cpp built by nvcc for the GPU (TIERSTATE_ENABLE_CUDA comes from the build).
#include "gpu_compositions.cpp"
