// SPDX-License-Identifier: Apache-2.0
// Configuration macros shared by every tierstate header.
#pragma once

#define TIERSTATE_VERSION_MAJOR 0
#define TIERSTATE_VERSION_MINOR 1
#define TIERSTATE_VERSION_PATCH 0

// Functions callable from host code and, under nvcc, from device code. Without a CUDA
// compiler they are plain inline functions, so the CPU build needs no CUDA header.
#if defined(__CUDACC__)
#define TIERSTATE_HOST_DEVICE __host__ __device__ inline
#else
#define TIERSTATE_HOST_DEVICE inline
#endif

#if defined(__GNUC__) || defined(__clang__)
#define TIERSTATE_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define TIERSTATE_ALWAYS_INLINE inline
#endif

// Host kernels whose instruction selection depends on compiler flags that the xsimd
// architecture tag does not capture (F16C, used for fp16 conversions on AVX and AVX2, and
// AVX512-BF16, used for bf16 rounding) live in an inline namespace named after that
// configuration. Two translation units built with different flags then instantiate
// differently-named templates, and the linker can never merge a definition from one into
// the other (see tests/odr).
#if defined(__F16C__) && defined(__AVX512BF16__)
#define TIERSTATE_HOST_ABI abi_f16c_bf16
#elif defined(__F16C__)
#define TIERSTATE_HOST_ABI abi_f16c
#elif defined(__AVX512BF16__)
#define TIERSTATE_HOST_ABI abi_bf16
#else
#define TIERSTATE_HOST_ABI abi_base
#endif

// Code that differs when CUDA is enabled (TIERSTATE_ENABLE_CUDA: PinnedHost allocating with
// cudaHostAlloc, the device tiers) lives in this inline namespace, for the same reason.
#if defined(TIERSTATE_ENABLE_CUDA)
#define TIERSTATE_CUDA_ABI abi_cuda
#else
#define TIERSTATE_CUDA_ABI abi_nocuda
#endif
