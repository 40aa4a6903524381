// SPDX-License-Identifier: Apache-2.0
// Configuration macros shared by every tierstate header.
#pragma once
// C++20 is required. Without it, the first error says so, and the missing file below (named as a
// sentence) stops the compiler there, before thousands of lines about std::span and concepts.
#if !defined(__cplusplus) || __cplusplus < 202002L
#error "tierstate needs C++20: compile with -std=c++20 or later (C code includes <tierstate/c.h>)"
#include "tierstate needs C++20"
#endif

// The version, as VERSION (the repository's one source of it) says: tests/check_version.py
// checks these against it, as it checks meson's, the installed pkg-config and CMake files'
// and the packages'.
#define TIERSTATE_VERSION_MAJOR 0
#define TIERSTATE_VERSION_MINOR 1
#define TIERSTATE_VERSION_PATCH 0
#define TIERSTATE_VERSION_STRING "0.1.0"
/// MAJOR * 10000 + MINOR * 100 + PATCH, for comparisons: #if TIERSTATE_VERSION >= 100
#define TIERSTATE_VERSION (TIERSTATE_VERSION_MAJOR * 10000 + TIERSTATE_VERSION_MINOR * 100 + TIERSTATE_VERSION_PATCH)

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

// Every tierstate definition lives in one inline namespace named after the configuration
// it was compiled for: the instruction-set extensions the compiler may use (each -m flag
// that changes what an inline function compiles to, F16C and AVX512-BF16 included) and
// whether CUDA is enabled (TIERSTATE_ENABLE_CUDA: PinnedHost page-locking with
// cudaHostRegister, the device tiers). Two translation units built with different flags then
// define differently-named functions and types, and the linker can never keep one's body
// for the other's call: a baseline translation unit never runs an AVX-512 body, whatever it
// links with (tests/odr checks this with nm). The cost: translation units that hand
// tierstate objects to each other must be built with the same flags, or they do not link.
// Users spell no part of it: `tierstate::OffloadedOptimizer` names the configuration's own.
//
// The name: "abi_", "cuda" or "host", then on x86 "_x" and a letter per extension present
// (abi_host_x for baseline x86-64; abi_host_x3s45payfhbcl for AVX2 with FMA, F16C and BMI2),
// elsewhere "_neon", "_sve" or "_generic". nvcc's device pass preprocesses with the host
// compiler's flags, so both of its passes agree on it.
#if defined(__x86_64__) || defined(__i386__)
#if defined(__SSE3__)
#define TIERSTATE_ABI_SSE3 3
#else
#define TIERSTATE_ABI_SSE3
#endif
#if defined(__SSSE3__)
#define TIERSTATE_ABI_SSSE3 s
#else
#define TIERSTATE_ABI_SSSE3
#endif
#if defined(__SSE4_1__)
#define TIERSTATE_ABI_SSE41 4
#else
#define TIERSTATE_ABI_SSE41
#endif
#if defined(__SSE4_2__)
#define TIERSTATE_ABI_SSE42 5
#else
#define TIERSTATE_ABI_SSE42
#endif
#if defined(__POPCNT__)
#define TIERSTATE_ABI_POPCNT p
#else
#define TIERSTATE_ABI_POPCNT
#endif
#if defined(__AVX__)
#define TIERSTATE_ABI_AVX a
#else
#define TIERSTATE_ABI_AVX
#endif
#if defined(__AVX2__)
#define TIERSTATE_ABI_AVX2 y
#else
#define TIERSTATE_ABI_AVX2
#endif
#if defined(__FMA__)
#define TIERSTATE_ABI_FMA f
#else
#define TIERSTATE_ABI_FMA
#endif
#if defined(__F16C__)
#define TIERSTATE_ABI_F16C h
#else
#define TIERSTATE_ABI_F16C
#endif
#if defined(__BMI__)
#define TIERSTATE_ABI_BMI b
#else
#define TIERSTATE_ABI_BMI
#endif
#if defined(__BMI2__)
#define TIERSTATE_ABI_BMI2 c
#else
#define TIERSTATE_ABI_BMI2
#endif
#if defined(__LZCNT__)
#define TIERSTATE_ABI_LZCNT l
#else
#define TIERSTATE_ABI_LZCNT
#endif
#if defined(__AVX512F__)
#define TIERSTATE_ABI_AVX512F F
#else
#define TIERSTATE_ABI_AVX512F
#endif
#if defined(__AVX512CD__)
#define TIERSTATE_ABI_AVX512CD C
#else
#define TIERSTATE_ABI_AVX512CD
#endif
#if defined(__AVX512BW__)
#define TIERSTATE_ABI_AVX512BW B
#else
#define TIERSTATE_ABI_AVX512BW
#endif
#if defined(__AVX512DQ__)
#define TIERSTATE_ABI_AVX512DQ D
#else
#define TIERSTATE_ABI_AVX512DQ
#endif
#if defined(__AVX512VL__)
#define TIERSTATE_ABI_AVX512VL V
#else
#define TIERSTATE_ABI_AVX512VL
#endif
#if defined(__AVX512VNNI__)
#define TIERSTATE_ABI_AVX512VNNI N
#else
#define TIERSTATE_ABI_AVX512VNNI
#endif
#if defined(__AVX512BF16__)
#define TIERSTATE_ABI_AVX512BF16 R
#else
#define TIERSTATE_ABI_AVX512BF16
#endif
#if defined(__AVX512FP16__)
#define TIERSTATE_ABI_AVX512FP16 H
#else
#define TIERSTATE_ABI_AVX512FP16
#endif
#if defined(__AVX512VBMI__)
#define TIERSTATE_ABI_AVX512VBMI M
#else
#define TIERSTATE_ABI_AVX512VBMI
#endif
#define TIERSTATE_ABI_ISA_3(a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p, q, r, s, t, u) \
  x##a##b##c##d##e##f##g##h##i##j##k##l##m##n##o##p##q##r##s##t##u
