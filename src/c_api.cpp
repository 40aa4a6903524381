// SPDX-License-Identifier: Apache-2.0
// libtierstate_c's entry points (tierstate/c.h). The host kernels' level is chosen once, at
// the first call that needs it (the widest of x86-64-v4-bf16, v4, v3 and v2 that the CPU has,
// or TIERSTATE_ARCH's: kernels/host/dispatch.hpp); the optimizers are c_api_unit.cpp's.
#define TIERSTATE_C_BUILDING 1
#include "c_api.hpp"

#include <tierstate/core/config.hpp>
#include <tierstate/rules/adam.hpp>  // (AdamW's defaults: a struct, no kernel)
#if defined(TIERSTATE_C_DISPATCH)
#include <tierstate/kernels/host/dispatch.hpp>
#endif

#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <string_view>

namespace {

thread_local std::string last_error;

struct choice {
  char const* name = nullptr;
  std::string refusal;  // why TIERSTATE_ARCH cannot be had, when name is null
};

choice choose()
{
#if defined(TIERSTATE_C_DISPATCH)
  try {
    return {tierstate::dispatched_host_level().name, {}};
  } catch (std::exception const& e) {
    std::string why = e.what();
    return {nullptr, why.rfind("tierstate", 0) == 0 ? why : "tierstate: " + why};
  }
#else
  return {"build", {}};  // the build's -march
#endif
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
  if (c.name == nullptr) { return tierstate_c::fail(TIERSTATE_INVALID_ARGUMENT, c.refusal.c_str()); }
  return tierstate_c::create(*options, out);
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
