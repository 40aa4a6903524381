// SPDX-License-Identifier: Apache-2.0
// The streaming step (begin_step, grad_ready, finish_step) against the plain step(): the
// same bits with gradients handed over in any order, from several threads, with tensors
// that get no gradient, with accumulation, clipping and skipped steps; and updates that
// happen before the last gradient arrives.
#include "matrix.hpp"
#include "memory_tier.hpp"
#include "nvme_support.hpp"

#include <tierstate/ranks/partition.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

using namespace tierstate;
using namespace tierstate::test;

namespace {

enum class handover { registration, backward, shuffled, threads };

/// Trains with step() (streaming = false) or with streaming steps handing the gradients
/// over as `how` says. Tensors for which `absent(t, step)` holds get no gradient that step.
template <class Opt>
run_result train_streaming(int steps, typename Opt::options const& o, bool streaming, handover how,
                           bool (*absent)(std::size_t, int) = nullptr, unsigned micro_batches = 1,
                           std::vector<step_result>* results = nullptr)
{
  nvme_model<typename Opt::precision_type> m;
  Opt opt(schedule<Opt>(1), o);
  register_model(opt, m);
  std::mt19937 rng(7);
  for (int t = 1; t <= steps; ++t) {
    m.fill_grads(t);
    opt.set_hyperparameters(0, schedule<Opt>(t));
    auto views = m.views();
    for (std::size_t k = 0; k < views.size(); ++k) {
      if (absent != nullptr && absent(k, t)) { views[k] = {}; }
    }
    step_result r;
    if (!streaming) {
      r = opt.step(views);
    } else {
      opt.begin_step(1.0, micro_batches);
      std::vector<std::size_t> order(views.size());
      for (std::size_t k = 0; k < order.size(); ++k) { order[k] = k; }
      if (how == handover::backward) { std::reverse(order.begin(), order.end()); }
      if (how == handover::shuffled) { std::shuffle(order.begin(), order.end(), rng); }
      // Accumulation: the earlier micro-batches hand over a view of a scratch gradient;
      // only the last one's must count.
      std::vector<typename Opt::grad_type> scratch(50000, convert<typename Opt::grad_type>(1e6f));
      auto hand = [&](std::size_t k) {
        if (views[k].data == nullptr) { return; }
        for (unsigned mb = 1; mb < micro_batches; ++mb) {
          opt.grad_ready(k, {scratch.data(), views[k].size, location::host});
        }
        opt.grad_ready(k, views[k]);
      };
      if (how == handover::threads) {
        std::vector<std::thread> pool;
        std::atomic<std::size_t> next{0};
        for (int w = 0; w < 4; ++w) {
          pool.emplace_back([&] {
            for (std::size_t k; (k = next.fetch_add(1)) < order.size();) { hand(order[k]); }
          });
        }
        for (auto& th : pool) { th.join(); }
      } else {
        for (std::size_t const k : order) { hand(k); }
      }
      r = opt.finish_step();
    }
    if (results != nullptr) { results->push_back(r); }
  }
  return snapshot(opt, m);
}

template <class Opt>
typename Opt::options streaming_options(std::size_t chunk, nonfinite_policy p, double clip = 0.0)
{
  typename Opt::options o;
  o.chunk_elements = chunk;
  o.on_nonfinite   = p;
  o.max_grad_norm  = clip;
  return o;
}

}  // namespace

TEMPLATE_LIST_TEST_CASE("a streaming step gives step()'s bits, in any order and from any thread",
                        "[streaming]", matrix::precisions)
{
  using P = TestType;
  scratch_dir d;
  for (auto const policy : {nonfinite_policy::ignore, nonfinite_policy::skip_step}) {
    for (std::size_t const chunk : {std::size_t{2048}, std::size_t{1} << 20}) {
      INFO("chunk " << chunk << ", checks " << (policy == nonfinite_policy::ignore ? "off" : "on"));
      auto const expected = train_streaming<HostOpt<P>>(20, streaming_options<HostOpt<P>>(chunk, policy), false,
                                                        handover::registration);
      for (auto const how : {handover::registration, handover::backward, handover::shuffled, handover::threads}) {
        INFO("handover " << static_cast<int>(how));
        CHECK(train_streaming<HostOpt<P>>(20, streaming_options<HostOpt<P>>(chunk, policy), true, how) == expected);
        auto o = streaming_options<NvmeOpt<P>>(chunk, policy);
        o.tier = in(d);
        CHECK(train_streaming<NvmeOpt<P>>(20, o, true, how) == expected);
        auto s = streaming_options<NvmeOpt<P, Synchronous>>(chunk, policy);
        s.tier = in(d);
        CHECK(train_streaming<NvmeOpt<P, Synchronous>>(20, s, true, how) == expected);
      }
    }
  }
}

TEST_CASE("tensors that get no gradient are left as they are, streamed or not", "[streaming]")
{
  // t2 never gets a gradient; t5 misses every third step.
  auto const absent = [](std::size_t t, int step) { return t == 2 || (t == 5 && step % 3 == 0); };
  auto const o      = streaming_options<HostOpt<Bf16Mixed>>(2048, nonfinite_policy::skip_step);
  auto const plain  = train_streaming<HostOpt<Bf16Mixed>>(12, o, false, handover::registration, absent);
  CHECK(train_streaming<HostOpt<Bf16Mixed>>(12, o, true, handover::shuffled, absent) == plain);
  CHECK(train_streaming<HostOpt<Bf16Mixed>>(12, o, true, handover::threads, absent) == plain);
  // t2's param is its initial value; its state is still zero.
  nvme_model<Bf16Mixed> fresh;
  for (std::size_t i = 0; i < fresh.params[2].size(); ++i) { CHECK(plain.params[2][i] == fresh.params[2][i].bits); }
  for (std::size_t s = 1; s < plain.slots.size(); ++s) {
    for (float const x : plain.slots[s][2]) { CHECK(x == 0.0f); }
  }
}

TEST_CASE("gradient accumulation: a tensor's gradient is final at its last micro-batch", "[streaming]")
{
  auto const o     = streaming_options<HostOpt<Bf16Mixed>>(2048, nonfinite_policy::ignore);
  auto const plain = train_streaming<HostOpt<Bf16Mixed>>(8, o, false, handover::registration);
  CHECK(train_streaming<HostOpt<Bf16Mixed>>(8, o, true, handover::shuffled, nullptr, 4) == plain);
  CHECK(train_streaming<HostOpt<Bf16Mixed>>(8, o, true, handover::threads, nullptr, 2) == plain);
}

