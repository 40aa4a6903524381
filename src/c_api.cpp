// SPDX-License-Identifier: Apache-2.0
// libtierstate_c: tierstate/c.h over the C++ headers. One OffloadedOptimizer<AdamW, ...>
// per (precision, tier) pair behind a small virtual interface; every entry point catches
// what the C++ throws and turns it into a status and this thread's last-error message.
#define TIERSTATE_C_BUILDING 1
#include <tierstate/c.h>
#include <tierstate/tierstate.hpp>

#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <system_error>
#include <type_traits>
#include <vector>

// The handle C code holds: an optimizer of one composition.
struct tierstate_optimizer {
  virtual ~tierstate_optimizer() = default;
  virtual void add_tensor(char const* name, void* param, std::size_t elements)            = 0;
  virtual void set_hyperparameters(tierstate_adamw const& h)                              = 0;
  [[nodiscard]] virtual tierstate_adamw hyperparameters() const                           = 0;
  virtual bool step(void const* const* grads, std::size_t count, double grad_scale)        = 0;
  [[nodiscard]] virtual std::int64_t step_count() const                                   = 0;
  virtual void save(char const* path)                                                     = 0;
  virtual void load(char const* path)                                                     = 0;
  virtual void copy_moment(char const* name, tierstate::slot s, float* to, std::size_t n) = 0;
};

namespace {

using namespace tierstate;

thread_local std::string last_error;

// The value C stored in an enum member. C may store any int there; in C++, loading a value
// outside the enumerators' range as the enum type is undefined, so it is read as its bits.
template <class E>
long long enum_value(E const& e) noexcept
{
  std::make_signed_t<std::underlying_type_t<E>> v;  // (as C code writes it: -3, not 4294967293)
  std::memcpy(&v, &e, sizeof v);
  return static_cast<long long>(v);
}

AdamW::hyperparameters to_cpp(tierstate_adamw const& h)
{
  return {.lr = h.lr, .betas = {h.beta1, h.beta2}, .eps = h.eps, .weight_decay = h.weight_decay};
}

template <class Precision, class Tier, class Transfer>
class adamw final : public tierstate_optimizer {
  using optimizer = OffloadedOptimizer<AdamW, Precision, Tier, Transfer>;
  using param     = typename optimizer::param_type;
  using grad      = typename optimizer::grad_type;

 public:
  adamw(tierstate_options const& o, typename optimizer::options const& opts) : opt_(to_cpp(o.hyper), opts) {}

  void add_tensor(char const* name, void* param_ptr, std::size_t elements) override
  {
    opt_.add_tensor(name, static_cast<param*>(param_ptr), elements);
    sizes_.push_back(elements);
  }
  void set_hyperparameters(tierstate_adamw const& h) override
  {
    opt_.set_hyperparameters(0, to_cpp(h));  // (the C API makes one group: every tensor's)
  }
  [[nodiscard]] tierstate_adamw hyperparameters() const override
  {
    auto const& h = opt_.get_hyperparameters(0);
    return {h.lr, h.betas[0], h.betas[1], h.eps, h.weight_decay};
  }
  bool step(void const* const* grads, std::size_t count, double grad_scale) override
  {
    if (count != sizes_.size()) {
      throw logic_error("tierstate_step: " + std::to_string(count) + " gradients for " +
                        std::to_string(sizes_.size()) + " tensors (one per add_tensor, NULL for none)");
    }
    if (grads == nullptr && count > 0) { throw logic_error("tierstate_step: grads is NULL"); }
    views_.clear();
    for (std::size_t i = 0; i < count; ++i) {
      auto const* g = static_cast<grad const*>(grads[i]);
      views_.push_back({g, g != nullptr ? sizes_[i] : 0});
    }
    return opt_.step(views_, grad_scale).skipped;
  }
  [[nodiscard]] std::int64_t step_count() const override { return opt_.step_count(); }
  void save(char const* path) override { opt_.save(path); }
  void load(char const* path) override { opt_.load(path); }
  void copy_moment(char const* name, slot s, float* to, std::size_t n) override
  {
    opt_.copy_state(name, s, std::span<float>(to, n));
  }

