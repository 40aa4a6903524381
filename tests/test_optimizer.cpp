// SPDX-License-Identifier: Apache-2.0
// OffloadedOptimizer on the host: bit-for-bit the bare kernel's results over several
// tensors and groups, whatever the chunk size, thread count and tier; custom tiers; the
// non-finite policy; copy_state; and a clear exception for every bad input.
#include "memory_tier.hpp"
#include "matrix.hpp"
#include "support.hpp"

#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <map>

using namespace tierstate;
using namespace tierstate::test;

namespace {

/// A user's own tier: plain memory behind read and write only (so the optimizer must stage
/// chunks), counting the bytes it moves.
class CountingTier {
 public:
  struct options {
    std::uint64_t* reads  = nullptr;
    std::uint64_t* writes = nullptr;
  };
  static constexpr std::string_view name = "CountingTier";

  CountingTier(std::size_t bytes, options const& o) : bytes_(bytes), opts_(o) {}
  [[nodiscard]] std::size_t size() const { return bytes_.size(); }
  void read(std::size_t offset, std::span<std::byte> to) const
  {
    REQUIRE(offset + to.size() <= bytes_.size());
    std::memcpy(to.data(), bytes_.data() + offset, to.size());
    if (opts_.reads) { *opts_.reads += to.size(); }
  }
  void write(std::size_t offset, std::span<std::byte const> from)
  {
    REQUIRE(offset + from.size() <= bytes_.size());
    std::memcpy(bytes_.data() + offset, from.data(), from.size());
    if (opts_.writes) { *opts_.writes += from.size(); }
  }