TEST_CASE("clipping: one norm whatever the chunking, threads and order; streamed equals plain",
          "[streaming][clip]")
{
  std::vector<step_result> a, b, c;
  auto o1 = streaming_options<HostOpt<Bf16Mixed>>(2048, nonfinite_policy::skip_step, 0.05);
  o1.threads = 1;
  auto o2 = streaming_options<HostOpt<Bf16Mixed>>(std::size_t{1} << 20, nonfinite_policy::skip_step, 0.05);
  o2.threads = 2;
  auto const plain = train_streaming<HostOpt<Bf16Mixed>>(10, o1, false, handover::registration, nullptr, 1, &a);
  CHECK(train_streaming<HostOpt<Bf16Mixed>>(10, o2, false, handover::registration, nullptr, 1, &b) == plain);
  CHECK(train_streaming<HostOpt<Bf16Mixed>>(10, o2, true, handover::threads, nullptr, 1, &c) == plain);
  for (int t = 0; t < 10; ++t) {
    CHECK(a[t].grad_norm == b[t].grad_norm);
    CHECK(a[t].grad_norm == c[t].grad_norm);
  }
  // The norm is the gradients' 2-norm, and clipping changes the update.
  nvme_model<Bf16Mixed> m;
  m.fill_grads(1);
  double sum = 0;
  for (auto const& g : m.grads) {
    for (auto const x : g) { sum += static_cast<double>(static_cast<float>(x)) * static_cast<float>(x); }
  }
  CHECK(a[0].grad_norm == Approx(std::sqrt(sum)).epsilon(1e-12));
  REQUIRE(a[0].grad_norm > 0.05);
  auto const unclipped = train_streaming<HostOpt<Bf16Mixed>>(10, streaming_options<HostOpt<Bf16Mixed>>(2048, nonfinite_policy::skip_step),
                                                             false, handover::registration);
  CHECK_FALSE(unclipped == plain);
  // With a limit above the norm nothing changes.
  CHECK(train_streaming<HostOpt<Bf16Mixed>>(10, streaming_options<HostOpt<Bf16Mixed>>(2048, nonfinite_policy::skip_step, 1e9),
                                            true, handover::shuffled) == unclipped);
}

TEST_CASE("a non-finite gradient skips a streaming step, and the reads ahead are drained", "[streaming]")
{
  scratch_dir d;
  nvme_model<Bf16Mixed> m;
  auto o = streaming_options<NvmeOpt<Bf16Mixed>>(2048, nonfinite_policy::skip_step);
  o.tier = in(d);
  NvmeOpt<Bf16Mixed> opt(schedule<NvmeOpt<Bf16Mixed>>(1), o);
  register_model(opt, m);
  m.fill_grads(1);
  opt.step(m.views());
  auto const before = snapshot(opt, m);
  m.fill_grads(2);
  m.grads[3][17] = bf16(std::numeric_limits<float>::infinity());
  auto const views = m.views();
  opt.begin_step();
  for (std::size_t k = 0; k < views.size(); ++k) { opt.grad_ready(k, views[k]); }
  auto const r = opt.finish_step();
  CHECK(r.found_nonfinite);
  CHECK(r.skipped);
  CHECK(r.step == 1);
  CHECK(snapshot(opt, m) == before);
  m.fill_grads(2);
  opt.begin_step();
  for (std::size_t k = 0; k < views.size(); ++k) { opt.grad_ready(k, m.views()[k]); }
  CHECK(opt.finish_step().step == 2);
}

TEST_CASE("each gradient is looked at for infs and NaNs as it is handed over: wherever one is, the step is skipped",
          "[streaming]")
{
  // The gate looks at each gradient once it is final, while the others are still to come:
  // a non-finite value in the first, a middle or the last one handed over, or in the final
  // micro-batch's view, skips the step; one in an earlier micro-batch's view does not count.
  auto const o = streaming_options<HostOpt<Bf16Mixed>>(2048, nonfinite_policy::skip_step);
  nvme_model<Bf16Mixed> m;
  HostOpt<Bf16Mixed> opt(schedule<HostOpt<Bf16Mixed>>(1), o);
  register_model(opt, m);
  m.fill_grads(1);
  opt.step(m.views());
  std::size_t const T = m.views().size();
  std::vector<bf16> early(50000, bf16(std::numeric_limits<float>::quiet_NaN()));
  for (std::size_t bad = 0; bad <= T; ++bad) {  // bad == T: a NaN only in an earlier micro-batch's view
    INFO("NaN in the gradient handed over " << bad << "th of " << T);
    auto const before = snapshot(opt, m);
    m.fill_grads(2);
    auto views = m.views();
    std::size_t const victim = T - 1 - std::min(bad, T - 1);  // backward's order: the last tensor first
    if (bad < T) { m.grads[victim][views[victim].size / 2] = bf16(-std::numeric_limits<float>::infinity()); }
    opt.begin_step(1.0, 2);
    for (std::size_t j = 0; j < T; ++j) {
      std::size_t const k = T - 1 - j;
      opt.grad_ready(k, {early.data(), views[k].size, location::host});  // micro-batch 1: NaNs, not final
      opt.grad_ready(k, views[k]);
    }
    auto const r = opt.finish_step();
    CHECK(r.found_nonfinite == (bad < T));
    CHECK(r.skipped == (bad < T));
    if (bad < T) {
      CHECK(snapshot(opt, m) == before);
    } else {
      CHECK(r.step == 2);
    }
  }
}

namespace {

/// A tier with read and write only, which counts the writes (a chunk written back is a
/// chunk updated).
struct counting_tier {
  struct options {};
  static constexpr std::string_view name = "counting_tier";
  std::vector<std::byte> bytes;
  mutable std::mutex m;
  std::size_t writes = 0;
  counting_tier(std::size_t n, options const&) : bytes(n) {}
  counting_tier(counting_tier&& o) noexcept : bytes(std::move(o.bytes)), writes(o.writes) {}
  [[nodiscard]] std::size_t size() const { return bytes.size(); }
  void read(std::size_t offset, std::span<std::byte> to) const
  {
    std::memcpy(to.data(), bytes.data() + offset, to.size());
  }
  void write(std::size_t offset, std::span<std::byte const> from)
  {
    std::memcpy(bytes.data() + offset, from.data(), from.size());
    std::lock_guard lock(m);
    ++writes;
  }
  std::size_t written() const
  {
    std::lock_guard lock(m);
    return writes;
  }
};

}  // namespace

