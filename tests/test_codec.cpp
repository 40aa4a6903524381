// SPDX-License-Identifier: Apache-2.0
// Storage codecs: a block codec written in the tests alone (tests/block_codec.hpp) carried
// by the library through every host route: its state is what a plain loop over its blocks
// makes, bit for bit, on PinnedHost and NvmeFile, with plain and streaming steps, for any
// chunk size and thread count; copy_state and write_state decode and encode whole blocks;
// checkpoints move it between tiers. (The device routes: test_device.cpp.)
#include "block_codec.hpp"
#include <tierstate/codecs/dynamic8.hpp>
#include "nvme_support.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace {

using namespace tierstate;
using namespace tierstate::test;

/// Stores `v` (one tensor's slot, tensor-relative) with codec C and reads it back, block by
/// block from the tensor's first element: what the optimizer keeps.
template <class C>
void store_and_load(std::span<float> v)
{
  if constexpr (block_codec<C>) {
    std::vector<std::byte> bytes(C::block_bytes);
    for (std::size_t b = 0; b < v.size(); b += C::block) {
      std::size_t const n = std::min(C::block, v.size() - b);
      C::encode(v.data() + b, n, bytes.data());
      C::decode(bytes.data(), v.data() + b, n);
    }
  } else {
    for (float& x : v) { x = convert<float>(convert<typename C::element_type>(x)); }
  }
}

/// The run tests/nvme_support.hpp's train() makes (the same model, groups and schedule),
/// written as a plain loop: each element updated by the rule's own text on floats, then each
/// slot stored with its codec (and, for Compensated, the param's rounding error kept).
template <class P>
run_result plain(int steps)
{
  using Opt = HostOpt<P>;
  using R   = typename Opt::rule_type;
  nvme_model<P> m;
  std::size_t const T = m.params.size();
  std::vector<std::vector<float>> master(T), comp(T), s0(T), s1(T);
  for (std::size_t k = 0; k < T; ++k) {
    for (auto const p : m.params[k]) { master[k].push_back(convert<float>(p)); }
    comp[k].assign(m.params[k].size(), 0.0f);
    s0[k].assign(m.params[k].size(), 0.0f);
    s1[k].assign(m.params[k].size(), 0.0f);
  }
  typename Opt::hyperparameters fixed;  // group 1: t1 and t4 (register_model)
  fixed.lr           = 3e-3;
  fixed.betas        = {0.8, 0.99};
  fixed.weight_decay = 0.0;
  for (int t = 1; t <= steps; ++t) {
    m.fill_grads(t);
    for (std::size_t k = 0; k < T; ++k) {
      auto const h = k == 1 || k == 4 ? fixed : schedule<Opt>(t);
      auto const c = R::coefficients_for(h, t, 1.0);
      for (std::size_t i = 0; i < master[k].size(); ++i) {
        float s[2] = {s0[k][i], s1[k][i]};
        if constexpr (P::has_compensation) {  // the weight is param + compensation
          float w = convert<float>(m.params[k][i]) + comp[k][i];
          R::update(c, w, convert<float>(m.grads[k][i]), s);
          m.params[k][i] = convert<typename P::param_type>(w);
          comp[k][i]     = convert<float>(convert<bf16>(w - convert<float>(m.params[k][i])));
        } else if constexpr (P::has_stochastic_rounding) {  // the param is the weight, rounded with its bits
          float w = convert<float>(m.params[k][i]);
          R::update(c, w, convert<float>(m.grads[k][i]), s);
          m.params[k][i] = bf16::from_bits(codecs::round_stochastic_bf16(w, codecs::rounding_key(0, t, k), i));
        } else {
          R::update(c, master[k][i], convert<float>(m.grads[k][i]), s);
          m.params[k][i] = convert<typename P::param_type>(master[k][i]);
        }
        s0[k][i] = s[0];
        s1[k][i] = s[1];
      }
      store_and_load<typename P::template state_codec<0>>(s0[k]);
      store_and_load<typename P::template state_codec<1>>(s1[k]);
    }
  }
  run_result r;
  r.steps = steps;
  for (auto const& p : m.params) {
    r.params.emplace_back();
    for (auto const x : p) {
      if constexpr (sizeof(x) == 4) {
        r.params.back().push_back(std::bit_cast<std::uint32_t>(x));
      } else {
        r.params.back().push_back(x.bits);
      }
    }
  }
  if constexpr (P::has_master) { r.slots.push_back(master); }
  if constexpr (P::has_compensation) { r.slots.push_back(comp); }
  r.slots.push_back(s0);
  r.slots.push_back(s1);
  return r;
}

}  // namespace