 private:
  std::vector<std::byte> bytes_;
  options opts_;
};
static_assert(tier<CountingTier> && !addressable_tier<CountingTier>);

/// Awkward tensor sizes: smaller than a batch, around chunk boundaries, and large.
std::vector<std::size_t> const sizes = {1, 7, 4095, 4097, 2048, 30011, 3};

template <class P>
struct model : test_model<P> {
  model() : test_model<P>(sizes) {}
};

template <class R>
typename R::hyperparameters group_hyperparameters(int g, int t)
{
  typename R::hyperparameters h;
  h.lr           = lr_at(g == 0 ? 1e-2 : 3e-3, t, 40);
  h.weight_decay = g == 0 ? 0.05 : 0.0;  // e.g. no decay for norms and biases
  if (g == 1) {
    if constexpr (requires { h.betas; }) {
      h.betas = {0.8, 0.99};
    } else if constexpr (R::slot_count == 1) {
      h.momentum  = 0.5;
      h.dampening = 0.2;
    } else {
      h.maximize = true;
    }
  }
  return h;
}

/// The same training with the bare kernel, tensor by tensor: the expected bits.
template <class R, class P>
model<P> bare_kernel(int steps, std::vector<int> const& group_of_tensor, std::vector<std::vector<float>>& masters,
                     std::vector<std::vector<std::vector<typename P::state_type>>>& states)
{
  model<P> m;
  thread_pool pool(1);
  masters.clear();
  states.clear();
  for (auto const& p : m.params) {
    masters.emplace_back(p.size());
    for (std::size_t i = 0; i < p.size(); ++i) { masters.back()[i] = convert<float>(p[i]); }
    states.emplace_back(R::slot_count, std::vector<typename P::state_type>(p.size(), convert<typename P::state_type>(0.0f)));
  }
  for (int t = 1; t <= steps; ++t) {
    m.fill_grads(t);
    for (std::size_t k = 0; k < m.params.size(); ++k) {
      update_arrays<P, R::slot_count> a;
      a.param  = m.params[k].data();
      a.grad   = m.grads[k].data();
      a.master = P::has_master ? masters[k].data() : nullptr;
      for (std::size_t j = 0; j < R::slot_count; ++j) { a.state[j] = states[k][j].data(); }
      auto const k_coeff = R::coefficients_for(group_hyperparameters<R>(group_of_tensor[k], t), t);
      host::update<R, P>(pool, k_coeff, a, m.params[k].size());
    }
  }
  return m;
}

template <class R, class P, class Tier>
void check_optimizer_matches_kernel(std::size_t chunk_elements, std::size_t threads,
                                    typename Tier::options tier_options = {})
{
  int const steps = 40;
  // Tensors 1 and 4 (a "bias" and a "norm") form group 1.
  std::vector<int> const group_of_tensor = {0, 1, 0, 0, 1, 0, 0};
  std::vector<std::vector<float>> masters;
  std::vector<std::vector<std::vector<typename P::state_type>>> states;
  auto const expected = bare_kernel<R, P>(steps, group_of_tensor, masters, states);

  model<P> m;
  typename OffloadedOptimizer<R, P, Tier>::options o;
  o.chunk_elements = chunk_elements;
  o.threads        = threads;
  o.tier           = tier_options;
  OffloadedOptimizer<R, P, Tier> opt(group_hyperparameters<R>(0, 1), o);
  for (std::size_t k = 0; k < m.params.size(); ++k) {
    CHECK(opt.add_tensor(tensor_name(k), m.params[k].data(), m.params[k].size()) == k);
  }
  auto const g1 = opt.add_group(group_hyperparameters<R>(1, 1), {"t1", "t4"});
  CHECK(g1 == 1);
  CHECK(opt.group_of("t4") == 1);
  for (int t = 1; t <= steps; ++t) {
    m.fill_grads(t);
    opt.set_hyperparameters(0, group_hyperparameters<R>(0, t));
    opt.set_hyperparameters(g1, group_hyperparameters<R>(1, t));
    auto const views = m.views();
    auto const r     = opt.step(views);
    REQUIRE_FALSE(r.found_nonfinite);
    REQUIRE(r.step == t);
  }
  CHECK(opt.step_count() == steps);

  std::size_t differ = 0;
  for (std::size_t k = 0; k < m.params.size(); ++k) {
    std::string const name = tensor_name(k);
    for (std::size_t i = 0; i < m.params[k].size(); ++i) {
      differ += bits(m.params[k][i]) != bits(expected.params[k][i]);
    }
    std::vector<float> got(m.params[k].size());
    if constexpr (P::has_master) {
      opt.copy_state(name, slot::master, std::span<float>(got));
      for (std::size_t i = 0; i < got.size(); ++i) { differ += bits(got[i]) != bits(masters[k][i]); }
    }
    for (std::size_t j = 0; j < R::slot_count; ++j) {
      opt.copy_state(name, R::slots[j], std::span<float>(got));
      for (std::size_t i = 0; i < got.size(); ++i) {
        differ += bits(convert<typename P::state_type>(got[i])) != bits(states[k][j][i]);
      }
    }
  }
  INFO(R::name << " " << P::name() << " on " << Tier::name << ", chunks of " << chunk_elements
               << ", " << threads << " threads");
  CHECK(differ == 0);
}

}  // namespace

TEMPLATE_LIST_TEST_CASE("the optimizer gives the bare kernel's bits for any chunk size, thread count and tier",
                        "[optimizer]", matrix::rules_x_precisions)
{
  using R = typename TestType::first_type;
  using P = typename TestType::second_type;
  for (std::size_t const chunk : {std::size_t{2048}, std::size_t{6144}, std::size_t{1} << 20}) {
    for (std::size_t const threads : {std::size_t{1}, std::size_t{3}}) {
      check_optimizer_matches_kernel<R, P, PinnedHost>(chunk, threads);
    }
  }
  std::uint64_t reads = 0, writes = 0;
  check_optimizer_matches_kernel<R, P, CountingTier>(4096, 2, {&reads, &writes});
  if constexpr (R::slot_count > 0 || P::has_master) {
    CHECK(reads > 0);
    CHECK(writes > 0);
  } else {  // plain SGD on fp32 params keeps no state: the tier is never touched
    CHECK(reads == 0);
    CHECK(writes == 0);
  }
}

