// SPDX-License-Identifier: Apache-2.0
// libtierstate_c's entry points (tierstate/c.h). This unit is compiled for baseline x86-64
// and holds no kernel: tierstate_create picks the kernel unit for this CPU once (the widest
// of x86-64-v4, v3 and v2 that it has, or TIERSTATE_ARCH's), and every later call on an
// optimizer runs in the unit that made it (c_api.hpp).
#define TIERSTATE_C_BUILDING 1
#include "c_api.hpp"

#include <tierstate/core/config.hpp>
#include <tierstate/rules/adam.hpp>  // (AdamW's defaults: a struct, no kernel)

#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>

#if defined(TIERSTATE_C_DISPATCH)
#include <xsimd/config/xsimd_cpuid.hpp>
#endif

namespace {

thread_local std::string last_error;

struct level {
  char const* name;
  tierstate_c::factory create;
  bool supported;
  char const* needs;  // what the CPU lacks when it is not supported
};

struct choice {
  tierstate_c::factory create = nullptr;
  char const* name            = nullptr;
  std::string refusal;  // why TIERSTATE_ARCH cannot be had, when create is null
};

choice choose()
{
#if defined(TIERSTATE_C_DISPATCH)
  auto const cpu = xsimd::available_architectures();
  // The x86-64 levels as tierstate's kernels use them. x86-64-v3's BMI2, F16C, LZCNT and
  // MOVBE, and v4's AVX512VL, are not checked: every CPU with AVX2 and FMA has the first
  // four, and every one with AVX512BW and DQ has VL.
  level const levels[] = {
    {"x86-64-v4", tierstate_c::create_x86_64_v4,
     cpu.avx512f && cpu.avx512cd && cpu.avx512dq && cpu.avx512bw, "AVX512F, CD, DQ and BW"},
    {"x86-64-v3", tierstate_c::create_x86_64_v3, cpu.avx2 && cpu.fma3_avx2, "AVX2 and FMA"},
    {"x86-64-v2", tierstate_c::create_x86_64_v2, cpu.sse4_2 && cpu.ssse3, "SSSE3 and SSE4.2"},
  };
#else
  level const levels[] = {{"build", tierstate_c::create_build, true, ""}};  // the build's -march
#endif
  char const* forced = std::getenv("TIERSTATE_ARCH");
  std::string names;
  for (level const& l : levels) {
    names += names.empty() ? "" : ", ";
    names += l.name;
    if (forced != nullptr && *forced != '\0') {
      if (std::string_view(forced) != l.name) { continue; }
      if (!l.supported) {
        return {nullptr, nullptr,
                std::string("tierstate: TIERSTATE_ARCH=") + forced + " asks for kernels this CPU cannot run (it lacks " +
                  l.needs + "); unset it to use the widest this CPU has"};
      }
      return {l.create, l.name, {}};
    }
    if (l.supported) { return {l.create, l.name, {}}; }
  }
  if (forced != nullptr && *forced != '\0') {
    return {nullptr, nullptr,
            std::string("tierstate: TIERSTATE_ARCH=") + forced + " is not one of this library's kernels (" + names +
              "); unset it to use the widest this CPU has"};
  }
  return {nullptr, nullptr, "tierstate: this CPU has none of this library's kernels (" + names + ")"};
}

choice const& chosen()
{
  static choice const c = choose();  // once: the kernels of every optimizer are the same
  return c;
}

tierstate_status null_handle(char const* call)
{
  return tierstate_c::fail(TIERSTATE_INVALID_ARGUMENT, (std::string(call) + ": the optimizer is NULL").c_str());
}

}  // namespace

tierstate_status tierstate_c::fail(tierstate_status s, char const* message) noexcept
{
  try {
    last_error = message;
  } catch (...) {  // (no memory for the message: the status still says what kind of failure)
    last_error.clear();
  }
  return s;
}