TEMPLATE_TEST_CASE("a block codec's state is what a plain loop over its blocks makes, for any chunk size and thread count",
                   "[codec]", Bf16MixedInt8M, Fp32Int8M, Bf16Compensated, Bf16Mixed8bit, Fp32With8bitState,
                   Bf16Stochastic, (Precision<bf16, bf16, StochasticRounding, slot_codecs<codecs::dynamic8, codecs::udynamic8>>))
{
  using P         = TestType;
  auto const want = plain<P>(12);
  // The codec moves the numbers (else this test would not tell it is there).
  CHECK(want != plain<Precision<typename P::param_type, typename P::grad_type, float, float>>(12));
  for (std::size_t const chunk : {std::size_t{2048}, std::size_t{6144}, std::size_t{1} << 20}) {
    for (std::size_t const threads : {std::size_t{1}, std::size_t{2}}) {
      INFO("chunk_elements " << chunk << ", threads " << threads);
      CHECK(train<HostOpt<P>>(12, chunked<HostOpt<P>>(chunk, threads)) == want);
      CHECK(train<HostOpt<P>>(12, chunked<HostOpt<P>>(chunk, threads), true) == want);  // streaming steps
    }
  }
}

TEMPLATE_TEST_CASE("a block codec's state staged through NvmeFile gives the same bits", "[codec][nvme]", Bf16MixedInt8M,
                   Fp32Int8M, Bf16Compensated, Bf16Mixed8bit, Bf16Stochastic)
{
  using P = TestType;
  scratch_dir d;
  auto const want = plain<P>(12);
  NvmeFile::options tier;
  tier.directory = d.path;
  for (std::size_t const chunk : {std::size_t{2048}, std::size_t{16384}}) {
    INFO("chunk_elements " << chunk);
    CHECK(on_nvme<P, Pipelined<2>>(12, chunk, tier) == want);
    CHECK(on_nvme<P, Synchronous>(12, chunk, tier, 1) == want);
    auto o = chunked<NvmeOpt<P>>(chunk);
    o.tier = tier;
    CHECK(train<NvmeOpt<P>>(12, o, true) == want);  // streaming steps
  }
}

TEST_CASE("a block codec's layout: tensors start on whole blocks, and its slots take their encoded bytes", "[codec]")
{
  using P = Bf16MixedInt8M;
  nvme_model<P> m;
  HostOpt<P> opt(HostOpt<P>::hyperparameters{}, chunked<HostOpt<P>>(4096));
  register_model(opt, m);
  auto const& lay = opt.state_layout();
  CHECK(lay.tensor_alignment() == 256);
  std::size_t expected_offset = 0;
  for (std::size_t t = 0; t < m.params.size(); ++t) {
    expected_offset = (expected_offset + 255) / 256 * 256;
    CHECK(lay.tensors()[t].offset == expected_offset);
    expected_offset += m.params[t].size();
  }
  // master fp32, m as 16 blocks of 4 + 256 bytes (rounded up to 4 KiB), v fp32
  CHECK(lay.slot_block_bytes(1) == 260);
  CHECK(lay.chunk_bytes() == 4096 * 4 + 8192 + 4096 * 4);
  CHECK(P::name() == "bf16/bf16/fp32/(test_absmax_int8_256,fp32)");
}

TEST_CASE("the default chunk (chunk_elements 0) is 2^20 elements whatever the precision", "[codec][layout]")
{
  auto chunk_of = [&]<class P>(P) {
    std::vector<typename P::param_type> w((std::size_t{3} << 20) + 5);  // larger than a chunk
    HostOpt<P> opt(typename HostOpt<P>::hyperparameters{}, {});
    opt.add_tensor("w", w.data(), w.size());
    auto const& lay = opt.state_layout();
    return std::pair(lay.chunk_elements(), lay.chunk_bytes());
  };
  constexpr std::size_t M = std::size_t{1} << 20;
  CHECK(chunk_of(Bf16Mixed{}) == std::pair(M, 12 * M));  // master, m, v
  CHECK(chunk_of(Fp32{}) == std::pair(M, 8 * M));        // m, v
  // an fp32 master, and 8-bit m and v: 4096 blocks of 256 values and a 4-byte scale each
  CHECK(chunk_of(Bf16Mixed8bit{}) == std::pair(M, 4 * M + 2 * (M + 4096 * 4)));
  // A model smaller than the chunk gets one chunk of its own size, as with a chunk asked for.
  nvme_model<Bf16Mixed8bit> m;
  HostOpt<Bf16Mixed8bit> small(HostOpt<Bf16Mixed8bit>::hyperparameters{}, {});
  register_model(small, m);
  CHECK(small.state_layout().chunk_count() == 1);
  CHECK(small.state_layout().chunk_elements() < 65536);
}