TEST_CASE("a custom tier moves exactly the layout's bytes per step", "[optimizer][tier]")
{
  std::uint64_t reads = 0, writes = 0;
  std::vector<bf16> w(10000, bf16(1.0f)), g(10000, bf16(0.5f));
  OffloadedOptimizer<AdamW, Bf16Mixed, CountingTier>::options o;
  o.chunk_elements = 4096;
  o.tier           = {&reads, &writes};
  OffloadedOptimizer<AdamW, Bf16Mixed, CountingTier> opt({}, o);
  opt.add_tensor("w", w.data(), w.size());
  std::vector<grad_view<bf16>> views = {{g.data(), g.size(), location::host}};
  opt.step(views);  // makes the state, then steps
  reads = writes = 0;
  auto const r = opt.step(views);
  std::uint64_t const chunk_bytes = 4096 * (4 + 4 + 4);  // master, m, v
  CHECK(opt.state_layout().chunk_count() == 3);
  CHECK(reads == 3 * chunk_bytes);
  CHECK(writes == 3 * chunk_bytes);
  CHECK(r.stats.tier_bytes_read == reads);
  CHECK(r.stats.tier_bytes_written == writes);
  CHECK(r.stats.chunks == 3);
  CHECK(r.stats.total_seconds >= r.stats.compute_seconds);
}

TEST_CASE("non-finite gradients are found and the step is skipped, as GradScaler expects", "[optimizer]")
{
  std::vector<fp16> w(5000, fp16(1.0f)), g(5000, fp16(0.25f));
  OffloadedOptimizer<AdamW, Fp16Mixed> opt;
  opt.add_tensor("w", w.data(), w.size());
  std::vector<grad_view<fp16>> views = {{g.data(), g.size(), location::host}};
  auto r = opt.step(views, 1024.0);
  CHECK_FALSE(r.found_nonfinite);
  CHECK(r.step == 1);
  std::vector<fp16> const before = w;
  std::vector<float> m_before(w.size()), m_after(w.size());
  opt.copy_state("w", slot::exp_avg, std::span<float>(m_before));

  g[4321] = fp16(std::numeric_limits<float>::infinity());
  r       = opt.step(views, 1024.0);
  CHECK(r.found_nonfinite);
  CHECK(r.skipped);
  CHECK(r.step == 1);
  CHECK(opt.step_count() == 1);
  opt.copy_state("w", slot::exp_avg, std::span<float>(m_after));
  CHECK(std::memcmp(m_before.data(), m_after.data(), m_before.size() * sizeof(float)) == 0);
  CHECK(std::memcmp(before.data(), w.data(), w.size() * sizeof(fp16)) == 0);

  g[4321] = fp16::from_bits(0x7e00);  // NaN
  CHECK(opt.step(views).skipped);
  g[4321] = fp16(0.25f);
  r = opt.step(views);
  CHECK_FALSE(r.found_nonfinite);
  CHECK(r.step == 2);
}

TEST_CASE("write_state and copy_state write and read every slot through the tier", "[optimizer]")
{
  std::vector<bf16> w(3000, bf16(0.5f));
  OffloadedOptimizer<AdamWAmsgrad, Bf16MixedBf16State> opt;
  opt.add_tensor("a", w.data(), 1000);
  opt.add_tensor("b", w.data() + 1000, 2000);
  std::vector<float> in(2000), out(2000);
  for (std::size_t i = 0; i < in.size(); ++i) { in[i] = static_cast<float>(bf16(static_cast<float>(i) * 0.25f)); }
  for (slot const s : {slot::master, slot::exp_avg, slot::exp_avg_sq, slot::max_exp_avg_sq}) {
    opt.write_state("b", s, in);
    opt.copy_state("b", s, out);
    CHECK(in == out);
  }
  std::vector<float> a(1000);
  opt.copy_state("a", slot::master, std::span<float>(a));
  CHECK(a[999] == 0.5f);  // the master starts as the param
  OffloadedOptimizer<AdamW, Fp32> fp32;
  std::vector<float> p(10);
  fp32.add_tensor("p", p.data(), p.size());
  std::vector<float> ten(10);
  CHECK_THROWS_WITH(fp32.copy_state("p", slot::master, std::span<float>(ten)),
                    Catch::Contains("no slot master"));
}

