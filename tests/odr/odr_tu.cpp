// SPDX-License-Identifier: Apache-2.0
// Compiled several times into one program: for baseline x86-64 (SSE2, no FMA, no F16C), for
// the build machine (-march=native), and for AVX2 with FMA with and without F16C, and for
// AVX-512 with and without VBMI (tests/meson.build). Each instantiates the same kernels and the same optimizer
// through the same source text; if any configuration-dependent definition shared a mangled
// name, the linker would keep one and the other side would run its code (check_symbols.py
// looks for such a name in the objects).
#include "odr_tu.hpp"

#include <tierstate/tierstate.hpp>

#include <vector>

namespace tierstate::test {

odr_result ODR_FUNCTION()
{
  using namespace tierstate;
  std::size_t const n = 1003;
  std::vector<bf16> param(n), grad(n);
  std::vector<fp16> hparam(n), hgrad(n);
  std::vector<float> master(n), m(n), v(n), hmaster(n), hm(n), hv(n);
  for (std::size_t i = 0; i < n; ++i) {
    float const w = 0.25f + static_cast<float>(i % 97) * 0.01f;
    param[i]      = bf16(w);
    hparam[i]     = fp16(w);
    master[i]     = static_cast<float>(param[i]);
    hmaster[i]    = static_cast<float>(hparam[i]);
  }
  update_arrays<Bf16Mixed, 2> a{param.data(), grad.data(), master.data(), {m.data(), v.data()}};
  update_arrays<Fp16Mixed, 2> h{hparam.data(), hgrad.data(), hmaster.data(), {hm.data(), hv.data()}};
  thread_pool pool(2);
  AdamW::hyperparameters hp;
  for (int t = 1; t <= 20; ++t) {
    for (std::size_t i = 0; i < n; ++i) {
      float const g = static_cast<float>(static_cast<int>((i * 7 + static_cast<std::size_t>(t) * 13) % 101) - 50) * 1e-3f;
      grad[i]       = bf16(g);
      hgrad[i]      = fp16(g * 256.0f);
    }
    host::update<AdamW, Bf16Mixed>(pool, AdamW::coefficients_for(hp, t), a, n);
    host::update<AdamW, Fp16Mixed>(pool, AdamW::coefficients_for(hp, t, 256.0), h, n);
  }
  // The optimizer's members too (its step inlines the kernels): fp16 params from the same
  // start, 5 steps.
  std::vector<fp16> oparam(hparam.size());
  std::vector<fp16> ograd(hparam.size());
  for (std::size_t i = 0; i < n; ++i) {
    oparam[i] = fp16(0.25f + static_cast<float>(i % 89) * 0.01f);
    ograd[i]  = fp16(static_cast<float>(static_cast<int>(i % 103) - 51) * 1e-3f);
  }
  OffloadedOptimizer<AdamW, Fp16Mixed, PinnedHost, Synchronous> opt({}, {.chunk_elements = 2048, .threads = 2});
  opt.add_tensor("w", oparam.data(), n);
  grad_view<fp16> const og{ograd.data(), n};
  for (int t = 1; t <= 5; ++t) { opt.step({&og, 1}); }
  // And 8-bit moments, which each instruction set decodes and encodes its own way (AVX-512
  // VBMI: byte permutes to decode; AVX-512: rungs by arithmetic to encode; AVX2: gathers;
  // below: the tables lane by lane): bf16 params from the same start, 5 steps.
  std::vector<bf16> qparam(n);
  for (std::size_t i = 0; i < n; ++i) { qparam[i] = bf16(0.25f + static_cast<float>(i % 89) * 0.01f); }
  OffloadedOptimizer<AdamW, Bf16Mixed8bit, PinnedHost, Synchronous> qopt({}, {.chunk_elements = 2048, .threads = 2});
  qopt.add_tensor("w", qparam.data(), n);
  grad_view<bf16> const qg{grad.data(), n};
  for (int t = 1; t <= 5; ++t) { qopt.step({&qg, 1}); }
  odr_result r;
  r.arch = host::arch_name();
  for (std::size_t i = 0; i < n; ++i) { r.bits.push_back(oparam[i].bits); }
  for (std::size_t i = 0; i < n; ++i) { r.bits.push_back(qparam[i].bits); }
  for (std::size_t i = 0; i < n; ++i) {
    r.bits.push_back(param[i].bits);
    r.bits.push_back(hparam[i].bits);
    r.bits.push_back(detail::bits_of(master[i]));
    r.bits.push_back(detail::bits_of(hmaster[i]));
    r.bits.push_back(detail::bits_of(m[i]));
    r.bits.push_back(detail::bits_of(hv[i]));
  }
  return r;
}

}  // namespace tierstate::test
