// SPDX-License-Identifier: Apache-2.0
// A user's own rule, written in this file against rules/rule.hpp alone (nothing Adam has
// beyond what the concept asks: no slot_count, no validate, no to_values): heavy-ball
// momentum, with Nesterov's variant as a flag. It runs in place on PinnedHost and staged
// through NvmeFile with Pipelined<2>, bit for bit as a plain loop over floats; its
// hyper-parameters are validated from its table; its checkpoint round-trips.
#include "nvme_support.hpp"
#include "row_column_rule.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace {

using namespace tierstate;
using namespace tierstate::test;

struct Momentum {
  static constexpr std::string_view name = "test_momentum";
  static constexpr std::array<slot, 1> slots{slot{"momentum_buffer"}};  // a name of its own, as torch.optim.SGD
  struct hyperparameters {
    double lr       = 0.01;
    double momentum = 0.9;
    bool nesterov   = false;
  };
  static constexpr std::array<hyperparameter<hyperparameters>, 3> hyperparameter_table{{
    {"lr", [](hyperparameters const& h) noexcept { return h.lr; },
     [](hyperparameters& h, double v) noexcept { h.lr = v; }, value_range::at_least(0.0),
     "the learning rate must be >= 0"},
    {"momentum", [](hyperparameters const& h) noexcept { return h.momentum; },
     [](hyperparameters& h, double v) noexcept { h.momentum = v; }, value_range::half_open(0.0, 1.0),
     "momentum must be in [0, 1)"},
    {"nesterov", [](hyperparameters const& h) noexcept { return h.nesterov ? 1.0 : 0.0; },
     [](hyperparameters& h, double v) noexcept { h.nesterov = v != 0.0; }, value_range::boolean(),
     "must be 0 or 1"},
  }};
  struct coefficients {
    float grad_mul;
    float neg_lr;
    float momentum;
    bool nesterov;
  };
  static coefficients coefficients_for(hyperparameters const& h, std::int64_t, double grad_scale)
  {
    validate_hyperparameters<Momentum>(h);
    return {static_cast<float>(1.0 / grad_scale), static_cast<float>(-h.lr), static_cast<float>(h.momentum),
            h.nesterov};
  }
  template <class V>
  TIERSTATE_HOST_DEVICE static void update(coefficients const& k, V& w, V g, V (&s)[1]) noexcept
  {
    g           = math::fma(g, V(k.grad_mul), V(0.0f));
    V& m        = s[0];
    m           = math::fma(V(k.momentum), m, g);
    V const dir = k.nesterov ? math::fma(V(k.momentum), m, g) : m;
    w           = math::fma(V(k.neg_lr), dir, w);
  }
};
static_assert(rule<Momentum>);

constexpr std::array<std::size_t, 3> sizes = {3001, 1, 5000};  // 9002 elements in 5 chunks  // awkward: tails, a lone element, chunk spans

float grad_at(int step, std::size_t t, std::size_t i)
{
  return std::sin(0.37f * static_cast<float>(step) + 0.011f * static_cast<float>(i) + static_cast<float>(t));
}

/// What the optimizer must compute: the rule's own text on floats, element by element.
std::vector<std::vector<float>> plain(int steps, Momentum::hyperparameters const& h, double scale)
{
  std::vector<std::vector<float>> w, m;
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    w.emplace_back(sizes[t]);
    m.emplace_back(sizes[t], 0.0f);
    for (std::size_t i = 0; i < sizes[t]; ++i) { w[t][i] = 0.001f * static_cast<float>(i % 97) - 0.05f; }
  }
  for (int s = 1; s <= steps; ++s) {
    auto const k = Momentum::coefficients_for(h, s, scale);
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      for (std::size_t i = 0; i < sizes[t]; ++i) {
        float st[1] = {m[t][i]};
        Momentum::update(k, w[t][i], grad_at(s, t, i) * static_cast<float>(scale), st);
        m[t][i] = st[0];
      }
    }
  }
  return w;
}

template <class Opt>
struct model {
  std::vector<std::vector<float>> w, g;