TEST_CASE("chunks are updated while later gradients are still to come; the order adapts",
          "[streaming][overlap]")
{
  using Opt = OffloadedOptimizer<AdamW, Bf16Mixed, counting_tier, Synchronous>;
  test_model<Bf16Mixed> m({8192, 8192, 8192, 8192});  // four tensors, one 8192-element chunk each
  Opt::options o;
  o.chunk_elements = 8192;
  o.on_nonfinite   = nonfinite_policy::ignore;  // nothing to wait for
  Opt opt({}, o);
  for (std::size_t k = 0; k < 4; ++k) { opt.add_tensor(tensor_name(k), m.params[k].data(), 8192); }
  m.fill_grads(1);
  auto const views = m.views();
  (void)opt.state_layout();
  std::size_t const base = opt.state_tier().written();
  opt.begin_step();
  // Backward's order: the last tensor's gradient first. Its chunk is updated (written back)
  // before any other gradient arrives.
  opt.grad_ready(3, views[3]);
  auto const deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (opt.state_tier().written() < base + 1 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  CHECK(opt.state_tier().written() == base + 1);
  opt.grad_ready(2, views[2]);
  opt.grad_ready(1, views[1]);
  opt.grad_ready(0, views[0]);
  auto const r = opt.finish_step();
  CHECK(r.stats.chunks == 4);
  CHECK(opt.next_chunk_order() == std::vector<std::size_t>{3, 2, 1, 0});
  // Gradients in registration order this time: the next step expects that order.
  opt.begin_step();
  for (std::size_t k = 0; k < 4; ++k) { opt.grad_ready(k, views[k]); }
  (void)opt.finish_step();
  CHECK(opt.next_chunk_order() == std::vector<std::size_t>{0, 1, 2, 3});
}

TEST_CASE("the streaming calls refuse what breaks their contract", "[streaming][errors]")
{
  test_model<Bf16Mixed> m({100, 200});
  HostOpt<Bf16Mixed> opt;
  opt.add_tensor("a", m.params[0].data(), 100);
  opt.add_tensor("b", m.params[1].data(), 200);
  auto const views = m.views();
  CHECK_THROWS_WITH(opt.grad_ready(0, views[0]), Catch::Contains("begin_step"));
  CHECK_THROWS_WITH(opt.finish_step(), Catch::Contains("begin_step"));
  CHECK_THROWS_AS(opt.begin_step(1.0, 0), invalid_option);
  CHECK_THROWS_AS(opt.begin_step(-1.0), invalid_option);
  CHECK_FALSE(opt.in_step());
  opt.begin_step(1.0, 2);
  CHECK(opt.in_step());
  CHECK_THROWS_WITH(opt.step(views), Catch::Contains("streaming step is in progress"));
  CHECK_THROWS_WITH(opt.begin_step(), Catch::Contains("streaming step is in progress"));
  CHECK_THROWS_WITH(opt.grad_ready(5, views[0]), Catch::Contains("no tensor 5"));
  CHECK_THROWS_WITH(opt.grad_ready(1, views[0]), Catch::Contains("'b'") && Catch::Contains("100 elements"));
  opt.grad_ready(0, views[0]);
  opt.grad_ready(0, views[0]);
  CHECK_THROWS_WITH(opt.grad_ready(0, views[0]), Catch::Contains("micro_batches is 2"));
  std::vector<float> out(100);
  CHECK_THROWS_AS(opt.copy_state("a", slot::exp_avg, out), tierstate::logic_error);
  CHECK(opt.finish_step().step == 1);
  CHECK_FALSE(opt.in_step());
  // Destroyed in the middle of a streaming step: returns, does not hang.
  auto other = std::make_unique<HostOpt<Bf16Mixed>>();
  other->add_tensor("a", m.params[0].data(), 100);
  other->begin_step();
  other.reset();
}

// --- the delayed parameter update ---------------------------------------------------------

namespace {

/// Params (as bits) after each of `steps` steps of Opt; with delayed_update the gradients'
/// buffers are scribbled over right after each step() returns (the optimizer has its own).
template <class Opt>
std::vector<run_result> params_each_step(int steps, typename Opt::options const& o, run_result* last)
{
  nvme_model<typename Opt::precision_type> m;
  Opt opt(schedule<Opt>(1), o);
  register_model(opt, m);
  std::vector<run_result> out;
  for (int t = 1; t <= steps; ++t) {
    m.fill_grads(t);
    opt.set_hyperparameters(0, schedule<Opt>(t));
    auto const r = opt.step(m.views());
    CHECK(r.deferred == o.delayed_update);
    CHECK(r.step == t);
    for (auto& g : m.grads) { std::fill(g.begin(), g.end(), convert<typename Opt::grad_type>(1e30f)); }
    run_result p;
    for (auto const& x : m.params) {
      p.params.emplace_back();
      for (auto const& e : x) { p.params.back().push_back(bits(e)); }
    }
    out.push_back(p);
  }
  opt.flush();
  *last = snapshot(opt, m);
  return out;
}

}  // namespace

TEMPLATE_LIST_TEST_CASE("the delayed update: the model's params are one step behind, then flush catches up",
                        "[streaming][delayed]", matrix::precisions)
{
  using P = TestType;
  scratch_dir d;
  run_result plain_last, delayed_last;
  auto o = streaming_options<HostOpt<P>>(2048, nonfinite_policy::skip_step);
  auto const plain = params_each_step<HostOpt<P>>(12, o, &plain_last);
  o.delayed_update = true;
  auto const delayed = params_each_step<HostOpt<P>>(12, o, &delayed_last);
  CHECK(delayed_last == plain_last);
  for (int t = 2; t <= 12; ++t) {
    INFO("after step " << t);
    CHECK(delayed[t - 1].params == plain[t - 2].params);
  }
  auto n           = streaming_options<NvmeOpt<P>>(6144, nonfinite_policy::skip_step, 0.05);
  n.tier           = in(d);
  n.delayed_update = true;
  run_result nvme_last, clipped_last;
  (void)params_each_step<NvmeOpt<P>>(12, n, &nvme_last);
  auto c = streaming_options<HostOpt<P>>(2048, nonfinite_policy::skip_step, 0.05);
  (void)params_each_step<HostOpt<P>>(12, c, &clipped_last);
  CHECK(nvme_last == clipped_last);
}

TEST_CASE("the delayed update saves, loads and refuses what it cannot do", "[streaming][delayed]")
{
  scratch_dir d;
  nvme_model<Bf16Mixed> m;
  auto o           = streaming_options<HostOpt<Bf16Mixed>>(2048, nonfinite_policy::skip_step);
  o.delayed_update = true;
  HostOpt<Bf16Mixed> opt(schedule<HostOpt<Bf16Mixed>>(1), o);
  register_model(opt, m);
  for (int t = 1; t <= 5; ++t) {
    m.fill_grads(t);
    opt.set_hyperparameters(0, schedule<HostOpt<Bf16Mixed>>(t));
    opt.step(m.views());
  }
  CHECK_THROWS_WITH(opt.begin_step(), Catch::Contains("delayed_update"));
  opt.save(d.path / "c.ckpt");  // flushes first: the checkpoint has all five updates
  auto const saved = snapshot(opt, m);
  nvme_model<Bf16Mixed> m2;
  HostOpt<Bf16Mixed> other(schedule<HostOpt<Bf16Mixed>>(1), o);
  register_model(other, m2);
  other.load(d.path / "c.ckpt");
  CHECK(snapshot(other, m2) == saved);
  CHECK(other.step_count() == 5);
  // A skipped step starts nothing.
  m2.fill_grads(6);
  m2.grads[0][0] = bf16(std::numeric_limits<float>::quiet_NaN());
  auto const r = other.step(m2.views());
  CHECK(r.skipped);
  CHECK(other.step_count() == 5);
}

TEST_CASE("clipping with an inf or NaN norm goes on as clip_grad_norm_ does (report, ignore)", "[streaming][clip]")
{
  // torch.nn.utils.clip_grad_norm_ without error_if_nonfinite multiplies every gradient by
  // max_norm / (norm + 1e-6): 0 for an inf norm (the inf elements become NaN), NaN for a NaN
  // one. The same step from gradients so multiplied, unclipped, is the reference.
  using Opt = OffloadedOptimizer<AdamW, Fp32, PinnedHost>;
  std::vector<std::size_t> const sizes = {5000, 37};
  for (float const bad : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    for (auto const policy : {nonfinite_policy::report, nonfinite_policy::ignore}) {
      for (bool const streaming : {false, true}) {
        CAPTURE(bad, static_cast<int>(policy), streaming);
        typename Opt::options clipped, plain;
        clipped.on_nonfinite  = policy;
        clipped.max_grad_norm = 1.0;
        plain.on_nonfinite    = nonfinite_policy::ignore;
        std::vector<std::vector<float>> p(2), q(2), g(2), h(2);
        Opt a({}, clipped), b({}, plain);
        for (std::size_t t = 0; t < sizes.size(); ++t) {
          p[t].resize(sizes[t]);
          for (std::size_t i = 0; i < sizes[t]; ++i) { p[t][i] = std::sin(static_cast<float>(i + t)); }
          q[t] = p[t];
          a.add_tensor(std::string("t").append(std::to_string(t)), p[t].data(), sizes[t]);
          b.add_tensor(std::string("t").append(std::to_string(t)), q[t].data(), sizes[t]);
        }
        for (int s = 0; s < 3; ++s) {
          for (std::size_t t = 0; t < sizes.size(); ++t) {
            g[t].resize(sizes[t]);
            for (std::size_t i = 0; i < sizes[t]; ++i) { g[t][i] = 1e-4f * std::cos(static_cast<float>(i * 3 + t + s)); }
            h[t] = g[t];  // (a norm below 1: no clipping)
          }
          if (s == 1) {
            g[0][4321] = bad;
            for (auto& x : h) {
              for (auto& y : x) { y *= std::isinf(bad) ? 0.0f : bad; }
            }
            h[0][4321] = std::numeric_limits<float>::quiet_NaN();
          }
          std::vector<grad_view<float>> gv, hv;
          for (std::size_t t = 0; t < sizes.size(); ++t) {
            gv.push_back({g[t].data(), sizes[t]});
            hv.push_back({h[t].data(), sizes[t]});
          }
          step_result r;
          if (streaming) {
            a.begin_step();
            for (std::size_t t = sizes.size(); t-- > 0;) { a.grad_ready(t, gv[t]); }
            r = a.finish_step();
          } else {
            r = a.step(gv);
          }
          REQUIRE(!b.step(hv).skipped);
          CHECK_FALSE(r.skipped);
          CHECK(r.found_nonfinite == (s == 1 && policy == nonfinite_policy::report));
          if (s == 1) { CHECK_FALSE(std::isfinite(r.grad_norm)); }
          for (std::size_t t = 0; t < sizes.size(); ++t) {  // the same bits, or NaN both (a NaN's sign may differ)
            for (std::size_t i = 0; i < sizes[t]; ++i) {
              if (std::isnan(p[t][i]) && std::isnan(q[t][i])) { continue; }
              REQUIRE(std::memcmp(&p[t][i], &q[t][i], sizeof(float)) == 0);
            }
          }
        }
        CHECK(std::isnan(p[0][4321]));
        CHECK(std::isfinite(p[1][0]) == std::isinf(bad));  // an inf norm zeroes the rest; a NaN one poisons all
      }
    }
  }
}

// --- a shadowed state (options::shadow_state): skip_step without waiting for every gradient -

namespace {

/// Steps from..to of the model, plain or streaming (last tensor first); step `bad` puts an
/// inf in tensor `victim`'s gradient.
template <class Opt, class M>
void run_steps(Opt& opt, M& m, int from, int to, bool streaming, int bad = 0, std::size_t victim = 0,
               std::vector<step_result>* out = nullptr)
{
  for (int t = from; t <= to; ++t) {
    m.fill_grads(t);
    if (t == bad) { m.grads[victim][m.grads[victim].size() / 2] = bf16(std::numeric_limits<float>::infinity()); }
    opt.set_hyperparameters(0, schedule<Opt>(t));
    auto const views = m.views();
    step_result r;
    if (!streaming) {
      r = opt.step(views);
    } else {
      opt.begin_step();
      for (std::size_t k = views.size(); k-- > 0;) { opt.grad_ready(k, views[k]); }
      r = opt.finish_step();
    }
    if (out != nullptr) { out->push_back(r); }
  }
}

template <class Opt>
typename Opt::options shadowed(std::size_t chunk, typename Opt::tier_type::options tier = {})
{
  typename Opt::options o;
  o.chunk_elements = chunk;
  o.shadow_state   = true;
  o.tier           = std::move(tier);
  return o;
}

/// Equal bits (report's NaNs included, which == on the floats would call different).
bool same_bits(run_result const& a, run_result const& b)
{
  if (a.params != b.params || a.steps != b.steps || a.slots.size() != b.slots.size()) { return false; }
  for (std::size_t i = 0; i < a.slots.size(); ++i) {
    for (std::size_t j = 0; j < a.slots[i].size(); ++j) {
      auto const& x = a.slots[i][j];
      auto const& y = b.slots[i][j];
      if (x.size() != y.size() || std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) != 0) { return false; }
    }
  }
  return true;
}

/// A shadowed state's streaming steps against plain steps, an inf at step 5: skip_step and
/// report checked late, and skip_step with clipping (its checks wait, the update is shadowed).
template <class P>
void check_shadowed_bits(nonfinite_policy policy, double clip = 0.0)
{
  scratch_dir d;
  bool const skips = policy == nonfinite_policy::skip_step;
  for (std::size_t const chunk : {std::size_t{2048}, std::size_t{1} << 20}) {
    for (std::size_t const victim : {std::size_t{0}, std::size_t{3}, std::size_t{6}}) {
      INFO("chunk " << chunk << ", an inf at step 5 in tensor " << victim << ", skips " << skips << ", clip " << clip);
      nvme_model<P> ref;
      HostOpt<P> plain(schedule<HostOpt<P>>(1), streaming_options<HostOpt<P>>(chunk, policy, clip));
      register_model(plain, ref);
      run_steps(plain, ref, 1, 12, false, 5, victim);
      auto const expected = snapshot(plain, ref);
      CHECK(expected.steps == (skips ? 11 : 12));

      nvme_model<P> m;
      auto o          = shadowed<NvmeOpt<P>>(chunk, in(d));
      o.on_nonfinite  = policy;
      o.max_grad_norm = clip;
      NvmeOpt<P> opt(schedule<NvmeOpt<P>>(1), o);
      register_model(opt, m);
      std::vector<step_result> results;
      run_steps(opt, m, 1, 12, true, 5, victim, &results);
      CHECK(same_bits(snapshot(opt, m), expected));
      CHECK(results[4].skipped == skips);
      CHECK(results[4].found_nonfinite);
      CHECK(results[4].step == (skips ? 4 : 5));
      CHECK_FALSE(results[5].found_nonfinite);

      nvme_model<P> s;
      auto so = shadowed<NvmeOpt<P, Synchronous>>(chunk, in(d));
      so.on_nonfinite  = policy;
      so.max_grad_norm = clip;
      NvmeOpt<P, Synchronous> sync(schedule<NvmeOpt<P, Synchronous>>(1), so);
      register_model(sync, s);
      run_steps(sync, s, 1, 12, true, 5, victim);
      CHECK(same_bits(snapshot(sync, s), expected));
    }
  }
}

}  // namespace

