/* SPDX-License-Identifier: Apache-2.0 */
/* tierstate's C API, for trainers written in C (llm.c-style): an AdamW optimizer whose
 * state lives in pinned host memory or in an NVMe scratch file, with fp32 or bf16 params.
 * Link with libtierstate_c (pkg-config tierstate-c; CMake tierstate::tierstate_c), a small
 * compiled library around the C++ headers, with kernels for several x86-64 levels of which
 * it runs the widest this CPU has (tierstate_arch).
 *
 *   tierstate_options o;
 *   tierstate_options_init(&o);                     // PinnedHost, fp32, AdamW's defaults
 *   o.hyper.lr = 3e-4;
 *   tierstate_optimizer* opt;
 *   if (tierstate_create(&o, &opt) != TIERSTATE_OK) fail(tierstate_last_error());
 *   tierstate_add_tensor(opt, "w", w, n);           // before the first step, in a fixed order
 *   const void* grads[] = {g};
 *   tierstate_step(opt, grads, 1, 1.0, NULL);       // updates w in place
 *   tierstate_destroy(opt);
 *
 * Every call that can fail returns a tierstate_status; on failure, tierstate_last_error()
 * says what was wrong, and a refused call leaves the optimizer as it was, except one that
 * returns TIERSTATE_STATE_LOST (a step or load whose I/O failed part-way: the message names
 * the cause). An optimizer is used from one thread at a time. */
#ifndef TIERSTATE_C_H
#define TIERSTATE_C_H

#include <stddef.h>
#include <stdint.h>

#if defined(TIERSTATE_C_BUILDING) && (defined(__GNUC__) || defined(__clang__))
#define TIERSTATE_C_EXPORT __attribute__((visibility("default")))
#else
#define TIERSTATE_C_EXPORT
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Structs below only grow, with a new TIERSTATE_C_API_VERSION; tierstate_options carries its
 * size, so that a library can tell which version a caller compiled against. */
#define TIERSTATE_C_API_VERSION 1

typedef struct tierstate_optimizer tierstate_optimizer;

typedef enum tierstate_status {
  TIERSTATE_OK               = 0,
  TIERSTATE_INVALID_ARGUMENT = 1, /* a bad option, hyper-parameter, name, pointer or count */
  TIERSTATE_WRONG_USE        = 2, /* a call out of order (add_tensor after the first step) */
  TIERSTATE_IO_ERROR         = 3, /* the disk (ENOSPC, EIO, a missing directory): the message names path and errno */
  TIERSTATE_OUT_OF_MEMORY    = 4, /* host memory, or a memory limit (the message says which) */
  TIERSTATE_CHECKPOINT_ERROR = 5, /* a corrupt, truncated or mismatched checkpoint; nothing was loaded */
  TIERSTATE_STATE_LOST       = 6, /* a step failed part-way: load a checkpoint or destroy the optimizer */
  TIERSTATE_INTERNAL_ERROR   = 7
} tierstate_status;

typedef enum tierstate_tier {
  TIERSTATE_PINNED_HOST = 0, /* the state in host memory (huge pages where the kernel gives them) */
  TIERSTATE_NVME_FILE   = 1  /* the state in a nameless scratch file in `directory`, read ahead (Pipelined<2>) */
} tierstate_tier;

typedef enum tierstate_precision {
  TIERSTATE_FP32 = 0, /* float params and gradients, fp32 moments */
  TIERSTATE_BF16 = 1  /* bf16 params and gradients (uint16_t bits), an fp32 master copy and fp32 moments */
} tierstate_precision;

/* torch.optim.AdamW's hyper-parameters (and its defaults, from tierstate_options_init). */
typedef struct tierstate_adamw {
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
} tierstate_adamw;

typedef struct tierstate_options {
  size_t struct_size;      /* sizeof(tierstate_options), set by tierstate_options_init */
  tierstate_tier tier;
  tierstate_precision precision;
  tierstate_adamw hyper;
  const char* directory;   /* TIERSTATE_NVME_FILE: an existing, writable directory (copied) */
  size_t chunk_elements;   /* elements per chunk, a multiple of 2048; 0: 2^20, or a loaded checkpoint's */
  size_t threads;          /* worker threads, the caller's included; 0: every CPU it may use */
  double max_grad_norm;    /* clip the gradients' global 2-norm to this; 0: no clipping */
  int skip_nonfinite;      /* nonzero (the default): skip a step whose gradients hold inf or NaN
                            * (one more read of them); 0: do not look (an inf or NaN reaches the
                            * params: check the gradients yourself) */
} tierstate_options;

