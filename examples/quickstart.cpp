// SPDX-License-Identifier: Apache-2.0
// The README's shortest correct use of the library, compiled and run by the tests.
#include <tierstate/tierstate.hpp>

#include <cstdio>
#include <vector>

int main()
{
  using namespace tierstate;
  // A model's bf16 weights and the gradients backward leaves next to them.
  std::vector<bf16> weight(4096 * 1024, bf16(0.01f)), bias(1024, bf16(0.0f));
  std::vector<bf16> weight_grad(weight.size(), bf16(1e-3f)), bias_grad(bias.size(), bf16(-1e-3f));

  // AdamW; bf16 params and grads with an fp32 master and fp32 moments, kept in host memory.
  OffloadedOptimizer<AdamW, Bf16Mixed, PinnedHost> opt({.lr = 3e-4, .weight_decay = 0.1});
  opt.add_tensor("fc.weight", weight.data(), weight.size());
  opt.add_tensor("fc.bias", bias.data(), bias.size());
  opt.add_group({.lr = 3e-4, .weight_decay = 0.0}, {"fc.bias"});  // no decay for biases

  for (int step = 1; step <= 10; ++step) {
    // ... forward and backward fill weight_grad and bias_grad ...
    std::vector<grad_view<bf16>> grads = {{weight_grad.data(), weight_grad.size()},
                                          {bias_grad.data(), bias_grad.size()}};
    step_result const r = opt.step(grads);  // updates weight and bias in place
    if (r.skipped) { std::printf("step %d skipped: non-finite gradients\n", step); }
  }
  std::printf("%lld steps; %zu bytes of optimizer state in %s; weight[0] = %g\n",
              static_cast<long long>(opt.step_count()), opt.state_layout().total_bytes(),
              std::string(PinnedHost::name).c_str(), static_cast<double>(static_cast<float>(weight[0])));
  return opt.step_count() == 10 && static_cast<float>(weight[0]) < 0.01f ? 0 : 1;
}
