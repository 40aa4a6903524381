// SPDX-License-Identifier: Apache-2.0
// gpu_step.cpp built by nvcc for the GPU (TIERSTATE_ENABLE_CUDA comes from the build).
#include "gpu_step.cpp"
