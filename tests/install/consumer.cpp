// SPDX-License-Identifier: Apache-2.0
// A tiny consumer of an installed tierstate: one optimizer step.
#include <tierstate/tierstate.hpp>

#include <cstdio>
#include <string_view>
#include <vector>

#if defined(EXPECTED_VERSION)  // (VERSION's, from run_consumers.sh)
static_assert(std::string_view(TIERSTATE_VERSION_STRING) == EXPECTED_VERSION, "the headers' version is not VERSION's");
static_assert(TIERSTATE_VERSION == TIERSTATE_VERSION_MAJOR * 10000 + TIERSTATE_VERSION_MINOR * 100 + TIERSTATE_VERSION_PATCH);
#endif

int main()
{
  using namespace tierstate;
  std::vector<bf16> w(5000, bf16(1.0f)), g(5000, bf16(0.5f));
  OffloadedOptimizer<AdamW, Bf16Mixed, PinnedHost> opt({.lr = 0.1});
  opt.add_tensor("w", w.data(), w.size());
  std::vector<grad_view<bf16>> grads = {{g.data(), g.size()}};
  opt.step(grads);
  bool const ok = static_cast<float>(w[0]) < 1.0f && opt.step_count() == 1;
  std::printf("consumer: %s\n", ok ? "ok" : "wrong result");
  return ok ? 0 : 1;
}
