// One AdamW step with the state in pinned host memory: the weights must move against the
// gradient, which needs the headers, xsimd, liburing and threads all found and linked.
#include <tierstate/tierstate.hpp>

#include <cstdio>
#include <vector>

int main()
{
  using namespace tierstate;
  std::vector<float> weights(1000, 1.0f);
  std::vector<float> gradients(weights.size(), 0.25f);
  OffloadedOptimizer<AdamW, Fp32, PinnedHost> optimizer({.lr = 0.01});
  optimizer.add_tensor("weights", weights.data(), weights.size());
  std::vector<grad_view<float>> grads = {{gradients.data(), gradients.size()}};
  optimizer.step(grads);

  bool const moved = weights.front() < 1.0f && weights.back() < 1.0f && optimizer.step_count() == 1;
  std::printf("tierstate %s: one AdamW step, weight 1 -> %g: %s\n", TIERSTATE_VERSION_STRING,
              static_cast<double>(weights.front()), moved ? "ok" : "did not move");
  return moved ? 0 : 1;
}
