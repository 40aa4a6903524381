// SPDX-License-Identifier: Apache-2.0
// host_step's portable build (host_step_dispatch.hpp), compiled for plain x86-64.
#include "host_step_dispatch.hpp"

#include "host_step_kernels.hpp"

#include <memory>
#include <string>
#include <vector>

namespace host_step_portable {
namespace {

using namespace tierstate;

template <class P, class Compute>
std::function<void()> make(void* params, void const* grads, std::size_t const* sizes, std::size_t count,
                           std::size_t threads)
{
  using Opt = OffloadedOptimizer<AdamW, P, PinnedHost, Synchronous, Compute>;
  typename Opt::options o;
  o.threads      = threads;
  o.on_nonfinite = nonfinite_policy::ignore;
  AdamW::hyperparameters h;
  h.lr       = 1e-4;
  auto opt   = std::make_shared<Opt>(h, o);
  auto views = std::make_shared<std::vector<grad_view<typename P::grad_type>>>();
  auto* p    = static_cast<typename P::param_type*>(params);
  auto* g    = static_cast<typename P::grad_type const*>(grads);
  for (std::size_t t = 0, off = 0; t < count; off += sizes[t], ++t) {
    std::string name = "t";
    name += std::to_string(t);
    opt->add_tensor(std::move(name), p + off, sizes[t]);
    views->push_back({g + off, sizes[t], location::host});
  }
  return [opt, views] { opt->step(*views); };
}

}  // namespace

std::function<void()> adamw_step(kernels k, bool bf16, void* params, void const* grads, std::size_t const* sizes,
                                 std::size_t count, std::size_t threads)
{
  if (k == kernels::dispatched) {
    return bf16 ? make<Bf16Mixed, OnHostDispatched<kernel_list>>(params, grads, sizes, count, threads)
                : make<Fp32, OnHostDispatched<kernel_list>>(params, grads, sizes, count, threads);
  }
  return bf16 ? make<Bf16Mixed, OnHost<>>(params, grads, sizes, count, threads)
              : make<Fp32, OnHost<>>(params, grads, sizes, count, threads);
}

std::string dispatched_level() { return dispatched_host_level().name; }
std::string baseline_arch() { return host::arch_name(); }

}  // namespace host_step_portable