#define TIERSTATE_ABI_ISA_2(...) TIERSTATE_ABI_ISA_3(__VA_ARGS__)
#define TIERSTATE_ABI_ISA                                                                         \
  TIERSTATE_ABI_ISA_2(TIERSTATE_ABI_SSE3, TIERSTATE_ABI_SSSE3, TIERSTATE_ABI_SSE41, TIERSTATE_ABI_SSE42,     \
                      TIERSTATE_ABI_POPCNT, TIERSTATE_ABI_AVX, TIERSTATE_ABI_AVX2, TIERSTATE_ABI_FMA,        \
                      TIERSTATE_ABI_F16C, TIERSTATE_ABI_BMI, TIERSTATE_ABI_BMI2, TIERSTATE_ABI_LZCNT,        \
                      TIERSTATE_ABI_AVX512F, TIERSTATE_ABI_AVX512CD, TIERSTATE_ABI_AVX512BW,                \
                      TIERSTATE_ABI_AVX512DQ, TIERSTATE_ABI_AVX512VL, TIERSTATE_ABI_AVX512VNNI,             \
                      TIERSTATE_ABI_AVX512BF16, TIERSTATE_ABI_AVX512FP16, TIERSTATE_ABI_AVX512VBMI)
#elif defined(__aarch64__) && defined(__ARM_FEATURE_SVE)
#define TIERSTATE_ABI_ISA sve
#elif defined(__aarch64__)
#define TIERSTATE_ABI_ISA neon
#else
#define TIERSTATE_ABI_ISA generic
#endif
// Tracing (core/trace.hpp) is compiled in unless TIERSTATE_TRACE is defined to 0; a build
// without it ends the name in "_notrace".
#ifndef TIERSTATE_TRACE
#define TIERSTATE_TRACE 1
#endif
#if TIERSTATE_TRACE
#define TIERSTATE_ABI_TRACE
#else
#define TIERSTATE_ABI_TRACE _notrace
#endif
// A build with libnuma (TIERSTATE_WITH_NUMA: PinnedHost's numa_node) ends it in "_numa".
#if defined(TIERSTATE_WITH_NUMA)
#define TIERSTATE_ABI_NUMA _numa
#else
#define TIERSTATE_ABI_NUMA
#endif
#define TIERSTATE_ABI_NAME2(cuda, isa, trace, numa) abi_##cuda##_##isa##trace##numa
#define TIERSTATE_ABI_NAME(cuda, isa, trace, numa) TIERSTATE_ABI_NAME2(cuda, isa, trace, numa)
#if defined(TIERSTATE_ENABLE_CUDA)
#define TIERSTATE_ABI TIERSTATE_ABI_NAME(cuda, TIERSTATE_ABI_ISA, TIERSTATE_ABI_TRACE, TIERSTATE_ABI_NUMA)
#else
#define TIERSTATE_ABI TIERSTATE_ABI_NAME(host, TIERSTATE_ABI_ISA, TIERSTATE_ABI_TRACE, TIERSTATE_ABI_NUMA)
#endif
