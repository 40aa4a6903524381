// SPDX-License-Identifier: Apache-2.0
// device_shards_adam_compact.cpp, compiled by nvcc for the GPU.
#include "device_shards_adam_compact.cpp"
