// SPDX-License-Identifier: Apache-2.0
// The consumer that every package route builds (vcpkg, Conan): it trains a small
// least-squares model for a few steps with its AdamW state in PinnedHost memory and again in
// an NvmeFile scratch file, and checks that the loss fell, that the two runs agree to the
// bit, and that they agree with a plain AdamW written here. Built with -Wall -Wextra -Werror.
//   consumer [DIRECTORY]   (NvmeFile's scratch directory; the current one by default)
#include <tierstate/tierstate.hpp>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <vector>

namespace {

constexpr std::size_t n     = 10'000;  // not a multiple of any chunk or SIMD width
constexpr int steps         = 20;
constexpr double lr         = 0.05;
constexpr double decay      = 0.01;
constexpr float target(std::size_t i) { return static_cast<float>(i % 97) / 97.0f - 0.5f; }

// The loss 0.5 * sum (w - target)^2, and its gradient w - target.
double loss_and_grad(std::vector<float> const& w, std::vector<float>& g)
{
  double loss = 0.0;
  for (std::size_t i = 0; i < w.size(); ++i) {
    g[i] = w[i] - target(i);
    loss += 0.5 * static_cast<double>(g[i]) * g[i];
  }
  return loss;
}

template <class Optimizer>
std::vector<float> train(Optimizer& opt, double& first_loss, double& last_loss)
{
  std::vector<float> w(n, 0.0f), g(n);
  opt.add_tensor("w", w.data(), w.size());
  for (int s = 0; s < steps; ++s) {
    double const loss = loss_and_grad(w, g);
    if (s == 0) { first_loss = loss; }
    std::vector<tierstate::grad_view<float>> grads = {{g.data(), g.size()}};
    opt.step(grads);
  }
  std::vector<float> scratch(n);
  last_loss = loss_and_grad(w, scratch);
  return w;
}

// torch.optim.AdamW's update in plain float arithmetic, for the order of magnitude
// only: the library's kernels may contract and reorder, so this is compared with a tolerance.
std::vector<float> reference()
{
  std::vector<float> w(n, 0.0f), m(n, 0.0f), v(n, 0.0f);
  for (int s = 1; s <= steps; ++s) {
    float const bc1 = 1.0f - std::pow(0.9f, static_cast<float>(s));
    float const bc2 = 1.0f - std::pow(0.999f, static_cast<float>(s));
    for (std::size_t i = 0; i < n; ++i) {
      float const g = w[i] - target(i);
      w[i] *= 1.0f - static_cast<float>(lr * decay);
      m[i] = 0.9f * m[i] + 0.1f * g;
      v[i] = 0.999f * v[i] + 0.001f * g * g;
      w[i] -= static_cast<float>(lr) * (m[i] / bc1) / (std::sqrt(v[i] / bc2) + 1e-8f);
    }
  }
  return w;
}

}  // namespace

int main(int argc, char** argv)
{
  using namespace tierstate;
  std::filesystem::path const dir = argc > 1 ? argv[1] : ".";
  AdamW::hyperparameters const h{.lr = lr, .weight_decay = decay};

  double pinned_first = 0, pinned_last = 0, nvme_first = 0, nvme_last = 0;
  OffloadedOptimizer<AdamW, Fp32, PinnedHost> pinned(h);
  std::vector<float> const wp = train(pinned, pinned_first, pinned_last);

  OffloadedOptimizer<AdamW, Fp32, NvmeFile, Pipelined<2>>::options o;
  o.tier.directory      = dir;
  o.chunk_elements      = 4096;  // three chunks, so that the pipeline has something to overlap
  OffloadedOptimizer<AdamW, Fp32, NvmeFile, Pipelined<2>> nvme(h, o);
  std::vector<float> const wn = train(nvme, nvme_first, nvme_last);

  std::vector<float> const wr = reference();
  std::size_t differ = 0;
  double worst = 0.0;
  for (std::size_t i = 0; i < n; ++i) {
    differ += wp[i] != wn[i];
    worst = std::fmax(worst, std::fabs(static_cast<double>(wp[i]) - wr[i]));
  }
  bool const ok = pinned_last < 0.5 * pinned_first && differ == 0 && worst < 1e-5;
  std::printf("tierstate %s with xsimd %d.%d: loss %.6g -> %.6g (PinnedHost), %.6g (NvmeFile); %zu elements differ "
              "between tiers; %.3g from plain AdamW: %s\n",
              TIERSTATE_VERSION_STRING, XSIMD_VERSION_MAJOR, XSIMD_VERSION_MINOR, pinned_first, pinned_last, nvme_last, differ, worst,
              ok ? "ok" : "WRONG");
  return ok ? 0 : 1;
}