 private:
  optimizer opt_;
  std::vector<std::size_t> sizes_;
  std::vector<grad_view<grad>> views_;
};

template <class Precision>
tierstate_optimizer* make(tierstate_options const& o)
{
  if (o.tier == TIERSTATE_PINNED_HOST) {
    using composition = adamw<Precision, PinnedHost, Synchronous>;
    typename OffloadedOptimizer<AdamW, Precision, PinnedHost, Synchronous>::options opts;
    if (o.chunk_elements != 0) { opts.chunk_elements = o.chunk_elements; }
    opts.threads       = o.threads;
    opts.max_grad_norm = o.max_grad_norm;
    opts.on_nonfinite  = o.skip_nonfinite != 0 ? nonfinite_policy::skip_step : nonfinite_policy::report;
    return new composition(o, opts);
  }
  if (o.directory == nullptr || *o.directory == '\0') {
    throw invalid_option("tierstate_options.directory", "NULL",
                         "TIERSTATE_NVME_FILE needs an existing directory for its scratch file");
  }
  using composition = adamw<Precision, NvmeFile, Pipelined<2>>;
  typename OffloadedOptimizer<AdamW, Precision, NvmeFile, Pipelined<2>>::options opts;
  if (o.chunk_elements != 0) { opts.chunk_elements = o.chunk_elements; }
  opts.threads        = o.threads;
  opts.max_grad_norm  = o.max_grad_norm;
  opts.on_nonfinite   = o.skip_nonfinite != 0 ? nonfinite_policy::skip_step : nonfinite_policy::report;
  opts.tier.directory = o.directory;
  return new composition(o, opts);
}

// Runs f, mapping what it throws to a status and the message to last_error. The C++ calls
// refuse bad input before they change anything, so a refused call leaves the optimizer as
// it was; state_lost says when a failure did not.
template <class F>
tierstate_status guarded(char const* call, F&& f) noexcept
{
  auto fail = [&](tierstate_status s, char const* what) {
    try {
      last_error = what;
      if (last_error.rfind("tierstate", 0) != 0) { last_error = std::string(call) + ": " + last_error; }
    } catch (...) {  // (no memory for the message: the status still says what kind)
    }
    return s;
  };
  try {
    f();
    return TIERSTATE_OK;
  } catch (state_lost const& e) {
    return fail(TIERSTATE_STATE_LOST, e.what());
  } catch (checkpoint_error const& e) {
    return fail(TIERSTATE_CHECKPOINT_ERROR, e.what());
  } catch (invalid_option const& e) {
    return fail(TIERSTATE_INVALID_ARGUMENT, e.what());
  } catch (tierstate::logic_error const& e) {
    // A contract broken by the arguments (a size, a NULL, a name) or by the order of calls.
    std::string_view const w = e.what();
    bool const order = w.find("after the first step") != w.npos || w.find("another thread") != w.npos;
    return fail(order ? TIERSTATE_WRONG_USE : TIERSTATE_INVALID_ARGUMENT, e.what());
  } catch (std::bad_alloc const&) {
    return fail(TIERSTATE_OUT_OF_MEMORY, "out of host memory");
  } catch (std::system_error const& e) {
    bool const memory = e.code() == std::errc::not_enough_memory;
    return fail(memory ? TIERSTATE_OUT_OF_MEMORY : TIERSTATE_IO_ERROR, e.what());
  } catch (std::invalid_argument const& e) {
    return fail(TIERSTATE_INVALID_ARGUMENT, e.what());
  } catch (std::out_of_range const& e) {
    return fail(TIERSTATE_INVALID_ARGUMENT, e.what());
  } catch (std::logic_error const& e) {
    return fail(TIERSTATE_WRONG_USE, e.what());
  } catch (std::exception const& e) {
    return fail(TIERSTATE_INTERNAL_ERROR, e.what());
  } catch (...) {
    return fail(TIERSTATE_INTERNAL_ERROR, "an unknown exception");
  }
}

tierstate_status null_handle(char const* call)
{
  return guarded(call, [&] { throw logic_error(std::string(call) + ": the optimizer is NULL"); });
}

}  // namespace