TEMPLATE_TEST_CASE("write_state encodes whole blocks and copy_state decodes them", "[codec]", Bf16MixedInt8M, Fp32Int8M, Bf16Mixed8bit)
{
  using P = TestType;
  using C = typename P::template state_codec<0>;
  nvme_model<P> m;
  HostOpt<P> opt(typename HostOpt<P>::hyperparameters{}, chunked<HostOpt<P>>(2048));
  register_model(opt, m);
  for (std::size_t t = 0; t < m.params.size(); ++t) {
    INFO("tensor " << t << " of " << m.params[t].size() << " elements");
    std::vector<float> v(m.params[t].size());
    for (std::size_t i = 0; i < v.size(); ++i) { v[i] = std::sin(0.1f * static_cast<float>(i + t)) * 1e-3f; }
    opt.write_state(tensor_name(t), slot::exp_avg, v);
    std::vector<float> got(v.size());
    opt.copy_state(tensor_name(t), slot::exp_avg, got);
    auto want = v;
    store_and_load<C>(want);
    CHECK(got == want);
    if (v.size() > 64) { CHECK(got != v); }  // 8 bits lose something
    opt.write_state(tensor_name(t), slot::exp_avg, got);  // a decoded state encodes to itself
    std::vector<float> again(v.size());
    opt.copy_state(tensor_name(t), slot::exp_avg, again);
    CHECK(again == got);
  }
  // Writing one tensor's blocks leaves its neighbours' alone.
  std::vector<float> before(m.params[2].size()), after(m.params[2].size());
  opt.copy_state(tensor_name(2), slot::exp_avg, before);
  std::vector<float> ones(m.params[1].size(), 1.0f);
  opt.write_state(tensor_name(1), slot::exp_avg, ones);
  opt.copy_state(tensor_name(2), slot::exp_avg, after);
  CHECK(before == after);
}

TEMPLATE_TEST_CASE("a block codec's checkpoint moves between tiers and resumes exactly", "[codec][checkpoint]",
                   Bf16MixedInt8M, Fp32Int8M, Bf16Compensated, Bf16Mixed8bit, Bf16Stochastic)
{
  using P = TestType;
  scratch_dir d;
  auto const want = plain<P>(10);

  // 4 steps on PinnedHost, saved; the rest on NvmeFile from the checkpoint.
  nvme_model<P> ma;
  HostOpt<P> a(schedule<HostOpt<P>>(1), chunked<HostOpt<P>>(6144));
  register_model(a, ma);
  for (int t = 1; t <= 4; ++t) {
    ma.fill_grads(t);
    a.set_hyperparameters(0, schedule<HostOpt<P>>(t));
    a.step(ma.views());
  }
  a.save(d.path / "ckpt");

  nvme_model<P> mb;
  mb.params = ma.params;  // the model's params are the caller's (with fp32, they are the master)
  auto o = chunked<NvmeOpt<P>>(6144);
  o.tier.directory = d.path;
  NvmeOpt<P> b(schedule<NvmeOpt<P>>(1), o);
  register_model(b, mb);
  b.load(d.path / "ckpt");
  for (int t = 5; t <= 10; ++t) {
    mb.fill_grads(t);
    b.set_hyperparameters(0, schedule<NvmeOpt<P>>(t));
    b.step(mb.views());
  }
  CHECK(snapshot(b, mb) == want);

  // The same model with another state format refuses the checkpoint, naming the precision.
  using Plain = OffloadedOptimizer<AdamW, Precision<typename P::param_type, typename P::grad_type>, PinnedHost>;
  nvme_model<P> mc;
  Plain c(typename Plain::hyperparameters{}, chunked<Plain>(6144));
  register_model(c, mc);
  CHECK_THROWS_WITH(c.load(d.path / "ckpt"), Catch::Contains("precision") && Catch::Contains(P::name()));
}

