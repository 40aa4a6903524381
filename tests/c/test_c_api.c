/* SPDX-License-Identifier: Apache-2.0 */
/* The C API from C (gcc -std=c11 -Wall -Wextra -Werror -pedantic): AdamW trained with its
 * state in PinnedHost and in an NvmeFile, fp32 and bf16, against a plain AdamW written here;
 * a checkpoint's round trip; and every refused call's status, message, and that it changed
 * nothing.
 *   test_c_api [DIRECTORY]   (the NvmeFile scratch directory and checkpoints; default ".") */
#include <tierstate/c.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { n = 5000, steps = 12 }; /* 5000: not a multiple of a chunk, a block or a SIMD width */

static int failures = 0;

#define CHECK(cond, ...)                                         \
  do {                                                           \
    if (!(cond)) {                                               \
      ++failures;                                                \
      fprintf(stderr, "%s:%d: FAILED: %s: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                              \
      fprintf(stderr, "\n");                                     \
    }                                                            \
  } while (0)

/* Aborts the test when a call that must work does not, with the library's message. */
static void must(tierstate_status s, const char* call)
{
  if (s != TIERSTATE_OK) {
    fprintf(stderr, "%s: %s: %s\n", call, tierstate_status_name(s), tierstate_last_error());
    exit(1);
  }
}

static float target(size_t i) { return (float)(i % 89) / 89.0f - 0.5f; }

static uint16_t to_bf16(float x) /* round to nearest even; no NaNs here */
{
  uint32_t u;
  memcpy(&u, &x, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

static float from_bf16(uint16_t h)
{
  uint32_t u = (uint32_t)h << 16;
  float x;
  memcpy(&x, &u, 4);
  return x;
}

static tierstate_optimizer* make(tierstate_tier tier, tierstate_precision precision, const char* dir)
{
  tierstate_options o;
  tierstate_options_init(&o);
  o.tier           = tier;
  o.precision      = precision;
  o.hyper.lr       = 0.02;
  o.directory      = dir;
  o.chunk_elements = 2048; /* three chunks */
  tierstate_optimizer* opt = NULL;
  must(tierstate_create(&o, &opt), "tierstate_create");
  return opt;
}

/* Trains w (fp32) for `count` steps of the loss 0.5 * sum (w - target)^2. */
static void train_fp32(tierstate_optimizer* opt, float* w, float* g, int count)
{
  for (int s = 0; s < count; ++s) {
    for (size_t i = 0; i < n; ++i) { g[i] = w[i] - target(i); }
    const void* grads[] = {g};
    int skipped         = -1;
    must(tierstate_step(opt, grads, 1, 1.0, &skipped), "tierstate_step");
    CHECK(skipped == 0, "a finite step was skipped");
  }
}

static double loss_fp32(const float* w)
{
  double l = 0;
  for (size_t i = 0; i < n; ++i) { l += 0.5 * (w[i] - target(i)) * (w[i] - target(i)); }
  return l;
}

int main(int argc, char** argv)
{
  const char* dir = argc > 1 ? argv[1] : ".";
  static float wp[n], wn[n], wr[n], g[n], m[n], v[n], moment[n];
  char path[4096];
  const char* arch = tierstate_arch();
  if (arch == NULL) {
    /* TIERSTATE_ARCH names kernels this CPU cannot run: a skip (meson's 77), saying so. */
    const char* forced = getenv("TIERSTATE_ARCH");
    int const cannot   = forced != NULL && strstr(tierstate_last_error(), "this CPU cannot run") != NULL;
    printf("%s%s\n", cannot ? "SKIP: " : "FAILED: ", tierstate_last_error());
    return cannot ? 77 : 1;
  }
  printf("tierstate %s, C API version %d, kernels %s\n", tierstate_version(), TIERSTATE_C_API_VERSION, arch);
  {
    tierstate_options d;
    tierstate_options_init(&d);
    CHECK(d.hyper.lr == 1e-3 && d.hyper.beta1 == 0.9 && d.hyper.beta2 == 0.999 && d.hyper.eps == 1e-8 &&
            d.hyper.weight_decay == 0.01 && d.tier == TIERSTATE_PINNED_HOST && d.precision == TIERSTATE_FP32 &&
            d.skip_nonfinite == 1 && d.max_grad_norm == 0.0,
          "tierstate_options_init's defaults are not torch.optim.AdamW's");
  }

  /* fp32 in PinnedHost and in an NvmeFile: the same bits, and near a plain AdamW. */
  tierstate_optimizer* pinned = make(TIERSTATE_PINNED_HOST, TIERSTATE_FP32, NULL);
  tierstate_optimizer* nvme   = make(TIERSTATE_NVME_FILE, TIERSTATE_FP32, dir);
  must(tierstate_add_tensor(pinned, "w", wp, n), "tierstate_add_tensor");
  must(tierstate_add_tensor(nvme, "w", wn, n), "tierstate_add_tensor");
  double const first = loss_fp32(wp);
  train_fp32(pinned, wp, g, steps);
  train_fp32(nvme, wn, g, steps);
  CHECK(memcmp(wp, wn, sizeof wp) == 0, "PinnedHost and NvmeFile differ");
  CHECK(loss_fp32(wp) < 0.5 * first, "the loss went from %g to %g", first, loss_fp32(wp));
  CHECK(tierstate_step_count(pinned) == steps, "step count %lld", (long long)tierstate_step_count(pinned));
  for (int s = 1; s <= steps; ++s) {
    float const bc1 = 1.0f - powf(0.9f, (float)s), bc2 = 1.0f - powf(0.999f, (float)s);
    for (size_t i = 0; i < n; ++i) {
      float const gi = wr[i] - target(i);
      wr[i] *= 1.0f - 0.02f * 0.01f;
      m[i] = 0.9f * m[i] + 0.1f * gi;
      v[i] = 0.999f * v[i] + 0.001f * gi * gi;
      wr[i] -= 0.02f * (m[i] / bc1) / (sqrtf(v[i] / bc2) + 1e-8f);
    }
  }
  double worst = 0;
  for (size_t i = 0; i < n; ++i) { worst = fmax(worst, fabs((double)wp[i] - wr[i])); }
  CHECK(worst < 1e-5, "%g from a plain AdamW", worst);
  must(tierstate_copy_moment(pinned, "w", 0, moment, n), "tierstate_copy_moment");
  worst = 0;
  for (size_t i = 0; i < n; ++i) { worst = fmax(worst, fabs((double)moment[i] - m[i])); }
  CHECK(worst < 1e-5, "exp_avg is %g from a plain AdamW's", worst);

  /* A checkpoint: saved, a step taken, loaded, the same step again gives the same bits. */
  {
    /* A file per run: meson runs the levels' tests at once, in one folder. */
    const char* forced = getenv("TIERSTATE_ARCH");
    snprintf(path, sizeof path, "%s/c_api_test_%s.ckpt", dir, forced != NULL && *forced != '\0' ? forced : "chosen");
  }
  must(tierstate_save(nvme, path), "tierstate_save");
  float saved[n];
  memcpy(saved, wn, sizeof wn);
  train_fp32(nvme, wn, g, 1);
  float once[n];
  memcpy(once, wn, sizeof wn);
  must(tierstate_load(nvme, path), "tierstate_load");
  CHECK(tierstate_step_count(nvme) == steps, "after load: step count %lld", (long long)tierstate_step_count(nvme));
  memcpy(wn, saved, sizeof wn);
  train_fp32(nvme, wn, g, 1);
  CHECK(memcmp(wn, once, sizeof wn) == 0, "the step after load differs from the step after save");
  /* ...and the PinnedHost optimizer loads the NvmeFile's checkpoint. */
  must(tierstate_load(pinned, path), "tierstate_load (PinnedHost from NvmeFile's)");

  /* A corrupt checkpoint is refused and changes nothing. */
  FILE* f = fopen(path, "r+b");
  CHECK(f != NULL, "cannot open %s", path);
  if (f != NULL) {
    fseek(f, 6000, SEEK_SET);
    fputc(0x5a ^ fgetc(f), f);
    fclose(f);
  }
  long long const before = (long long)tierstate_step_count(nvme);
  static float m_before[n], m_after[n];
  must(tierstate_copy_moment(nvme, "w", 1, m_before, n), "tierstate_copy_moment");
  tierstate_status s = tierstate_load(nvme, path);
  CHECK(s == TIERSTATE_CHECKPOINT_ERROR, "a corrupt checkpoint: %s", tierstate_status_name(s));
  CHECK(strstr(tierstate_last_error(), path) != NULL, "the message does not name the file: %s", tierstate_last_error());
  CHECK(tierstate_step_count(nvme) == before, "a refused load changed the step count");
  must(tierstate_copy_moment(nvme, "w", 1, m_after, n), "tierstate_copy_moment");
  CHECK(memcmp(m_before, m_after, sizeof m_before) == 0, "a refused load changed exp_avg_sq");
  remove(path);

  /* Refused calls: each with its status and a message that names what was wrong. */
  s = tierstate_add_tensor(pinned, "late", g, n);
  CHECK(s == TIERSTATE_WRONG_USE, "add_tensor after a step: %s (%s)", tierstate_status_name(s), tierstate_last_error());
  const void* two[] = {g, g};
  s = tierstate_step(pinned, two, 2, 1.0, NULL);
  CHECK(s == TIERSTATE_INVALID_ARGUMENT && strstr(tierstate_last_error(), "2 gradients for 1 tensors") != NULL,
        "two gradients for one tensor: %s (%s)", tierstate_status_name(s), tierstate_last_error());
  tierstate_adamw bad = {0.01, 1.5, 0.999, 1e-8, 0.0};
  s = tierstate_set_hyperparameters(pinned, &bad);
  CHECK(s == TIERSTATE_INVALID_ARGUMENT && strstr(tierstate_last_error(), "beta1") != NULL,
        "beta1 = 1.5: %s (%s)", tierstate_status_name(s), tierstate_last_error());
  s = tierstate_set_lr(pinned, -1.0);
  CHECK(s == TIERSTATE_INVALID_ARGUMENT && strstr(tierstate_last_error(), "lr") != NULL,
        "lr = -1: %s (%s)", tierstate_status_name(s), tierstate_last_error());
  CHECK(tierstate_step(NULL, two, 1, 1.0, NULL) == TIERSTATE_INVALID_ARGUMENT, "a NULL optimizer");
  CHECK(tierstate_step_count(NULL) == -1, "step_count(NULL)");
  CHECK(strcmp(tierstate_status_name((tierstate_status)42), "an unknown tierstate_status") == 0, "status 42");

  /* A non-finite gradient: the step is skipped, the param as it was. */
  memcpy(saved, wp, sizeof wp);
  for (size_t i = 0; i < n; ++i) { g[i] = 0.1f; }
  g[n - 1]           = NAN;
  const void* one[]  = {g};
  int skipped        = 0;
  must(tierstate_step(pinned, one, 1, 1.0, &skipped), "tierstate_step (NaN)");
  CHECK(skipped == 1 && memcmp(saved, wp, sizeof wp) == 0, "a NaN gradient's step was not skipped");
  /* set_lr takes effect at the next step: with lr 0, AdamW changes nothing (its decay is lr * wd). */
  must(tierstate_set_lr(pinned, 0.0), "tierstate_set_lr");
  for (size_t i = 0; i < n; ++i) { g[i] = 0.1f; }
  must(tierstate_step(pinned, one, 1, 1.0, NULL), "tierstate_step (lr 0)");
  CHECK(memcmp(saved, wp, sizeof wp) == 0, "a step at lr 0 changed the params");
  must(tierstate_set_lr(pinned, 0.02), "tierstate_set_lr");
  /* A NULL gradient: that tensor is left alone. */
  const void* none[] = {NULL};
  must(tierstate_step(pinned, none, 1, 1.0, NULL), "tierstate_step (NULL gradient)");
  CHECK(memcmp(saved, wp, sizeof wp) == 0, "a tensor without a gradient changed");

  /* Bad options at creation: *out is NULL and the message names the option. */
  tierstate_options o;
  tierstate_options_init(&o);
  tierstate_optimizer* none_made = pinned;
  o.tier = TIERSTATE_NVME_FILE;
  s      = tierstate_create(&o, &none_made);
  CHECK(s == TIERSTATE_INVALID_ARGUMENT && none_made == NULL && strstr(tierstate_last_error(), "directory") != NULL,
        "NVMe without a directory: %s (%s)", tierstate_status_name(s), tierstate_last_error());
  o.directory = "/nonexistent/tierstate-c-api";
  s           = tierstate_create(&o, &none_made);
  CHECK(s == TIERSTATE_IO_ERROR && strstr(tierstate_last_error(), "/nonexistent/tierstate-c-api") != NULL,
        "a missing directory: %s (%s)", tierstate_status_name(s), tierstate_last_error());
  tierstate_options_init(&o);
  o.chunk_elements = 1000;
  s                = tierstate_create(&o, &none_made);
  CHECK(s == TIERSTATE_INVALID_ARGUMENT && strstr(tierstate_last_error(), "chunk_elements") != NULL,
        "chunk_elements = 1000: %s (%s)", tierstate_status_name(s), tierstate_last_error());
  o.chunk_elements = 0;
  o.struct_size    = sizeof o - 8; /* as a caller compiled against another version would pass */
  s                = tierstate_create(&o, &none_made);
  CHECK(s == TIERSTATE_INVALID_ARGUMENT && strstr(tierstate_last_error(), "struct_size") != NULL,
        "struct_size: %s (%s)", tierstate_status_name(s), tierstate_last_error());
  o.struct_size    = sizeof o;
  o.tier           = (tierstate_tier)-3;
  s                = tierstate_create(&o, &none_made);
  CHECK(s == TIERSTATE_INVALID_ARGUMENT && strstr(tierstate_last_error(), "tier = -3") != NULL,
        "tier -3: %s (%s)", tierstate_status_name(s), tierstate_last_error());
  o.tier           = TIERSTATE_PINNED_HOST;
  o.precision      = (tierstate_precision)7;
  s                = tierstate_create(&o, &none_made);
  CHECK(s == TIERSTATE_INVALID_ARGUMENT && strstr(tierstate_last_error(), "precision") != NULL,
        "precision 7: %s (%s)", tierstate_status_name(s), tierstate_last_error());
  tierstate_destroy(pinned);
  tierstate_destroy(nvme);
  tierstate_destroy(NULL);

  /* bf16 params with an fp32 master: PinnedHost and NvmeFile agree, and the loss falls. */
  static uint16_t bp[n], bn[n], bg[n];
  tierstate_optimizer* bpin  = make(TIERSTATE_PINNED_HOST, TIERSTATE_BF16, NULL);
  tierstate_optimizer* bnvme = make(TIERSTATE_NVME_FILE, TIERSTATE_BF16, dir);
  must(tierstate_add_tensor(bpin, "w", bp, n), "tierstate_add_tensor (bf16)");
  must(tierstate_add_tensor(bnvme, "w", bn, n), "tierstate_add_tensor (bf16)");
  double bfirst = 0, blast = 0;
  for (int step = 0; step < steps; ++step) {
    for (size_t i = 0; i < n; ++i) { bg[i] = to_bf16(from_bf16(bp[i]) - target(i)); }
    const void* grads[] = {bg};
    must(tierstate_step(bpin, grads, 1, 1.0, NULL), "tierstate_step (bf16)");
    must(tierstate_step(bnvme, grads, 1, 1.0, NULL), "tierstate_step (bf16)");
  }
  for (size_t i = 0; i < n; ++i) {
    bfirst += 0.5 * target(i) * target(i);
    blast += 0.5 * (from_bf16(bp[i]) - target(i)) * (from_bf16(bp[i]) - target(i));
  }
  CHECK(memcmp(bp, bn, sizeof bp) == 0, "bf16: PinnedHost and NvmeFile differ");
  CHECK(blast < 0.5 * bfirst, "bf16: the loss went from %g to %g", bfirst, blast);
  tierstate_destroy(bpin);
  tierstate_destroy(bnvme);

  printf("C API: %s\n", failures == 0 ? "all checks passed" : "FAILED");
  return failures == 0 ? 0 : 1;
}