/* The defaults: PinnedHost, fp32, torch.optim.AdamW's hyper-parameters, no clipping, and
 * struct_size. Call it first, then set what differs. */
TIERSTATE_C_EXPORT void tierstate_options_init(tierstate_options* options);

/* Makes an optimizer (*out; NULL on failure). NVMe: the directory is checked here. */
TIERSTATE_C_EXPORT tierstate_status tierstate_create(const tierstate_options* options, tierstate_optimizer** out);

/* Frees everything, the scratch file included. NULL is allowed. */
TIERSTATE_C_EXPORT void tierstate_destroy(tierstate_optimizer* opt);

/* Registers a tensor: `param` points at `elements` floats (FP32) or bf16 values (BF16),
 * which step() updates in place; the name is unique and recorded by checkpoints. Every
 * tensor is added before the first step. */
TIERSTATE_C_EXPORT tierstate_status tierstate_add_tensor(tierstate_optimizer* opt, const char* name, void* param,
                                                          size_t elements);

/* The hyper-parameters of every tensor from the next step on (a learning-rate schedule). */
TIERSTATE_C_EXPORT tierstate_status tierstate_set_hyperparameters(tierstate_optimizer* opt, const tierstate_adamw* hyper);
TIERSTATE_C_EXPORT tierstate_status tierstate_set_lr(tierstate_optimizer* opt, double lr);

/* One step: grads[i] is tensor i's gradient (in add_tensor's order, the param's type and
 * size), or NULL for a tensor without one this step (its param and state stay as they are).
 * `grad_scale` is what the gradients were multiplied by (1 when unscaled). *skipped (may be
 * NULL) is set to 1 when the gradients held inf or NaN and the step was skipped. */
TIERSTATE_C_EXPORT tierstate_status tierstate_step(tierstate_optimizer* opt, const void* const* grads, size_t count,
                                                    double grad_scale, int* skipped);

/* Steps taken (skipped ones excluded); -1 for NULL. */
TIERSTATE_C_EXPORT int64_t tierstate_step_count(const tierstate_optimizer* opt);

/* A checkpoint of the state and step count (tierstate's format, which the C++ and PyTorch
 * optimizers read too); load needs the same tensors, names and sizes. With TIERSTATE_FP32 the
 * params are not in it (the moments and step counts are): save your weights yourself; with
 * TIERSTATE_BF16 it holds the fp32 master, and load writes the params from it. A load that
 * is refused (a corrupt or mismatched file: TIERSTATE_CHECKPOINT_ERROR) changes nothing; one
 * whose reads fail part-way returns TIERSTATE_STATE_LOST. Loading (like copy_moment, and
 * the first step) makes the state: add_tensor is refused after it. */
TIERSTATE_C_EXPORT tierstate_status tierstate_save(tierstate_optimizer* opt, const char* path);
TIERSTATE_C_EXPORT tierstate_status tierstate_load(tierstate_optimizer* opt, const char* path);

/* Copies tensor `name`'s first or second moment (slot 0: exp_avg, 1: exp_avg_sq) as fp32
 * into `to` (`elements` floats: the tensor's size), for inspection and tests. */
TIERSTATE_C_EXPORT tierstate_status tierstate_copy_moment(tierstate_optimizer* opt, const char* name, int slot,
                                                           float* to, size_t elements);

/* The kernels this library runs on this CPU, chosen at the first call that needs them: the
 * widest of "x86-64-v4-bf16" (AVX-512 with BF16, VBMI and IFMA), "x86-64-v4" (AVX-512),
 * "x86-64-v3" (AVX2, FMA) and "x86-64-v2" the CPU has, or
 * the one the environment variable TIERSTATE_ARCH names; "build" where the library was built
 * for one target only. NULL, with tierstate_last_error() saying why, when TIERSTATE_ARCH
 * names kernels that this library lacks or this CPU cannot run (tierstate_create then fails
 * likewise). */
TIERSTATE_C_EXPORT const char* tierstate_arch(void);

/* The message of this thread's last failed call ("" when none has failed). Valid until the
 * thread's next failed call. */
TIERSTATE_C_EXPORT const char* tierstate_last_error(void);

/* "TIERSTATE_IO_ERROR" and so on. */
TIERSTATE_C_EXPORT const char* tierstate_status_name(tierstate_status status);

/* The library's version, "0.1.0" (TIERSTATE_VERSION_STRING of the headers it was built from). */
TIERSTATE_C_EXPORT const char* tierstate_version(void);

#ifdef __cplusplus
}
#endif

#endif /* TIERSTATE_C_H */