  explicit model(Opt& opt)
  {
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      w.emplace_back(sizes[t]);
      g.emplace_back(sizes[t]);
      for (std::size_t i = 0; i < sizes[t]; ++i) { w[t][i] = 0.001f * static_cast<float>(i % 97) - 0.05f; }
      opt.add_tensor("t" + std::to_string(t), w[t].data(), sizes[t]);
    }
  }
  void steps(Opt& opt, int from, int to, double scale)
  {
    for (int s = from; s <= to; ++s) {
      std::vector<grad_view<float>> views;
      for (std::size_t t = 0; t < sizes.size(); ++t) {
        for (std::size_t i = 0; i < sizes[t]; ++i) { g[t][i] = grad_at(s, t, i) * static_cast<float>(scale); }
        views.push_back({g[t].data(), g[t].size()});
      }
      opt.step(views, scale);
    }
  }
};

template <class Opt>
typename Opt::options small_chunks(typename Opt::options o = {})
{
  o.chunk_elements = 2048;  // several chunks per tensor (5000 elements), and chunks spanning tensors
  o.threads        = 2;
  return o;
}

}  // namespace

TEST_CASE("a user's rule validates from its table", "[rules][user_rule]")
{
  Momentum::hyperparameters h;
  h.momentum = 1.0;
  try {
    validate_hyperparameters<Momentum>(h);
    FAIL("momentum 1 accepted");
  } catch (invalid_option const& e) {
    CHECK(e.option() == "test_momentum.momentum");
    CHECK(e.value() == "1");
    CHECK_THAT(e.what(), Catch::Contains("momentum must be in [0, 1)"));
  }
  using Opt = OffloadedOptimizer<Momentum, Fp32>;
  CHECK_THROWS_AS(Opt(h), invalid_option);
}

TEST_CASE("a user's rule runs in place and staged through NvmeFile, bit for bit as a plain loop", "[rules][user_rule][nvme]")
{
  Momentum::hyperparameters h;
  h.lr       = 0.05;
  h.nesterov = GENERATE(false, true);
  INFO("nesterov " << h.nesterov);
  auto const want = plain(7, h, 4.0);

  using HostOpt = OffloadedOptimizer<Momentum, Fp32, PinnedHost, Synchronous>;
  HostOpt host(h, small_chunks<HostOpt>());
  model<HostOpt> a(host);
  a.steps(host, 1, 7, 4.0);
  CHECK(a.w == want);

  scratch_dir d;
  using DiskOpt = OffloadedOptimizer<Momentum, Fp32, NvmeFile, Pipelined<2>>;
  typename DiskOpt::options o;
  o.tier = in(d);
  DiskOpt disk(h, small_chunks<DiskOpt>(o));
  model<DiskOpt> b(disk);
  b.steps(disk, 1, 7, 4.0);
  CHECK(b.w == want);

  std::vector<float> m_host(sizes[2]), m_disk(sizes[2]);
  host.copy_state("t2", slot{"momentum_buffer"}, m_host);
  disk.copy_state("t2", slot{"momentum_buffer"}, m_disk);
  CHECK_THROWS_WITH(host.copy_state("t2", slot::exp_avg, m_host), Catch::Contains("keeps no slot exp_avg"));
  CHECK(m_host == m_disk);
}

TEST_CASE("a user's rule checkpoints: saved on one tier, loaded on another, resumed exactly", "[rules][user_rule][checkpoint]")
{
  scratch_dir d;
  Momentum::hyperparameters h;
  h.momentum = 0.5;
  using HostOpt = OffloadedOptimizer<Momentum, Fp32, PinnedHost, Synchronous>;
  HostOpt a(h, small_chunks<HostOpt>());
  model<HostOpt> ma(a);
  ma.steps(a, 1, 3, 1.0);
  a.save(d.path / "ckpt");
  auto const params_at_3 = ma.w;  // Fp32 keeps no master: the params are the caller's, not the checkpoint's
  ma.steps(a, 4, 6, 1.0);

  using DiskOpt = OffloadedOptimizer<Momentum, Fp32, NvmeFile, Pipelined<2>>;
  typename DiskOpt::options o;
  o.tier = in(d);
  DiskOpt b(Momentum::hyperparameters{}, small_chunks<DiskOpt>(o));
  model<DiskOpt> mb(b);
  for (std::size_t t = 0; t < sizes.size(); ++t) { std::copy(params_at_3[t].begin(), params_at_3[t].end(), mb.w[t].begin()); }
  b.load(d.path / "ckpt");
  CHECK(b.get_hyperparameters(0).momentum == 0.5);
  mb.steps(b, 4, 6, 1.0);
  CHECK(mb.w == ma.w);
  CHECK(mb.w == plain(6, h, 1.0));
}