TEST_CASE("state moved with copy_state, write_state and set_step_count steps on as the original",
          "[optimizer]")
{
  // How state comes in from elsewhere (a torch.optim.AdamW state_dict): the slots through
  // write_state, the step count through set_step_count. The next step must be the original's.
  std::size_t const n = 7001;
  std::vector<float> w(n), g(n);
  for (std::size_t i = 0; i < n; ++i) {
    w[i] = std::sin(static_cast<float>(i)) * 0.5f;
    g[i] = std::cos(static_cast<float>(i) * 0.37f) * 1e-2f;
  }
  std::vector<float> w2;
  OffloadedOptimizer<AdamW, Fp32> a({.lr = 1e-2, .weight_decay = 0.1});
  a.add_tensor("w", w.data(), n);
  std::vector<grad_view<float>> views = {{g.data(), n, location::host}};
  for (int s = 0; s < 3; ++s) { (void)a.step(views); }

  w2 = w;
  OffloadedOptimizer<AdamW, Fp32> b({.lr = 1e-2, .weight_decay = 0.1});
  b.add_tensor("w", w2.data(), n);
  std::vector<float> buf(n);
  for (slot const s : AdamW::slots) {
    a.copy_state("w", s, std::span<float>(buf));
    b.write_state("w", s, buf);
  }
  CHECK_THROWS_WITH(b.set_step_count(-1), Catch::Contains("step_count") && Catch::Contains("-1"));
  b.set_step_count(3);
  CHECK(b.step_count() == 3);
  CHECK(a.step(views).step == 4);
  CHECK(b.step(views).step == 4);
  CHECK(std::memcmp(w.data(), w2.data(), n * sizeof(float)) == 0);
  b.set_step_count(0);  // a different bias correction: the params part
  std::vector<float> const before = w2;
  (void)a.step(views);
  (void)b.step(views);
  CHECK(std::memcmp(w.data(), w2.data(), n * sizeof(float)) != 0);
  CHECK(w2 != before);
}

