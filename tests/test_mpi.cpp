// SPDX-License-Identifier: Apache-2.0
// ranks::sharded over ranks::mpi, run by mpirun with 2 and 3 ranks (tests/meson.build): the
// sharded steps equal one optimizer over the whole model given the same reduced gradients,
// bit for bit (every param, every slot, every step's result); a rank that fails makes every
// rank fail, naming it, with nothing changed. The gradients are multiples of 2^-8 under
// 2^-2, so their sum over up to 3 ranks is exact in bf16 and in fp32 whatever order MPI adds
// them in: the reference is given that exact sum.
#include "catch_session.hpp"
#include "memory_tier.hpp"

#include <catch2/catch.hpp>
#include <tierstate/ranks/mpi.hpp>
#include <tierstate/ranks/sharded.hpp>
#include <tierstate/tierstate.hpp>

#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace {

using namespace tierstate;

ranks::mpi* world = nullptr;

std::vector<std::size_t> const sizes{10000, 3 * 4096 + 17, 33, 70001, 4097, 8192};

std::string name_of(std::size_t t) { return "t" + std::to_string(t); }

/// Rank r's gradient element: k / 256 with |k| <= 63 (bf16's 8 bits hold a sum of 3), or for
/// fp32 k / 2^21 with |k| < 2^21 (its 24 bits hold the sum; their squares' sums in double do
/// not, so the norm's bits depend on the order they are added in).
template <class T>
float grad_value(std::size_t r, int step, std::size_t t, std::size_t i)
{
  std::uint64_t h = (r + 1) * 0x9E3779B97F4A7C15ULL ^ (static_cast<std::uint64_t>(step) << 40) ^ (t << 32) ^ i;
  h ^= h >> 31;
  h *= 0xBF58476D1CE4E5B9ULL;
  h ^= h >> 29;
  if constexpr (std::is_same_v<T, float>) {
    return static_cast<float>(static_cast<std::int64_t>(h % (1u << 22)) - (1 << 21) + 1) / static_cast<float>(1 << 21);
  }
  return static_cast<float>(static_cast<int>(h % 127) - 63) / 256.0f;
}

template <class T>
struct model {
  std::vector<std::vector<T>> params, grads;
  model()
  {
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      params.emplace_back(sizes[t]);
      grads.emplace_back(sizes[t]);
      for (std::size_t i = 0; i < sizes[t]; ++i) { params[t][i] = T(0.01f * static_cast<float>(i % 97) - 0.5f); }
    }
  }
  /// Rank r's gradients at `step` (r = ranks: their sum), an inf at step 3 from rank 1.
  void fill(std::size_t r, std::size_t ranks, int step)
  {
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      for (std::size_t i = 0; i < sizes[t]; ++i) {
        float g = 0;
        if (r < ranks) {
          g = grad_value<T>(r, step, t, i);
        } else {
          for (std::size_t q = 0; q < ranks; ++q) { g += grad_value<T>(q, step, t, i); }
        }
        grads[t][i] = T(g);
      }
    }
    if (step == 3 && (r == std::min<std::size_t>(1, ranks - 1) || r == ranks)) {
      grads[3][5000] = T(std::numeric_limits<float>::infinity());
    }
  }
  std::vector<grad_view<T>> views() const
  {
    std::vector<grad_view<T>> v;
    for (auto const& g : grads) { v.push_back({g.data(), g.size(), location::host}); }
    return v;
  }
};

template <class Opt>
typename Opt::options base(typename Opt::options o, double clip, nonfinite_policy p)
{
  o.threads        = 1;
  o.chunk_elements = 8192;
  o.max_grad_norm  = clip;
  o.on_nonfinite   = p;
  return o;
}