// --- A rule with a tensor phase (tests/row_column_rule.hpp) -------------------------------
// Its row and column factors are per-tensor state that persists across steps and is
// checkpointed; it takes two passes. Through PinnedHost and NvmeFile, plain, streaming and
// delayed steps, any chunk size and thread count, it gives what a plain loop over the rule's
// own text gives, bit for bit.

namespace {

using tierstate::test::RowColumn;

template <class Opt>
struct rc_model {
  using P = typename Opt::precision_type;
  std::vector<std::vector<typename P::param_type>> w;
  std::vector<std::vector<typename P::grad_type>> g;

  explicit rc_model(Opt& opt)
  {
    for (std::size_t t = 0; t < rc_shapes.size(); ++t) {
      auto const sh = rc_shapes[t];
      w.emplace_back(sh.elements());
      g.emplace_back(sh.elements());
      for (std::size_t i = 0; i < sh.elements(); ++i) {
        w[t][i] = convert<typename P::param_type>(0.001f * static_cast<float>(i % 97) - 0.05f);
      }
      if (t + 1 < rc_shapes.size()) {
        opt.add_tensor(std::string(rc_names[t]), w[t].data(), sh);
      } else {
        opt.add_tensor(std::string(rc_names[t]), w[t].data(), sh.elements());  // one row
      }
    }
  }
  void steps(Opt& opt, int from, int to, bool streaming = false)
  {
    for (int s = from; s <= to; ++s) {
      std::vector<grad_view<typename P::grad_type>> views;
      for (std::size_t t = 0; t < rc_shapes.size(); ++t) {
        for (std::size_t i = 0; i < g[t].size(); ++i) { g[t][i] = convert<typename P::grad_type>(rc_grad(s, t, i)); }
        views.push_back({g[t].data(), g[t].size()});
      }
      rc_step(opt, views, streaming);
    }
    (void)opt.flush();
  }
  rc_result result(Opt& opt)
  {
    rc_result r;
    for (std::size_t t = 0; t < rc_shapes.size(); ++t) {
      r.params.emplace_back();
      for (auto const x : w[t]) { r.params.back().push_back(convert<float>(x)); }
      r.momentum.emplace_back(w[t].size());
      opt.copy_state(rc_names[t], slot{"momentum"}, r.momentum.back());
      r.tensor_state.emplace_back(opt.tensor_state_size(rc_names[t]));
      opt.copy_tensor_state(rc_names[t], r.tensor_state.back());
    }
    return r;
  }
};

template <class Opt>
rc_result rc_train(int steps, typename Opt::options const& o, bool streaming = false)
{
  Opt opt(rc_hyper(), o);
  rc_model<Opt> m(opt);
  m.steps(opt, 1, steps, streaming);
  return m.result(opt);
}

template <class Opt>
typename Opt::options rc_chunks(std::size_t chunk, std::size_t threads = 2, typename Opt::options o = {})
{
  o.chunk_elements = chunk;
  o.threads        = threads;
  return o;
}

}  // namespace

TEMPLATE_TEST_CASE("a rule with a tensor phase is, bit for bit, a plain loop over its text, on any chunks, threads, tier and step",
                   "[rules][user_rule][tensor_phase][nvme]", Fp32, Bf16Mixed)
{
  using P         = TestType;
  auto const want = rc_plain<P>(9);
  using HostOpt   = OffloadedOptimizer<RowColumn, P, PinnedHost, Synchronous>;
  for (std::size_t const chunk : {std::size_t{2048}, std::size_t{6144}, std::size_t{1} << 20}) {
    for (std::size_t const threads : {std::size_t{1}, std::size_t{2}}) {
      INFO("chunk_elements " << chunk << ", threads " << threads);
      CHECK(rc_train<HostOpt>(9, rc_chunks<HostOpt>(chunk, threads)) == want);
    }
  }
  CHECK(rc_train<HostOpt>(9, rc_chunks<HostOpt>(2048), true) == want);  // streaming steps
  auto delayed           = rc_chunks<HostOpt>(4096);
  delayed.delayed_update = true;
  CHECK(rc_train<HostOpt>(9, delayed) == want);

  scratch_dir d;
  using DiskOpt = OffloadedOptimizer<RowColumn, P, NvmeFile, Pipelined<2>>;
  typename DiskOpt::options o;
  o.tier = in(d);
  CHECK(rc_train<DiskOpt>(9, rc_chunks<DiskOpt>(2048, 2, o)) == want);
  CHECK(rc_train<DiskOpt>(9, rc_chunks<DiskOpt>(2048, 2, o), true) == want);
  CHECK(rc_plain<P>(8) != want);  // (a test that can fail: a step moves the numbers)
}

