// SPDX-License-Identifier: Apache-2.0
// The numeric core on its own: bf16 weights with an fp32 master and fp32 Adam moments,
// updated by tierstate's host kernel on all CPUs, minimising 0.5 * |w - target|^2.
//
//   build/examples/adamw_on_host [elements] [steps]
#include <tierstate/tierstate.hpp>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

int main(int argc, char** argv)
{
  using namespace tierstate;
  std::size_t const n = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 1'000'003;
  int const steps     = argc > 2 ? std::atoi(argv[2]) : 200;
  if (n == 0 || steps <= 0) {
    std::fprintf(stderr, "usage: adamw_on_host [elements >= 1] [steps >= 1]\n");
    return 2;
  }

  // What a trainer holds: bf16 weights and gradients. What tierstate adds: the fp32 master
  // and the two moments (12 bytes per parameter).
  std::vector<bf16> weight(n), grad(n);
  std::vector<float> target(n), master(n), exp_avg(n, 0.0f), exp_avg_sq(n, 0.0f);
  for (std::size_t i = 0; i < n; ++i) {
    target[i] = std::sin(static_cast<float>(i) * 0.001f);
    weight[i] = bf16(0.0f);
    master[i] = static_cast<float>(weight[i]);
  }
  update_arrays<Bf16Mixed, AdamW::slot_count> arrays{weight.data(), grad.data(), master.data(),
                                                     {exp_avg.data(), exp_avg_sq.data()}};

  thread_pool pool;  // the CPUs of this process's affinity mask
  AdamW::hyperparameters h;
  h.lr           = 0.05;
  h.weight_decay = 0.0;

  auto loss = [&] {
    double s = 0;
    for (std::size_t i = 0; i < n; ++i) {
      double const d = static_cast<float>(weight[i]) - target[i];
      s += 0.5 * d * d;
    }
    return s / static_cast<double>(n);
  };
  double const first = loss();
  std::printf("adamw_on_host: %zu bf16 parameters, %zu threads, %s kernels\n", n, pool.size(),
              host::arch_name());
  for (int t = 1; t <= steps; ++t) {
    for (std::size_t i = 0; i < n; ++i) { grad[i] = bf16(static_cast<float>(weight[i]) - target[i]); }
    h.lr = 0.05 * (1.0 - 0.9 * (t - 1) / steps);  // a decaying schedule, changed every step
    host::update<AdamW, Bf16Mixed>(pool, AdamW::coefficients_for(h, t), arrays, n);
    if (t == 1 || t % 50 == 0 || t == steps) { std::printf("step %4d  loss %.6g\n", t, loss()); }
  }
  double const last = loss();
  if (!(last < first * 1e-2)) {
    std::fprintf(stderr, "adamw_on_host: loss went from %g to %g, expected a 100x drop\n", first, last);
    return 1;
  }
  return 0;
}