TEST_CASE("bad input gets a clear exception that names what was wrong", "[optimizer][errors]")
{
  using Opt = OffloadedOptimizer<AdamW, Bf16Mixed>;
  std::vector<bf16> w(100), g(100);
  std::vector<grad_view<bf16>> one = {{g.data(), g.size(), location::host}};

  SECTION("hyper-parameters outside what PyTorch accepts")
  {
    AdamW::hyperparameters h;
    h.lr = -1;
    CHECK_THROWS_WITH(Opt(h), Catch::Contains("adamw.lr = -1"));
    Opt opt;
    opt.add_tensor("w", w.data(), w.size());
    h    = {};
    h.betas[1] = 1.5;
    CHECK_THROWS_WITH(opt.set_hyperparameters(0, h), Catch::Contains("adamw.betas[1] = 1.5"));
    CHECK_THROWS_WITH(opt.add_group(h, {"w"}), Catch::Contains("adamw.betas[1] = 1.5"));
    CHECK_THROWS_AS(opt.step(one, 0.0), invalid_option);
    CHECK(opt.step_count() == 0);
  }
  SECTION("options")
  {
    Opt::options o;
    o.chunk_elements = 1000;
    CHECK_THROWS_WITH(Opt({}, o), Catch::Contains("chunk_elements = 1000"));
    o.chunk_elements = 2047;
    CHECK_THROWS_WITH(Opt({}, o), Catch::Contains("chunk_elements = 2047") && Catch::Contains("multiple of 2048"));
    o.chunk_elements = 0;  // the default
    CHECK_NOTHROW(Opt({}, o));
    o = {};
    o.threads = 100000;
    CHECK_THROWS_WITH(Opt({}, o), Catch::Contains("threads = 100000"));
  }
  SECTION("null pointer, duplicate name, device param")
  {
    Opt opt;
    CHECK_THROWS_WITH(opt.add_tensor("w", nullptr, 10), Catch::Contains("'w'") && Catch::Contains("null"));
    opt.add_tensor("w", w.data(), w.size());
    CHECK_THROWS_WITH(opt.add_tensor("w", w.data(), w.size()), Catch::Contains("already registered"));
    CHECK_THROWS_WITH(opt.add_tensor("", w.data(), w.size()), Catch::Contains("empty"));
    CHECK_THROWS_WITH(opt.add_tensor("d", w.data(), w.size(), location::device),
                      Catch::Contains("device"));
  }
  SECTION("step before any tensor")
  {
    Opt opt;
    std::vector<grad_view<bf16>> none;
    CHECK_THROWS_WITH(opt.step(none), Catch::Contains("no tensor is registered"));
  }
  SECTION("gradient views that do not match")
  {
    Opt opt;
    opt.add_tensor("w", w.data(), w.size());
    opt.add_tensor("v", w.data(), 50);
    CHECK_THROWS_WITH(opt.step(one), Catch::Contains("1 gradient views for 2 registered tensors"));
    std::vector<grad_view<bf16>> two = {{g.data(), 100, location::host}, {g.data(), 49, location::host}};
    CHECK_THROWS_WITH(opt.step(two), Catch::Contains("'v'") && Catch::Contains("49 elements"));
    two[1] = {g.data(), 50, location::device};
    CHECK_THROWS_WITH(opt.step(two), Catch::Contains("'v'") && Catch::Contains("device"));
    two[1] = {nullptr, 50, location::host};
    CHECK_THROWS_WITH(opt.step(two), Catch::Contains("'v'") && Catch::Contains("null"));
    CHECK(opt.step_count() == 0);
  }
  SECTION("groups that name no tensor, or a tensor twice")
  {
    Opt opt;
    opt.add_tensor("w", w.data(), w.size());
    CHECK_THROWS_WITH(opt.add_group({}, {}), Catch::Contains("names no tensor"));
    CHECK_THROWS_WITH(opt.add_group({}, {"nope"}), Catch::Contains("'nope'"));
    opt.add_group({}, {"w"});
    CHECK_THROWS_WITH(opt.add_group({}, {"w"}), Catch::Contains("already in group 1"));
    CHECK_THROWS_WITH(opt.set_hyperparameters(7, {}), Catch::Contains("no group 7"));
  }
  SECTION("tensors after the state exists")
  {
    Opt opt;
    opt.add_tensor("w", w.data(), w.size());
    opt.step(one);
    CHECK_THROWS_WITH(opt.add_tensor("late", w.data(), 10), Catch::Contains("fixed"));
  }
}

TEST_CASE("a tier failing while the state is made leaves no half-made state", "[optimizer][errors]")
{
  int budget = 1;  // the second chunk's write fails
  std::vector<bf16> w(5000), g(5000, bf16(0.5f));
  for (std::size_t i = 0; i < w.size(); ++i) { w[i] = bf16(static_cast<float>(i) * 1e-3f); }
  OffloadedOptimizer<AdamW, Bf16Mixed, test::memory_tier>::options o;
  o.chunk_elements = 2048;
  o.tier           = {&budget, {}};
  OffloadedOptimizer<AdamW, Bf16Mixed, test::memory_tier> opt({}, o);
  opt.add_tensor("w", w.data(), w.size());
  std::vector<grad_view<bf16>> views = {{g.data(), g.size()}};
  CHECK_THROWS_WITH(opt.step(views), "memory_tier: write failed");
  CHECK(opt.step_count() == 0);
  budget = 1000;
  std::vector<float> master(w.size());
  opt.copy_state("w", slot::master, master);  // made afresh, from the params
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < w.size(); ++i) { wrong += master[i] != static_cast<float>(w[i]); }
  CHECK(wrong == 0);
  CHECK(opt.step(views).step == 1);
}