TEST_CASE("a rule's per-tensor state is checkpointed: saved on one tier, loaded on another, resumed exactly",
          "[rules][user_rule][tensor_phase][checkpoint]")
{
  scratch_dir d;
  using HostOpt = OffloadedOptimizer<RowColumn, Bf16Mixed, PinnedHost, Synchronous>;
  HostOpt a(rc_hyper(), rc_chunks<HostOpt>(2048));
  rc_model<HostOpt> ma(a);
  ma.steps(a, 1, 4);
  a.save(d.path / "ckpt");

  using DiskOpt = OffloadedOptimizer<RowColumn, Bf16Mixed, NvmeFile, Pipelined<2>>;
  typename DiskOpt::options o;
  o.tier = in(d);
  DiskOpt b(RowColumn::hyperparameters{}, rc_chunks<DiskOpt>(2048, 1, o));  // (the layout must be the same)
  rc_model<DiskOpt> mb(b);
  b.load(d.path / "ckpt");  // the params come from the checkpoint's master
  CHECK(b.get_hyperparameters(0).clip_threshold == 0.95);
  CHECK(mb.result(b).tensor_state == ma.result(a).tensor_state);
  mb.steps(b, 5, 9);
  CHECK(mb.result(b) == rc_plain<Bf16Mixed>(9));

  // Same element counts, another shape: refused, naming the shape, and nothing changes.
  HostOpt c(rc_hyper(), rc_chunks<HostOpt>(2048));
  std::vector<std::vector<bf16>> w;
  for (std::size_t t = 0; t < rc_shapes.size(); ++t) {
    auto sh = rc_shapes[t];
    if (t == 0) { sh = {53, 37}; }
    w.emplace_back(sh.elements(), bf16(0.25f));
    c.add_tensor(std::string(rc_names[t]), w.back().data(), sh);
  }
  CHECK_THROWS_WITH(c.load(d.path / "ckpt"), Catch::Contains("tensor 't0' shaped 37 x 53, and this optimizer has 53 x 37"));
  std::vector<float> st(c.tensor_state_size("t0"));
  c.copy_tensor_state("t0", st);
  CHECK(std::all_of(st.begin(), st.end(), [](float x) { return x == 0.0f; }));
}

TEST_CASE("a rule's per-tensor state: a skipped step keeps it, and its calls refuse what does not fit",
          "[rules][user_rule][tensor_phase]")
{
  using HostOpt = OffloadedOptimizer<RowColumn, Fp32, PinnedHost, Synchronous>;
  HostOpt opt(rc_hyper(), rc_chunks<HostOpt>(2048));
  rc_model<HostOpt> m(opt);
  m.steps(opt, 1, 2);
  auto const before = m.result(opt);
  // A non-finite gradient in the last tensor: the step is skipped, and no factor moved.
  std::vector<grad_view<float>> views;
  for (std::size_t t = 0; t < rc_shapes.size(); ++t) { views.push_back({m.g[t].data(), m.g[t].size()}); }
  m.g.back()[7] = std::numeric_limits<float>::infinity();
  CHECK(opt.step(views).skipped);
  CHECK(m.result(opt) == before);

  std::vector<float> wrong(3);
  CHECK_THROWS_WITH(opt.copy_tensor_state("t0", wrong), Catch::Contains("the span has 3 floats; the tensor's state has 92"));
  CHECK_THROWS_WITH(opt.write_tensor_state("t0", wrong), Catch::Contains("the span has 3 floats; the tensor's state has 92"));
  std::vector<float> ones(opt.tensor_state_size("t0"), 1.0f);
  opt.write_tensor_state("t0", ones);
  std::vector<float> got(ones.size());
  opt.copy_tensor_state("t0", got);
  CHECK(got == ones);
  float x = 0.0f;
  CHECK_THROWS_WITH(opt.add_tensor("huge", &x, tensor_shape{std::size_t{1} << 40, std::size_t{1} << 40}),
                    Catch::Contains("has more elements than a std::size_t counts"));

  // A rule without a tensor phase keeps none.
  OffloadedOptimizer<Momentum, Fp32> plain_rule;
  std::vector<float> w(4);
  plain_rule.add_tensor("w", w.data(), 4);
  CHECK(plain_rule.tensor_state_size("w") == 0);
  CHECK_THROWS_WITH(plain_rule.copy_tensor_state("w", wrong), Catch::Contains("keeps no per-tensor state"));
}