/// 6 sharded steps against one optimizer over the whole model given their reduced gradients.
template <class Opt>
void check_against_one(typename Opt::options o, double clip, nonfinite_policy p)
{
  using T               = typename Opt::param_type;
  auto const& w         = *world;
  std::size_t const n   = w.size();
  o                     = base<Opt>(o, clip, p);
  typename Opt::hyperparameters const h{.lr = 1e-2, .weight_decay = 0.1};
  typename Opt::hyperparameters const h2{.lr = 3e-3, .weight_decay = 0.0};

  model<T> ref_m;
  Opt ref(h, o);
  for (std::size_t t = 0; t < sizes.size(); ++t) { ref.add_tensor(name_of(t), ref_m.params[t].data(), sizes[t]); }
  ref.add_group(h2, {"t2", "t4"});

  model<T> m;
  ranks::sharded<Opt, ranks::mpi> sh(*world, h, o);
  for (std::size_t t = 0; t < sizes.size(); ++t) { sh.add_tensor(name_of(t), m.params[t].data(), sizes[t]); }
  sh.add_group(h2, {"t2", "t4"});

  for (int step = 1; step <= 6; ++step) {
    INFO("step " << step);
    ref_m.fill(n, n, step);
    auto const expected = ref.step(ref_m.views(), static_cast<double>(n));
    m.fill(w.rank(), n, step);
    auto const got = sh.step(m.views());
    CHECK(got.skipped == expected.skipped);
    CHECK(got.found_nonfinite == expected.found_nonfinite);
    CHECK(got.grad_norm == expected.grad_norm);
    CHECK(got.step == expected.step);
    if (step == 3 && p == nonfinite_policy::skip_step) { CHECK(got.skipped); }
  }
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    INFO("tensor " << t);
    CHECK(std::memcmp(m.params[t].data(), ref_m.params[t].data(), sizes[t] * sizeof(T)) == 0);
  }
  if (Opt* local = sh.local()) {
    for (auto const& pc : sh.shares().pieces[w.rank()]) {
      for (slot const s : ref.state_layout().slots()) {
        std::vector<float> whole(sizes[pc.tensor]);
        std::vector<float> part(pc.count);
        ref.copy_state(name_of(pc.tensor), s, std::span<float>(whole));
        local->copy_state(sh.piece_name(pc), s, std::span<float>(part));
        INFO("piece " << sh.piece_name(pc));
        CHECK(std::memcmp(part.data(), whole.data() + pc.begin, pc.count * sizeof(float)) == 0);
      }
    }
  }
  // Memory: this rank's share of the state, to within one chunk.
  std::size_t const total = ref.state_layout().total_bytes();
  std::size_t const chunk = ref.state_layout().chunk_bytes();
  std::printf("rank %zu of %zu: state %zu bytes of %zu (1/%zu: %zu, + one chunk: %zu)\n", w.rank(), n,
              sh.state_bytes(), total, n, total / n, chunk);
  CHECK(sh.state_bytes() <= total / n + chunk);
}

}  // namespace

TEST_CASE("sharded steps equal one optimizer given the reduced gradients, bit for bit", "[mpi]")
{
  SECTION("fp32, pinned host memory, clipped")
  {
    check_against_one<OffloadedOptimizer<AdamW, Fp32, PinnedHost>>({}, 2.0, nonfinite_policy::skip_step);
  }
  SECTION("bf16 with an fp32 master, on NVMe, clipped")
  {
    OffloadedOptimizer<AdamW, Bf16Mixed, NvmeFile, Pipelined<2>>::options o;
    o.tier.directory = "/tmp";
    check_against_one<OffloadedOptimizer<AdamW, Bf16Mixed, NvmeFile, Pipelined<2>>>(o, 2.0,
                                                                                    nonfinite_policy::skip_step);
  }
  SECTION("bf16, not checked, not clipped") {
    check_against_one<OffloadedOptimizer<AdamW, Bf16Mixed, PinnedHost>>({}, 0.0, nonfinite_policy::ignore);
  }
  SECTION("bf16, reported, not clipped") {
    check_against_one<OffloadedOptimizer<AdamW, Bf16Mixed, PinnedHost>>({}, 0.0, nonfinite_policy::report);
  }
}

TEST_CASE("a rank that fails makes every rank fail, naming it, with nothing changed", "[mpi][errors]")
{
  using Opt             = OffloadedOptimizer<AdamW, Bf16Mixed, test::memory_tier>;  // writes fail on demand
  auto const& w         = *world;
  std::size_t const bad = w.size() - 1;
  int budget            = 1 << 20;  // the writes this rank's tier takes before they fail
  auto const make = [&](model<bf16>& m, double clip, nonfinite_policy p) {
    Opt::options o = base<Opt>({}, clip, p);
    o.tier         = {&budget, {}};
    auto sh        = std::make_unique<ranks::sharded<Opt, ranks::mpi>>(*world, Opt::hyperparameters{.lr = 1e-2}, o);
    for (std::size_t t = 0; t < sizes.size(); ++t) { sh->add_tensor(name_of(t), m.params[t].data(), sizes[t]); }
    m.fill(w.rank(), w.size(), 1);
    return sh;
  };
  /// The step throws on every rank: the failing one its own error, the others rank_failed.
  auto const refused = [&](auto& sh, model<bf16> const& m, char const* others_say) {
    try {
      (void)sh.step(m.views());
      FAIL("the step was taken");
    } catch (ranks::rank_failed const& e) {
      CHECK(w.rank() != bad);
      CHECK(e.failed_ranks() == std::vector<std::size_t>{bad});
      CHECK_THAT(e.what(), Catch::Contains("rank " + std::to_string(bad) + " failed") && Catch::Contains(others_say));
    } catch (std::exception const& e) {
      CHECK(w.rank() == bad);
      CHECK_THAT(e.what(), Catch::Contains("memory_tier: write failed"));
    }
  };
  auto const before_update = [&](double clip, nonfinite_policy p) {
    model<bf16> m;
    model<bf16> const before;
    auto sh = make(m, clip, p);
    if (w.rank() == bad) { budget = 0; }  // its state cannot be made
    refused(*sh, m, "nothing changed");
    CHECK(sh->step_count() == 0);
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      CHECK(std::memcmp(m.params[t].data(), before.params[t].data(), sizes[t] * sizeof(bf16)) == 0);
    }
    budget = 1 << 20;  // and once it can, the step is taken on every rank
    CHECK(sh->step(m.views()).step == 1);
  };
  SECTION("before its update, checked and clipped (it says so in the non-finite flags' all-reduce)") {
    before_update(2.0, nonfinite_policy::skip_step);
  }
  SECTION("before its update, clipped, not checked (in the norm's gather)") {
    before_update(2.0, nonfinite_policy::ignore);
  }
  SECTION("before its update, neither (in the status word)") { before_update(0.0, nonfinite_policy::ignore); }
  SECTION("during its update: the others' updates stand, and every rank refuses steps until a load")
  {
    model<bf16> m;
    auto sh = make(m, 2.0, nonfinite_policy::skip_step);
    if (Opt* local = sh->local()) { (void)local->state_layout(); }  // (the state made)
    if (w.rank() == bad) { budget = 1; }                             // its update's second write fails
    refused(*sh, m, "states disagree");
    budget = 1 << 20;
    CHECK_THROWS(sh->step(m.views()));
  }
}