extern "C" {

void tierstate_options_init(tierstate_options* o)
{
  if (o == nullptr) { return; }
  tierstate::AdamW::hyperparameters const d{};  // torch.optim.AdamW's defaults
  *o                = tierstate_options{};
  o->struct_size    = sizeof(tierstate_options);
  o->tier           = TIERSTATE_PINNED_HOST;
  o->precision      = TIERSTATE_FP32;
  o->hyper          = {d.lr, d.betas[0], d.betas[1], d.eps, d.weight_decay};
  o->skip_nonfinite = 1;
}

tierstate_status tierstate_create(tierstate_options const* options, tierstate_optimizer** out)
{
  if (out != nullptr) { *out = nullptr; }
  if (options == nullptr || out == nullptr) {
    return tierstate_c::fail(TIERSTATE_INVALID_ARGUMENT, "tierstate_create: options or out is NULL");
  }
  choice const& c = chosen();
  if (c.create == nullptr) { return tierstate_c::fail(TIERSTATE_INVALID_ARGUMENT, c.refusal.c_str()); }
  return c.create(*options, out);
}

void tierstate_destroy(tierstate_optimizer* opt) { delete opt; }

tierstate_status tierstate_add_tensor(tierstate_optimizer* opt, char const* name, void* param, size_t elements)
{
  return opt != nullptr ? opt->add_tensor(name, param, elements) : null_handle("tierstate_add_tensor");
}

tierstate_status tierstate_set_hyperparameters(tierstate_optimizer* opt, tierstate_adamw const* hyper)
{
  if (opt == nullptr) { return null_handle("tierstate_set_hyperparameters"); }
  if (hyper == nullptr) {
    return tierstate_c::fail(TIERSTATE_INVALID_ARGUMENT, "tierstate_set_hyperparameters: hyper is NULL");
  }
  return opt->set_hyperparameters(*hyper);
}

tierstate_status tierstate_set_lr(tierstate_optimizer* opt, double lr)
{
  return opt != nullptr ? opt->set_lr(lr) : null_handle("tierstate_set_lr");
}

tierstate_status tierstate_step(tierstate_optimizer* opt, void const* const* grads, size_t count, double grad_scale,
                                int* skipped)
{
  if (skipped != nullptr) { *skipped = 0; }
  return opt != nullptr ? opt->step(grads, count, grad_scale, skipped) : null_handle("tierstate_step");
}

int64_t tierstate_step_count(tierstate_optimizer const* opt) { return opt != nullptr ? opt->step_count() : -1; }

tierstate_status tierstate_save(tierstate_optimizer* opt, char const* path)
{
  return opt != nullptr ? opt->save(path) : null_handle("tierstate_save");
}

tierstate_status tierstate_load(tierstate_optimizer* opt, char const* path)
{
  return opt != nullptr ? opt->load(path) : null_handle("tierstate_load");
}

tierstate_status tierstate_copy_moment(tierstate_optimizer* opt, char const* name, int slot, float* to,
                                       size_t elements)
{
  return opt != nullptr ? opt->copy_moment(name, slot, to, elements) : null_handle("tierstate_copy_moment");
}

char const* tierstate_arch(void)
{
  choice const& c = chosen();
  if (c.name == nullptr) { tierstate_c::fail(TIERSTATE_INVALID_ARGUMENT, c.refusal.c_str()); }
  return c.name;
}

char const* tierstate_last_error(void) { return last_error.c_str(); }

char const* tierstate_status_name(tierstate_status status)
{
  int code = 0;  // (read as its bits: C may pass any int, which C++ may not load as the enum)
  static_assert(sizeof code == sizeof status);
  std::memcpy(&code, &status, sizeof code);
  switch (code) {
    case TIERSTATE_OK: return "TIERSTATE_OK";
    case TIERSTATE_INVALID_ARGUMENT: return "TIERSTATE_INVALID_ARGUMENT";
    case TIERSTATE_WRONG_USE: return "TIERSTATE_WRONG_USE";
    case TIERSTATE_IO_ERROR: return "TIERSTATE_IO_ERROR";
    case TIERSTATE_OUT_OF_MEMORY: return "TIERSTATE_OUT_OF_MEMORY";
    case TIERSTATE_CHECKPOINT_ERROR: return "TIERSTATE_CHECKPOINT_ERROR";
    case TIERSTATE_STATE_LOST: return "TIERSTATE_STATE_LOST";
    case TIERSTATE_INTERNAL_ERROR: return "TIERSTATE_INTERNAL_ERROR";
  }
  return "an unknown tierstate_status";
}

char const* tierstate_version(void) { return TIERSTATE_VERSION_STRING; }

}  // extern "C"