TEST_CASE("Compensated: bf16 params with a compensation slot follow an fp32 master, where bf16 alone would not",
          "[codec][compensated]")
{
  // The model's gradients do not depend on its params, so m and v are the same in both runs
  // and the weights differ only by how they are kept: param + compensation against the fp32
  // master of Bf16Mixed.
  auto const comp   = train<HostOpt<Bf16Compensated>>(60, chunked<HostOpt<Bf16Compensated>>(2048));
  auto const master = train<HostOpt<Bf16Mixed>>(60, chunked<HostOpt<Bf16Mixed>>(2048));
  REQUIRE(comp.slots.size() == 3);  // compensation, m, v
  CHECK(comp.slots[1] == master.slots[1]);
  CHECK(comp.slots[2] == master.slots[2]);
  double worst_with = 0.0, worst_without = 0.0;
  bool any_compensation = false;
  for (std::size_t t = 0; t < comp.params.size(); ++t) {
    for (std::size_t i = 0; i < comp.params[t].size(); ++i) {
      float const p   = convert<float>(bf16::from_bits(static_cast<std::uint16_t>(comp.params[t][i])));
      float const c   = comp.slots[0][t][i];
      double const w  = master.slots[0][t][i];
      double const at = std::max(std::fabs(w), 1e-2);
      worst_with      = std::max(worst_with, std::fabs(p + c - w) / at);
      worst_without   = std::max(worst_without, std::fabs(p - w) / at);
      any_compensation = any_compensation || c != 0.0f;
    }
  }
  INFO("worst relative error: param + compensation " << worst_with << ", param alone " << worst_without);
  CHECK(any_compensation);
  // (each step's compensation is rounded to bf16: at most 2^-18 of the weight lost per step)
  CHECK(worst_with < 60 * std::ldexp(1.0, -18));
  CHECK(worst_without > 10 * worst_with);  // bf16 alone keeps 8 bits: the compensation does the work
}

TEST_CASE("Compensated keeps no master: asking for one says what it keeps instead", "[codec][compensated]")
{
  nvme_model<Bf16Compensated> m;
  HostOpt<Bf16Compensated> opt(HostOpt<Bf16Compensated>::hyperparameters{}, chunked<HostOpt<Bf16Compensated>>(2048));
  register_model(opt, m);
  std::vector<float> v(m.params[0].size());
  CHECK_THROWS_WITH(opt.copy_state(tensor_name(0), slot::master, v), Catch::Contains("slot compensation"));
  CHECK_NOTHROW(opt.copy_state(tensor_name(0), slot::compensation, v));
  CHECK(Bf16Compensated::name() == "bf16/bf16/comp/fp32");
  CHECK(opt.state_layout().chunk_bytes() == 2048 * (2 + 4 + 4));  // 10 bytes per element, not 12
}

TEST_CASE("StochasticRounding: bf16 params follow an fp32 master on average, where rounding to nearest would not",
          "[codec][stochastic]")
{
  // Updates of 1e-4 against a bf16 ulp of 2^-7 at 1.0: rounded to nearest, every one is lost.
  using Opt = OffloadedOptimizer<AdamW, Bf16Stochastic, PinnedHost>;
  std::size_t const n = 1 << 14;
  Opt::hyperparameters h;
  h.lr           = 1e-4;
  h.weight_decay = 0.0;
  Opt::options o;
  o.rounding_seed = 12345;
  Opt opt(h, o);
  std::vector<bf16> p(n, convert<bf16>(1.0f)), g(n, convert<bf16>(1.0f));
  opt.add_tensor("w", p.data(), n);
  std::vector<grad_view<bf16>> const v{{g.data(), n, location::host}};
  int const steps = 50;
  for (int t = 0; t < steps; ++t) { opt.step(v); }
  double sum = 0.0;
  std::size_t moved = 0;
  for (auto const x : p) {
    sum += convert<float>(x);
    moved += convert<float>(x) != 1.0f;
  }
  double const mean = sum / n, exact = 1.0 - steps * 1e-4;  // Adam's step is lr with a constant gradient
  INFO("mean " << mean << ", exact " << exact << ", " << moved << " of " << n << " moved");
  // Each param ends within an ulp or two of exact, at random: the mean's error is about
  // ulp / sqrt(n) = 6e-5; round to nearest would leave it at 1.0, 5e-3 away.
  CHECK(std::fabs(mean - exact) < 5e-4);
  CHECK(moved > n / 2);
  CHECK(Bf16Stochastic::name() == "bf16/bf16/sr/fp32");
  CHECK(opt.state_layout().chunk_bytes() == opt.state_layout().chunk_elements() * 8);  // m and v only
  std::vector<float> out(n);
  CHECK_THROWS_WITH(opt.copy_state("w", slot::master, out), Catch::Contains("rounded stochastically"));

  // Another seed rounds otherwise; the same seed the same.
  auto run = [&](std::uint64_t seed, bool delayed = false) {
    Opt::options os;
    os.rounding_seed  = seed;
    os.delayed_update = delayed;
    Opt other(h, os);
    std::vector<bf16> q(n, convert<bf16>(1.0f));
    other.add_tensor("w", q.data(), n);
    for (int t = 0; t < steps; ++t) { other.step(v); }
    other.flush();
    std::vector<std::uint16_t> b;
    for (auto const x : q) { b.push_back(x.bits); }
    return b;
  };
  std::vector<std::uint16_t> mine;
  for (auto const x : p) { mine.push_back(x.bits); }
  CHECK(run(12345) == mine);
  CHECK(run(12345, true) == mine);  // the delayed update rounds each step as the plain one
  CHECK(run(54321) != mine);
}