TEST_CASE("a rank's bad arguments refuse the step on every rank, before any gradient moves", "[mpi][errors]")
{
  auto const& w         = *world;
  std::size_t const bad = w.size() - 1;
  {
    using Host = OffloadedOptimizer<AdamW, Bf16Mixed, PinnedHost>;
    model<bf16> m;
    ranks::sharded<Host, ranks::mpi> sh(*world, {.lr = 1e-2}, base<Host>({}, 0.0, nonfinite_policy::skip_step));
    for (std::size_t t = 0; t < sizes.size(); ++t) { sh.add_tensor(name_of(t), m.params[t].data(), sizes[t]); }
    m.fill(w.rank(), w.size(), 1);
    auto views = m.views();
    if (w.rank() == bad) { views.pop_back(); }
    if (w.rank() == bad) {
      CHECK_THROWS_AS(sh.step(views), invalid_option);
    } else {
      CHECK_THROWS_AS(sh.step(views), ranks::rank_failed);
    }
    if (w.size() > 1) {
      views = m.views();
      if (w.rank() == 0) { views[2] = {}; }  // rank 0 alone says t2 has no gradient
      CHECK_THROWS_WITH(sh.step(views), Catch::Contains("disagree"));
    }
    CHECK(sh.step(m.views()).step == 1);  // then a good step is taken
  }
}

TEST_CASE("ranks::sharded refuses what it cannot do, by name", "[mpi][errors]")
{
  using Host = OffloadedOptimizer<AdamW, Fp32, PinnedHost>;
  Host::options o;
  o.delayed_update = true;
  CHECK_THROWS_WITH((ranks::sharded<Host, ranks::mpi>(*world, {}, o)), Catch::Contains("delayed_update"));
  o = {};
  o.ranks.norm = [](std::span<double const>) { return 0.0; };
  CHECK_THROWS_WITH((ranks::sharded<Host, ranks::mpi>(*world, {}, o)), Catch::Contains("ranks"));
  CHECK_THROWS_WITH((ranks::sharded<Host, ranks::mpi>(*world, {}, {}, {.block = 1000})), Catch::Contains("block"));
  std::vector<float> p(10);
  ranks::sharded<Host, ranks::mpi> sh(*world);
  CHECK_THROWS_AS(sh.add_tensor("a", nullptr, 10), invalid_option);
  sh.add_tensor("a", p.data(), p.size());
  CHECK_THROWS_WITH(sh.add_tensor("a", p.data(), p.size()), Catch::Contains("registered already"));
  CHECK_THROWS_WITH(sh.add_group({}, {"b"}), Catch::Contains("no tensor 'b'"));
  (void)sh.shares();
  CHECK_THROWS_WITH(sh.add_tensor("c", p.data(), p.size()), Catch::Contains("fixed"));
}

int main(int argc, char** argv)
{
  MPI_Init(&argc, &argv);
  int rc = 0;
  {
    ranks::mpi w(MPI_COMM_WORLD);
    world = &w;
    rc    = tierstate::test::run_catch(argc, argv);
    world = nullptr;
  }
  // Every rank's verdict: one rank's failure fails the run on every rank.
  int worst = 0;
  MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return worst;
}