extern "C" {

void tierstate_options_init(tierstate_options* o)
{
  if (o == nullptr) { return; }
  AdamW::hyperparameters const d{};
  *o                = tierstate_options{};
  o->tier           = TIERSTATE_PINNED_HOST;
  o->precision      = TIERSTATE_FP32;
  o->hyper          = {d.lr, d.betas[0], d.betas[1], d.eps, d.weight_decay};
  o->skip_nonfinite = 1;
}

tierstate_status tierstate_create(tierstate_options const* options, tierstate_optimizer** out)
{
  if (out != nullptr) { *out = nullptr; }
  return guarded("tierstate_create", [&] {
    if (options == nullptr || out == nullptr) { throw logic_error("tierstate_create: options or out is NULL"); }
    tierstate_options const& o = *options;
    long long const tier = enum_value(o.tier), precision = enum_value(o.precision);
    if (tier != TIERSTATE_PINNED_HOST && tier != TIERSTATE_NVME_FILE) {
      throw invalid_option("tierstate_options.tier", std::to_string(tier),
                           "it is TIERSTATE_PINNED_HOST or TIERSTATE_NVME_FILE");
    }
    if (precision == TIERSTATE_FP32) {
      *out = make<Fp32>(o);
    } else if (precision == TIERSTATE_BF16) {
      *out = make<Bf16Mixed>(o);
    } else {
      throw invalid_option("tierstate_options.precision", std::to_string(precision),
                           "it is TIERSTATE_FP32 or TIERSTATE_BF16");
    }
  });
}

void tierstate_destroy(tierstate_optimizer* opt) { delete opt; }

tierstate_status tierstate_add_tensor(tierstate_optimizer* opt, char const* name, void* param, std::size_t elements)
{
  if (opt == nullptr) { return null_handle("tierstate_add_tensor"); }
  return guarded("tierstate_add_tensor", [&] {
    if (name == nullptr) { throw logic_error("tierstate_add_tensor: name is NULL"); }
    opt->add_tensor(name, param, elements);
  });
}

tierstate_status tierstate_set_hyperparameters(tierstate_optimizer* opt, tierstate_adamw const* hyper)
{
  if (opt == nullptr) { return null_handle("tierstate_set_hyperparameters"); }
  return guarded("tierstate_set_hyperparameters", [&] {
    if (hyper == nullptr) { throw logic_error("tierstate_set_hyperparameters: hyper is NULL"); }
    opt->set_hyperparameters(*hyper);
  });
}

tierstate_status tierstate_set_lr(tierstate_optimizer* opt, double lr)
{
  if (opt == nullptr) { return null_handle("tierstate_set_lr"); }
  return guarded("tierstate_set_lr", [&] {
    tierstate_adamw h = opt->hyperparameters();
    h.lr              = lr;
    opt->set_hyperparameters(h);
  });
}

tierstate_status tierstate_step(tierstate_optimizer* opt, void const* const* grads, std::size_t count,
                                double grad_scale, int* skipped)
{
  if (skipped != nullptr) { *skipped = 0; }
  if (opt == nullptr) { return null_handle("tierstate_step"); }
  return guarded("tierstate_step", [&] {
    bool const s = opt->step(grads, count, grad_scale);
    if (skipped != nullptr) { *skipped = s ? 1 : 0; }
  });
}

int64_t tierstate_step_count(tierstate_optimizer const* opt) { return opt != nullptr ? opt->step_count() : -1; }

tierstate_status tierstate_save(tierstate_optimizer* opt, char const* path)
{
  if (opt == nullptr) { return null_handle("tierstate_save"); }
  return guarded("tierstate_save", [&] {
    if (path == nullptr) { throw logic_error("tierstate_save: path is NULL"); }
    opt->save(path);
  });
}

tierstate_status tierstate_load(tierstate_optimizer* opt, char const* path)
{
  if (opt == nullptr) { return null_handle("tierstate_load"); }
  return guarded("tierstate_load", [&] {
    if (path == nullptr) { throw logic_error("tierstate_load: path is NULL"); }
    opt->load(path);
  });
}

tierstate_status tierstate_copy_moment(tierstate_optimizer* opt, char const* name, int which, float* to,
                                       std::size_t elements)
{
  if (opt == nullptr) { return null_handle("tierstate_copy_moment"); }
  return guarded("tierstate_copy_moment", [&] {
    if (name == nullptr || to == nullptr) { throw logic_error("tierstate_copy_moment: name or to is NULL"); }
    if (which != 0 && which != 1) {
      throw invalid_option("tierstate_copy_moment's slot", std::to_string(which), "it is 0 (exp_avg) or 1 (exp_avg_sq)");
    }
    opt->copy_moment(name, which == 0 ? slot::exp_avg : slot::exp_avg_sq, to, elements);
  });
}

char const* tierstate_last_error(void) { return last_error.c_str(); }

char const* tierstate_status_name(tierstate_status status)
{
  switch (status) {
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
