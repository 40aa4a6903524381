// SPDX-License-Identifier: Apache-2.0
// libtierstate_c's optimizers (c_api.hpp), whose host kernels are dispatched at run time among
// c_kernels.cpp's per-level units (TIERSTATE_C_DISPATCH; elsewhere, this build's own).
// Everything tierstate throws is caught here and reported as a status and a message.
#include "c_api.hpp"
#include "c_kernels.hpp"

#include <tierstate/tierstate.hpp>

#include <cstring>
#include <new>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <vector>


namespace {

using namespace tierstate;

#if defined(TIERSTATE_C_DISPATCH)
using compute = OnHostDispatched<tierstate_c::kernels>;
#else
using compute = OnHost<>;
#endif

// Runs f; what it throws becomes a status and this thread's message. The C++ calls refuse
// bad input before they change anything, so a refused call leaves the optimizer as it was;
// state_lost says when a failure did not.
// `lost` says whether the failure left the optimizer's state part-updated (a step or a load
// that failed part-way): then the status is TIERSTATE_STATE_LOST, whatever the cause, whose
// message it keeps.
template <class F>
tierstate_status guarded(char const* call, F&& f, bool (*lost)(void const*) = nullptr, void const* self = nullptr) noexcept
{
  auto fail = [&](tierstate_status s, char const* what) noexcept {
    if (lost != nullptr && lost(self)) { s = TIERSTATE_STATE_LOST; }
    try {
      std::string text = what;
      if (text.rfind("tierstate", 0) != 0) { text = std::string(call) + ": " + text; }
      if (s == TIERSTATE_STATE_LOST && text.find("was lost") == std::string::npos) {
        text += " (the optimizer's state was lost: load a checkpoint or destroy it)";
      }
      return tierstate_c::fail(s, text.c_str());
    } catch (...) {
      return tierstate_c::fail(s, what);  // (no memory to prefix the call's name)
    }
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
  using optimizer = OffloadedOptimizer<AdamW, Precision, Tier, Transfer, compute>;
  using param     = typename optimizer::param_type;
  using grad      = typename optimizer::grad_type;

 public:
  adamw(tierstate_adamw const& h, typename optimizer::options const& opts) : opt_(to_cpp(h), opts) {}

  tierstate_status add_tensor(char const* name, void* p, std::size_t elements) noexcept override
  {
    return guarded("tierstate_add_tensor", [&] {
      if (name == nullptr) { throw logic_error("tierstate_add_tensor: name is NULL"); }
      sizes_.reserve(sizes_.size() + 1);  // (so that nothing can fail after the tensor is in)
      opt_.add_tensor(name, static_cast<param*>(p), elements);
      sizes_.push_back(elements);
    });
  }
  tierstate_status set_hyperparameters(tierstate_adamw const& h) noexcept override
  {
    return guarded("tierstate_set_hyperparameters", [&] { opt_.set_hyperparameters(0, to_cpp(h)); });
  }
  tierstate_status set_lr(double lr) noexcept override
  {
    return guarded("tierstate_set_lr", [&] {
      auto h = opt_.get_hyperparameters(0);
      h.lr   = lr;
      opt_.set_hyperparameters(0, h);
    });
  }
  tierstate_status step(void const* const* grads, std::size_t count, double scale, int* skipped) noexcept override
  {
    return guarded(
      "tierstate_step",
      [&] {
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
      bool const s = opt_.step(views_, scale).skipped;
      if (skipped != nullptr) { *skipped = s ? 1 : 0; }
      },
      lost, this);
  }
  [[nodiscard]] std::int64_t step_count() const noexcept override { return opt_.step_count(); }
  tierstate_status save(char const* path) noexcept override
  {
    return guarded("tierstate_save", [&] {
      if (path == nullptr) { throw logic_error("tierstate_save: path is NULL"); }
      opt_.save(path);
    });
  }
  tierstate_status load(char const* path) noexcept override
  {
    return guarded(
      "tierstate_load",
      [&] {
        if (path == nullptr) { throw logic_error("tierstate_load: path is NULL"); }
        opt_.load(path);
      },
      lost, this);
  }
  tierstate_status copy_moment(char const* name, int which, float* to, std::size_t elements) noexcept override
  {
    return guarded("tierstate_copy_moment", [&] {
      if (name == nullptr || to == nullptr) { throw logic_error("tierstate_copy_moment: name or to is NULL"); }
      if (which != 0 && which != 1) {
        throw invalid_option("tierstate_copy_moment's slot", std::to_string(which),
                             "it is 0 (exp_avg) or 1 (exp_avg_sq)");
      }
      opt_.copy_state(name, which == 0 ? slot::exp_avg : slot::exp_avg_sq, std::span<float>(to, elements));
    });
  }

 private:
  static bool lost(void const* self) noexcept { return static_cast<adamw const*>(self)->opt_.state_lost(); }

  optimizer opt_;
  std::vector<std::size_t> sizes_;
  std::vector<grad_view<grad>> views_;
};

template <class Precision, class Tier, class Transfer>
tierstate_optimizer* make(tierstate_options const& o)
{
  typename OffloadedOptimizer<AdamW, Precision, Tier, Transfer, compute>::options opts;
  opts.chunk_elements = o.chunk_elements;  // 0: 2^20, or a checkpoint's
  opts.threads       = o.threads;
  opts.max_grad_norm = o.max_grad_norm;
  // Without the skip, nothing looks: the C API has no way to report what `report` would find.
  opts.on_nonfinite  = o.skip_nonfinite != 0 ? nonfinite_policy::skip_step : nonfinite_policy::ignore;
  if constexpr (std::is_same_v<Tier, NvmeFile>) {
    if (o.directory == nullptr || *o.directory == '\0') {
      throw invalid_option("tierstate_options.directory", "NULL",
                           "TIERSTATE_NVME_FILE needs an existing directory for its scratch file");
    }
    opts.tier.directory = o.directory;
  }
  return new adamw<Precision, Tier, Transfer>(o.hyper, opts);
}

template <class Precision>
tierstate_optimizer* make(tierstate_options const& o, long long tier)
{
  return tier == TIERSTATE_PINNED_HOST ? make<Precision, PinnedHost, Synchronous>(o)
                                       : make<Precision, NvmeFile, Pipelined<2>>(o);
}

}  // namespace

tierstate_status tierstate_c::create(tierstate_options const& o, tierstate_optimizer** out) noexcept
{
  return guarded("tierstate_create", [&] {
    if (o.struct_size != sizeof(tierstate_options)) {
      throw invalid_option("tierstate_options.struct_size", std::to_string(o.struct_size),
                           "it is sizeof(tierstate_options), " + std::to_string(sizeof(tierstate_options)) +
                             ", as tierstate_options_init sets it (call it before setting the options)");
    }
    long long const tier = enum_value(o.tier), precision = enum_value(o.precision);
    if (tier != TIERSTATE_PINNED_HOST && tier != TIERSTATE_NVME_FILE) {
      throw invalid_option("tierstate_options.tier", std::to_string(tier),
                           "it is TIERSTATE_PINNED_HOST or TIERSTATE_NVME_FILE");
    }
    if (precision == TIERSTATE_FP32) {
      *out = make<Fp32>(o, tier);
    } else if (precision == TIERSTATE_BF16) {
      *out = make<Bf16Mixed>(o, tier);
    } else {
      throw invalid_option("tierstate_options.precision", std::to_string(precision),
                           "it is TIERSTATE_FP32 or TIERSTATE_BF16");
    }
  });
}