TEST_CASE("a shadowed state: skip_step streams as an unchecked step does, with step()'s bits", "[streaming][shadow]")
{
  check_shadowed_bits<Bf16Mixed>(nonfinite_policy::skip_step);
  check_shadowed_bits<Bf16Mixed8bit>(nonfinite_policy::skip_step);
  check_shadowed_bits<Bf16Mixed>(nonfinite_policy::report);
  check_shadowed_bits<Bf16Mixed>(nonfinite_policy::skip_step, 0.5);
}

TEST_CASE("a shadowed state updates chunks before the last gradient; a skip then leaves everything as it was",
          "[streaming][shadow][overlap]")
{
  using Opt = OffloadedOptimizer<AdamW, Bf16Mixed, test::memory_tier, Synchronous>;
  std::atomic<int> writes{0};
  test::memory_tier::options tier;
  tier.before_write = [&] { ++writes; };
  test_model<Bf16Mixed> m({8192, 8192, 8192, 8192});  // one chunk each
  Opt opt(schedule<Opt>(1), shadowed<Opt>(8192, tier));
  for (std::size_t k = 0; k < 4; ++k) { opt.add_tensor(tensor_name(k), m.params[k].data(), 8192); }
  CHECK(opt.state_tier().size() == 2 * opt.state_layout().total_bytes());
  m.fill_grads(1);
  opt.step(m.views());
  for (int round = 0; round < 2; ++round) {  // the spare places are the first half, then the second
    INFO("round " << round);
    // Tensor 1 gets no gradient this step, and its param is set by hand (as a user may): the
    // skipped step leaves it so, writing back only the params of the tensors it updated.
    m.params[1][5]     = bf16(0.75f);
    auto const before = snapshot(opt, m);
    m.fill_grads(2 + round);
    m.grads[0][100]    = bf16(std::numeric_limits<float>::quiet_NaN());  // in the last gradient handed over
    auto const views   = m.views();
    int const base     = writes.load();
    opt.begin_step();
    opt.grad_ready(3, views[3]);  // its chunk is updated now, with three gradients to come
    auto const deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (writes.load() < base + 1 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    CHECK(writes.load() == base + 1);
    std::vector<std::uint32_t> now;  // its params were written meanwhile
    for (auto const x : m.params[3]) { now.push_back(x.bits); }
    CHECK(now != before.params[3]);
    for (std::size_t k : {2, 0}) { opt.grad_ready(k, views[k]); }
    auto const r = opt.finish_step();
    CHECK(r.skipped);
    CHECK(r.found_nonfinite);
    CHECK(writes.load() == base + 4);
    CHECK(snapshot(opt, m) == before);
    m.params[1][5] = convert<bf16>(snapshot(opt, m).slots[0][1][5]);  // (back to its master's)
    // A clean step commits; the next one starts from its places.
    m.fill_grads(10 + round);
    opt.begin_step();
    for (std::size_t k = 4; k-- > 0;) { opt.grad_ready(k, m.views()[k]); }
    CHECK_FALSE(opt.finish_step().skipped);
  }
  // The same two clean steps, plain, unshadowed: the same bits.
  using Ref = OffloadedOptimizer<AdamW, Bf16Mixed, PinnedHost, Synchronous>;
  test_model<Bf16Mixed> r({8192, 8192, 8192, 8192});
  Ref ref(schedule<Ref>(1), streaming_options<Ref>(8192, nonfinite_policy::skip_step));
  for (std::size_t k = 0; k < 4; ++k) { ref.add_tensor(tensor_name(k), r.params[k].data(), 8192); }
  for (int t : {1, 10, 11}) {
    r.fill_grads(t);
    ref.step(r.views());
  }
  CHECK(snapshot(opt, m) == snapshot(ref, r));
}

TEST_CASE("a shadowed step that fails part way is refused with nothing changed; lost only if the params "
          "cannot be restored", "[streaming][shadow][errors]")
{
  using Opt = OffloadedOptimizer<AdamW, Bf16Mixed, test::memory_tier, Pipelined<2>>;
  int writes_left   = 1 << 30;
  bool fail_reads   = false;
  bool reads_follow = false;  // the reads fail too once a write has
  test::memory_tier::options tier;
  tier.writes_left  = &writes_left;
  tier.fail_reads   = &fail_reads;
  tier.before_write = [&] { fail_reads = reads_follow && writes_left <= 0; };
  nvme_model<Bf16Mixed> m;
  Opt opt(schedule<Opt>(1), shadowed<Opt>(2048, tier));
  register_model(opt, m);
  run_steps(opt, m, 1, 1, true);
  auto const before = snapshot(opt, m);
  writes_left = 3;  // the fourth chunk's write fails, three were written to their spare places
  opt.set_hyperparameters(0, schedule<Opt>(2));
  m.fill_grads(2);
  opt.begin_step();
  for (std::size_t k = m.views().size(); k-- > 0;) { opt.grad_ready(k, m.views()[k]); }
  CHECK_THROWS_WITH(opt.finish_step(), Catch::Contains("memory_tier: write failed"));
  CHECK_FALSE(opt.state_lost());
  writes_left = 1 << 30;
  CHECK(snapshot(opt, m) == before);
  run_steps(opt, m, 2, 3, true);  // taken again
  nvme_model<Bf16Mixed> r;
  HostOpt<Bf16Mixed> ref(schedule<HostOpt<Bf16Mixed>>(1), streaming_options<HostOpt<Bf16Mixed>>(2048, nonfinite_policy::skip_step));
  register_model(ref, r);
  run_steps(ref, r, 1, 3, false);
  CHECK(snapshot(opt, m) == snapshot(ref, r));

  // The params cannot be restored when the tier cannot be read either: then the state is lost.
  writes_left  = 2;
  reads_follow = true;
  opt.set_hyperparameters(0, schedule<Opt>(4));
  m.fill_grads(4);
  opt.begin_step();
  for (std::size_t k = m.views().size(); k-- > 0;) { opt.grad_ready(k, m.views()[k]); }
  CHECK_THROWS_WITH(opt.finish_step(), Catch::Contains("memory_tier: write failed"));
  CHECK(opt.state_lost());
  fail_reads = false;
  CHECK_THROWS_WITH(opt.begin_step(), Catch::Contains("restoring the params it had written failed: memory_tier: read failed"));
}

TEST_CASE("a shadowed state saves and loads as any other, and shadow_state is refused where it cannot work",
          "[streaming][shadow][errors]")
{
  scratch_dir d;
  auto const file = d.path / "run.ckpt";
  nvme_model<Bf16Mixed> r;
  HostOpt<Bf16Mixed> ref(schedule<HostOpt<Bf16Mixed>>(1), streaming_options<HostOpt<Bf16Mixed>>(2048, nonfinite_policy::skip_step));
  register_model(ref, r);
  run_steps(ref, r, 1, 8, false, 3, 2);
  {
    nvme_model<Bf16Mixed> m;
    NvmeOpt<Bf16Mixed> opt(schedule<NvmeOpt<Bf16Mixed>>(1), shadowed<NvmeOpt<Bf16Mixed>>(2048, in(d)));
    register_model(opt, m);
    run_steps(opt, m, 1, 4, true, 3, 2);  // three commits: every chunk's state in the second half
    CHECK(opt.step_count() == 3);
    run_steps(opt, m, 5, 5, false);  // (a plain step is not shadowed: in place)
    opt.save(file);
  }
  {  // into a shadowed optimizer, and into a plain one
    nvme_model<Bf16Mixed> m;
    NvmeOpt<Bf16Mixed> opt(schedule<NvmeOpt<Bf16Mixed>>(1), shadowed<NvmeOpt<Bf16Mixed>>(2048, in(d)));
    register_model(opt, m);
    run_steps(opt, m, 1, 1, true);  // (one commit: its chunks in the second half, which load writes)
    opt.load(file);
    run_steps(opt, m, 6, 8, true);
    CHECK(snapshot(opt, m) == snapshot(ref, r));
  }
  {
    nvme_model<Bf16Mixed> m;
    HostOpt<Bf16Mixed> opt(schedule<HostOpt<Bf16Mixed>>(1), streaming_options<HostOpt<Bf16Mixed>>(2048, nonfinite_policy::skip_step));
    register_model(opt, m);
    opt.load(file);
    run_steps(opt, m, 6, 8, false);
    CHECK(snapshot(opt, m) == snapshot(ref, r));
  }
  // Refused: a tier in host memory, no fp32 master, the delayed update.
  CHECK_THROWS_WITH((HostOpt<Bf16Mixed>({}, shadowed<HostOpt<Bf16Mixed>>(0))), Catch::Contains("shadow_state"));
  CHECK_THROWS_AS((NvmeOpt<Fp32>({}, shadowed<NvmeOpt<Fp32>>(0, in(d)))), invalid_option);
  auto o           = shadowed<NvmeOpt<Bf16Mixed>>(0, in(d));
  o.delayed_update = true;
  CHECK_THROWS_WITH((NvmeOpt<Bf16Mixed>({}, o)), Catch::Contains("delayed_update"));
  static_assert(NvmeOpt<Bf16Mixed>::can_shadow_state && !HostOpt<Bf16Mixed>::can_shadow_state &&
                !NvmeOpt<Fp32>::can_shadow_state);
  CHECK(d.entries() == std::vector<std::string>{"run.ckpt"});  // (the tiers' files are gone)
}

// --- across ranks (options::ranks): each rank's optimizer over its share of the elements ----

namespace {

/// n ranks' collectives, between n threads of this process: each hook call waits for the
/// other ranks', as an all-reduce or an all-gather would.
struct thread_ranks {
  explicit thread_ranks(std::size_t n) : sync(static_cast<std::ptrdiff_t>(n)), sums(n), found(n) {}
  std::barrier<> sync;
  std::vector<std::vector<double>> sums;
  std::vector<char> found;
  std::atomic<int> verdicts{0};

  bool any_nonfinite(std::size_t r, bool f)
  {
    found[r] = f;
    sync.arrive_and_wait();
    bool const any = std::find(found.begin(), found.end(), char{1}) != found.end();
    sync.arrive_and_wait();
    ++verdicts;
    return any;
  }
  /// The ranks own consecutive element ranges cut at 4096-element blocks: their sums in rank
  /// order are one process's, in its (tensor, block) order.
  double norm(std::size_t r, std::span<double const> s)
  {
    sums[r].assign(s.begin(), s.end());
    sync.arrive_and_wait();
    std::vector<double> all;
    for (auto const& v : sums) { all.insert(all.end(), v.begin(), v.end()); }
    sync.arrive_and_wait();
    return std::sqrt(detail::pairwise_sum(all.data(), all.size()));
  }
};

/// A rank's step over its pieces of the model (tensor k of the rank: pieces[k]), plain or
/// streaming (last piece first).
template <class Opt, class M>
step_result rank_step(Opt& opt, M& m, std::vector<ranks::piece> const& pieces, bool streaming)
{
  auto const all = m.views();
  std::vector<grad_view<typename Opt::grad_type>> views;
  for (auto const& pc : pieces) { views.push_back({all[pc.tensor].data + pc.begin, pc.count, location::host}); }
  if (!streaming) { return opt.step(views); }
  opt.begin_step();
  for (std::size_t k = views.size(); k-- > 0;) { opt.grad_ready(k, views[k]); }
  return opt.finish_step();
}

/// The whole model's pieces: one per tensor (one process).
template <class M>
std::vector<ranks::piece> whole(M const& m)
{
  std::vector<ranks::piece> out;
  for (std::size_t t = 0; t < m.params.size(); ++t) { out.push_back({t, 0, m.params[t].size()}); }
  return out;
}

/// ZeRO-1 in one process: `n` ranks, each in its own thread with its own optimizer (made with
/// `o` and the hooks) over its share of the model (ranks::partition_elements), 6 steps clipped
/// to `clip` (0: not) with an inf at step 3 in one element of tensor 4 (one rank's). Every element then
/// holds the bits of one optimizer over the whole model: params, every slot, step results.
template <class Opt>
void check_ranks(typename Opt::options o, bool streaming, std::size_t n, double clip = 0.05)
{
  nvme_model<Bf16Mixed> ref_m;
  auto ro = streaming_options<HostOpt<Bf16Mixed>>(o.chunk_elements, nonfinite_policy::skip_step, clip);
  HostOpt<Bf16Mixed> ref(schedule<HostOpt<Bf16Mixed>>(1), ro);
  for (std::size_t k = 0; k < ref_m.params.size(); ++k) {
    ref.add_tensor(tensor_name(k), ref_m.params[k].data(), ref_m.params[k].size());
  }
  auto const plant = [](auto& model, int t) {
    model.fill_grads(t);
    if (t == 3) { model.grads[4][5000] = bf16(std::numeric_limits<float>::infinity()); }
  };
  std::vector<step_result> expected;
  for (int t = 1; t <= 6; ++t) {
    plant(ref_m, t);
    expected.push_back(ref.step(ref_m.views()));
  }
  REQUIRE(expected[2].skipped);
  REQUIRE((clip == 0.0 || expected[0].grad_norm > clip));

  nvme_model<Bf16Mixed> m;
  std::vector<std::size_t> sizes;
  for (auto const& p : m.params) { sizes.push_back(p.size()); }
  auto const part = ranks::partition_elements(sizes, n);
  thread_ranks comm(n);
  o.on_nonfinite  = nonfinite_policy::skip_step;
  o.max_grad_norm = clip;
  std::vector<std::vector<step_result>> results(n);
  std::vector<std::vector<std::vector<float>>> slots(n);  // [rank][piece * slots + slot]
  auto run = [&](std::size_t r) {
    auto mine                = o;
    mine.ranks.any_nonfinite = [&comm, r](bool f) { return comm.any_nonfinite(r, f); };
    mine.ranks.norm          = [&comm, r](std::span<double const> s) { return comm.norm(r, s); };
    Opt opt(schedule<Opt>(1), mine);
    auto const& pieces = part.pieces[r];
    for (std::size_t k = 0; k < pieces.size(); ++k) {
      opt.add_tensor("piece" + std::to_string(k), m.params[pieces[k].tensor].data() + pieces[k].begin, pieces[k].count);
    }
    for (int t = 1; t <= 6; ++t) {
      if (r == 0) { plant(m, t); }
      comm.sync.arrive_and_wait();  // (the gradients are filled)
      results[r].push_back(rank_step(opt, m, pieces, streaming));
      comm.sync.arrive_and_wait();
    }
    for (std::size_t k = 0; k < pieces.size(); ++k) {  // every slot's bits, compared below
      for (slot const s : opt.state_layout().slots()) {
        slots[r].emplace_back(pieces[k].count);
        opt.copy_state("piece" + std::to_string(k), s, std::span<float>(slots[r].back()));
      }
    }
  };
  std::vector<std::thread> others;
  for (std::size_t r = 1; r < n; ++r) { others.emplace_back(run, r); }
  run(0);
  for (auto& th : others) { th.join(); }
  CHECK(comm.verdicts == static_cast<int>(6 * n));
  for (int t = 0; t < 6; ++t) {
    INFO("step " << t + 1);
    for (std::size_t r = 0; r < n; ++r) {
      CHECK(results[r][t].skipped == expected[t].skipped);
      CHECK(results[r][t].found_nonfinite == expected[t].found_nonfinite);
      if (!expected[t].skipped) { CHECK(results[r][t].grad_norm == expected[t].grad_norm); }
    }
  }
  for (std::size_t k = 0; k < m.params.size(); ++k) {
    INFO("tensor " << k);
    CHECK(std::memcmp(m.params[k].data(), ref_m.params[k].data(), m.params[k].size() * sizeof(bf16)) == 0);
  }
  auto const names = ref.state_layout().slots();
  for (std::size_t r = 0; r < n; ++r) {
    auto const& pieces = part.pieces[r];
    for (std::size_t k = 0; k < pieces.size(); ++k) {
      std::size_t j = 0;
      for (slot const s : names) {
        std::vector<float> b(m.params[pieces[k].tensor].size());
        ref.copy_state(tensor_name(pieces[k].tensor), s, std::span<float>(b));
        INFO("rank " << r << ", piece " << k << ", slot " << j);
        CHECK(std::memcmp(slots[r][k * names.size() + j].data(), b.data() + pieces[k].begin,
                          pieces[k].count * sizeof(float)) == 0);
        ++j;
      }
    }
  }
}

}  // namespace

TEST_CASE("partition_elements: contiguous ranges cut at 4096-element blocks, balanced and deterministic",
          "[ranks]")
{
  std::vector<std::size_t> const sizes = nvme_sizes;  // 42310 elements
  std::size_t const total = 42310;
  for (std::size_t n = 1; n <= 12; ++n) {
    INFO(n << " ranks");
    auto const p = ranks::partition_elements(sizes, n);
    REQUIRE(p.ranks() == n);
    CHECK(p.first.front() == 0);
    CHECK(p.first.back() == total);
    std::size_t t = 0, at = 0, flat = 0;  // the pieces, in order, cover every element once
    for (std::size_t r = 0; r < n; ++r) {
      CHECK(p.first[r] == flat);
      for (auto const& pc : p.pieces[r]) {
        CHECK(pc.tensor == t);
        CHECK(pc.begin == at);
        CHECK(pc.count > 0);
        CHECK((pc.begin % 4096 == 0));  // each cut at a block (or a tensor's start)
        at += pc.count;
        flat += pc.count;
        if (at == sizes[t]) { ++t, at = 0; }
      }
      // within one block of the even share (the cuts are the nearest to r * total / n)
      CHECK(static_cast<double>(p.elements(r)) >= static_cast<double>(total) / n - 4098);
      CHECK(static_cast<double>(p.elements(r)) <= static_cast<double>(total) / n + 4098);
    }
    CHECK(t == sizes.size());
    CHECK(ranks::partition_elements(sizes, n).pieces == p.pieces);
  }
  // One rank: one piece per tensor. More ranks than blocks: some own nothing.
  auto const one = ranks::partition_elements(sizes, 1);
  CHECK(one.pieces[0].size() == sizes.size());
  std::vector<std::size_t> const small = {100, 200};
  auto const many = ranks::partition_elements(small, 5);
  std::size_t owners = 0;
  for (auto const& v : many.pieces) { owners += v.empty() ? 0 : 1; }
  CHECK(owners >= 1);
  CHECK(many.first.back() == 300);
  CHECK_THROWS_AS(ranks::partition_elements(sizes, 0), invalid_option);
  CHECK_THROWS_WITH(ranks::partition_elements(sizes, 2, 1000), Catch::Contains("block"));
}

TEST_CASE("across ranks: one rank's inf skips every rank's step, and their norm is one optimizer's, bit for bit",
          "[streaming][ranks]")
{
  scratch_dir d;
  SECTION("plain steps, 2 ranks") { check_ranks<HostOpt<Bf16Mixed>>(chunked<HostOpt<Bf16Mixed>>(2048), false, 2); }
  SECTION("plain steps, 3 ranks") { check_ranks<HostOpt<Bf16Mixed>>(chunked<HostOpt<Bf16Mixed>>(2048), false, 3); }
  SECTION("streaming steps, 3 ranks") { check_ranks<HostOpt<Bf16Mixed>>(chunked<HostOpt<Bf16Mixed>>(2048), true, 3); }
  SECTION("streaming steps on a shadowed state, clipped (the check waits), 2 ranks") {
    check_ranks<NvmeOpt<Bf16Mixed>>(shadowed<NvmeOpt<Bf16Mixed>>(2048, in(d)), true, 2);
  }
  SECTION("streaming steps on a shadowed state, the check late (a rank that found nothing undoes), 3 ranks") {
    check_ranks<NvmeOpt<Bf16Mixed>>(shadowed<NvmeOpt<Bf16Mixed>>(2048, in(d)), true, 3, 0.0);
  }
}

TEST_CASE("across ranks: a hook that throws refuses the step, with nothing changed", "[streaming][ranks][errors]")
{
  scratch_dir d;
  for (bool const streaming : {false, true}) {
    for (bool const shadow : {false, true}) {
      if (shadow && !streaming) { continue; }
      INFO("streaming " << streaming << ", shadowed " << shadow);
      bool fail = false;
      auto o    = shadow ? shadowed<NvmeOpt<Bf16Mixed>>(2048, in(d)) : chunked<NvmeOpt<Bf16Mixed>>(2048);
      if (!shadow) { o.tier = in(d); }
      o.ranks.any_nonfinite = [&fail](bool f) {
        if (fail) { throw std::runtime_error("rank 1: an I/O error"); }
        return f;
      };
      nvme_model<Bf16Mixed> m;
      NvmeOpt<Bf16Mixed> opt(schedule<NvmeOpt<Bf16Mixed>>(1), o);
      register_model(opt, m);
      m.fill_grads(1);
      rank_step(opt, m, whole(m), streaming);
      auto const before = snapshot(opt, m);
      fail = true;
      m.fill_grads(2);
      CHECK_THROWS_WITH(rank_step(opt, m, whole(m), streaming), Catch::Contains("rank 1: an I/O error"));
      CHECK(snapshot(opt, m) == before);
      CHECK_FALSE(opt.state_lost());
      fail = false;
      CHECK(rank_step(opt, m, whole(m), streaming).step == 2);
    }
  }
}
