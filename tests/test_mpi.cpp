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
#include <filesystem>
#include <memory>
#include <utility>

#include <unistd.h>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace {

using namespace tierstate;

ranks::mpi* world = nullptr;

std::vector<std::size_t> sizes{10000, 3 * 4096 + 17, 33, 70001, 4097, 8192};

/// Other tensor sizes for a scope.
struct with_sizes {
  std::vector<std::size_t> old;
  explicit with_sizes(std::vector<std::size_t> s) : old(std::exchange(sizes, std::move(s))) {}
  ~with_sizes() { sizes = old; }
};

/// "t0", "t1", ... (appended: GCC 12 warns falsely, -Wrestrict, on "literal" + string&&).
std::string name_of(std::size_t t) { return std::string("t").append(std::to_string(t)); }

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
      grads.back()[grads.back().size() / 2] = T(std::numeric_limits<float>::infinity());
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
  if (sizes.size() > 4) { ref.add_group(h2, {"t2", "t4"}); }

  model<T> m;
  ranks::sharded<Opt, ranks::mpi> sh(*world, h, o);
  for (std::size_t t = 0; t < sizes.size(); ++t) { sh.add_tensor(name_of(t), m.params[t].data(), sizes[t]); }
  if (sizes.size() > 4) { sh.add_group(h2, {"t2", "t4"}); }

  for (int step = 1; step <= 6; ++step) {
    INFO("step " << step);
    ref_m.fill(n, n, step);
    auto rv = ref_m.views();
    auto mv = m.views();
    if (step == 5 && rv.size() > 2) { rv[2] = mv[2] = {}; }  // no gradient, on every rank
    auto const expected = ref.step(rv, static_cast<double>(n));
    m.fill(w.rank(), n, step);
    auto const got = sh.step(mv);
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

/// The first n ranks of the world as a communicator (MPI_COMM_NULL on the others).
struct sub_world {
  MPI_Comm comm = MPI_COMM_NULL;
  explicit sub_world(std::size_t n)
  {
    int const r = static_cast<int>(world->rank());
    MPI_Comm_split(MPI_COMM_WORLD, static_cast<std::size_t>(r) < n ? 0 : MPI_UNDEFINED, r, &comm);
  }
  ~sub_world()
  {
    if (comm != MPI_COMM_NULL) { MPI_Comm_free(&comm); }
  }
};

/// A directory every rank sees: rank 0 makes it, and removes it at the end.
struct shared_dir {
  std::filesystem::path path;
  shared_dir()
  {
    long id = static_cast<long>(::getpid());
    MPI_Bcast(&id, 1, MPI_LONG, 0, MPI_COMM_WORLD);
    path = std::filesystem::temp_directory_path() / ranks::detail::cat("tierstate-test-mpi-", std::to_string(id));
    if (world->rank() == 0) { std::filesystem::create_directories(path); }
    MPI_Barrier(MPI_COMM_WORLD);
  }
  ~shared_dir()
  {
    MPI_Barrier(MPI_COMM_WORLD);
    if (world->rank() == 0) { std::filesystem::remove_all(path); }
  }
  [[nodiscard]] std::size_t files() const
  {
    std::size_t n = 0;
    for (auto const& e : std::filesystem::directory_iterator(path)) { n += e.is_regular_file() ? 1 : 0; }
    return n;
  }
};

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
  SECTION("bf16, reported, clipped") {
    check_against_one<OffloadedOptimizer<AdamW, Bf16Mixed, PinnedHost>>({}, 2.0, nonfinite_policy::report);
  }
  SECTION("fp16 (its sum by ranks::mpi's own reduction), clipped") {
    check_against_one<OffloadedOptimizer<AdamW, Fp16Mixed, PinnedHost>>({}, 2.0, nonfinite_policy::skip_step);
  }
  SECTION("two blocks: at 3 ranks one owns nothing and still takes part") {
    with_sizes const two_blocks({8192});
    check_against_one<OffloadedOptimizer<AdamW, Fp32, PinnedHost>>({}, 2.0, nonfinite_policy::skip_step);
  }
}

/// An optimizer whose step fails on demand before it does anything (an error before the
/// ranks' agreements: the failing rank never calls the hooks, ranks::sharded plays them).
struct failing_optimizer : OffloadedOptimizer<AdamW, Bf16Mixed, test::memory_tier> {
  using base = OffloadedOptimizer<AdamW, Bf16Mixed, test::memory_tier>;
  using base::base;
  static inline bool fail_next = false;
  step_result step(std::span<grad_view<bf16> const> g, double scale)
  {
    if (fail_next) { throw io_error(EIO, "/dev/test-tier", "read"); }
    return base::step(g, scale);
  }
};

TEST_CASE("a rank that fails makes every rank fail, naming it", "[mpi][errors]")
{
  using Opt             = failing_optimizer;
  auto const& w         = *world;
  std::size_t const bad = w.size() - 1;
  int budget            = 1 << 20;  // the writes this rank's tier takes before they fail
  bool fail_reads       = false;
  shared_dir dir;
  auto const make = [&](model<bf16>& m, double clip, nonfinite_policy p) {
    Opt::options o = base<Opt>({}, clip, p);
    o.tier         = {&budget, {}, &fail_reads};
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
      CHECK_THAT(e.what(), Catch::Contains(ranks::detail::cat("rank ", std::to_string(bad), " ")) &&
                             Catch::Contains(others_say));
    } catch (std::exception const& e) {
      CHECK(w.rank() == bad);
      CHECK_THAT(e.what(), Catch::Contains("memory_tier: write failed") || Catch::Contains("memory_tier: read failed") ||
                             Catch::Contains("/dev/test-tier"));
    }
  };
  auto const unchanged = [&](auto& sh, model<bf16> const& m, model<bf16> const& before) {
    CHECK(sh.step_count() == 0);
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      CHECK(std::memcmp(m.params[t].data(), before.params[t].data(), sizes[t] * sizeof(bf16)) == 0);
    }
  };
  SECTION("its state cannot be made (the first step's prepare()): nothing changed, and once it can, the step is taken")
  {
    model<bf16> m;
    model<bf16> const before;
    auto sh = make(m, 2.0, nonfinite_policy::skip_step);
    if (w.rank() == bad) { budget = 0; }
    refused(*sh, m, "nothing changed");
    unchanged(*sh, m, before);
    budget = 1 << 20;
    CHECK(sh->step(m.views()).step == 1);
  }
  /// It fails before the agreements (which it then makes, saying so): nothing changes anywhere.
  auto const before_agreeing = [&](double clip, nonfinite_policy p) {
    model<bf16> m;
    model<bf16> const before;
    auto sh = make(m, clip, p);
    sh->prepare();
    Opt::fail_next = w.rank() == bad;
    refused(*sh, m, "nothing changed");
    Opt::fail_next = false;
    unchanged(*sh, m, before);
    CHECK(sh->step(m.views()).step == 1);
  };
  SECTION("before its update, checked and clipped (in the non-finite flags' all-reduce)") {
    before_agreeing(2.0, nonfinite_policy::skip_step);
  }
  SECTION("before its update, clipped, not checked (in the norm's gather)") {
    before_agreeing(2.0, nonfinite_policy::ignore);
  }
  SECTION("before its update, reported, not clipped") { before_agreeing(0.0, nonfinite_policy::report); }
  SECTION("before its update, neither (in the status word; the others' updates stand)")
  {
    model<bf16> m;
    auto sh = make(m, 0.0, nonfinite_policy::ignore);
    sh->prepare();
    Opt::fail_next = w.rank() == bad;
    refused(*sh, m, "states disagree");
    Opt::fail_next = false;
    CHECK_THROWS(sh->step(m.views()));
  }
  /// Its tier fails during its update (reads, or writes): the others' updates stand, every rank
  /// refuses steps, and a load ends it.
  auto const during_update = [&](bool reads) {
    model<bf16> m;
    auto sh = make(m, 2.0, nonfinite_policy::skip_step);
    (void)sh->step(m.views());
    sh->save(dir.path);
    model<bf16> const saved = m;
    m.fill(w.rank(), w.size(), 2);
    if (w.rank() == bad && reads) { fail_reads = true; }
    if (w.rank() == bad && !reads) { budget = 1; }  // its update's second write fails
    refused(*sh, m, "states disagree");
    fail_reads = false;
    budget     = 1 << 20;
    CHECK_THROWS_WITH(sh->step(m.views()), Catch::Contains("states disagree") || Catch::Contains("failed before"));
    sh->load(dir.path);
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      CHECK(std::memcmp(m.params[t].data(), saved.params[t].data(), sizes[t] * sizeof(bf16)) == 0);
    }
    CHECK(sh->step(m.views()).step == 2);
  };
  SECTION("during its update, a read fails") { during_update(true); }
  SECTION("during its update, a write fails") { during_update(false); }
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
      CHECK_THROWS_WITH(sh.step(views), Catch::Contains("differ"));
    }
    CHECK(sh.step(m.views()).step == 1);  // then a good step is taken
  }
}

namespace {

template <class Opt>
using sharded_mpi = ranks::sharded<Opt, ranks::mpi>;

template <class Opt, class T = typename Opt::param_type>
std::unique_ptr<sharded_mpi<Opt>> make_sharded(ranks::mpi& w, model<T>& m, typename Opt::options const& o)
{
  auto sh = std::make_unique<sharded_mpi<Opt>>(w, typename Opt::hyperparameters{.lr = 1e-2, .weight_decay = 0.1}, o);
  for (std::size_t t = 0; t < sizes.size(); ++t) { sh->add_tensor(name_of(t), m.params[t].data(), sizes[t]); }
  sh->add_group({.lr = 3e-3, .weight_decay = 0.0}, {"t2", "t4"});
  return sh;
}

/// 3 steps on `before` ranks, saved; loaded by `after` ranks into a fresh model, 3 more steps:
/// one optimizer's 6 steps given the same reduced gradients, bit for bit.
template <class Opt>
void check_resume(std::size_t before, std::size_t after, typename Opt::options o)
{
  using T = typename Opt::param_type;
  o       = base<Opt>(o, 2.0, nonfinite_policy::skip_step);
  model<T> ref_m;
  Opt ref({.lr = 1e-2, .weight_decay = 0.1}, o);
  for (std::size_t t = 0; t < sizes.size(); ++t) { ref.add_tensor(name_of(t), ref_m.params[t].data(), sizes[t]); }
  ref.add_group({.lr = 3e-3, .weight_decay = 0.0}, {"t2", "t4"});
  shared_dir dir;
  model<T> m;  // (without a master, the params are the model's, which the trainer saves: this)
  {
    sub_world sub(before);
    if (sub.comm != MPI_COMM_NULL) {
      ranks::mpi w(sub.comm);
      auto sh = make_sharded<Opt>(w, m, o);
      for (int step = 1; step <= 3; ++step) {
        m.fill(w.rank(), before, step);
        (void)sh->step(m.views());
      }
      sh->set_hyperparameters(1, {.lr = 2e-3, .weight_decay = 0.0});  // (saved, and loaded)
      sh->save(dir.path);
    }
  }
  for (int step = 1; step <= 6; ++step) {
    std::size_t const n = step <= 3 ? before : after;
    if (step == 4) { ref.set_hyperparameters(1, {.lr = 2e-3, .weight_decay = 0.0}); }
    ref_m.fill(n, n, step);
    (void)ref.step(ref_m.views(), static_cast<double>(n));
  }
  sub_world sub(after);
  if (sub.comm == MPI_COMM_NULL) { return; }
  ranks::mpi w(sub.comm);
  if constexpr (Opt::precision_type::has_master) {
    m = model<T>{};  // its params as at the start: the load replaces them
  } else {
    for (auto& p : m.params) { MPI_Bcast(p.data(), static_cast<int>(p.size() * sizeof(T)), MPI_BYTE, 0, sub.comm); }
  }
  auto sh = make_sharded<Opt>(w, m, o);
  sh->load(dir.path);
  CHECK(sh->step_count() == 2);  // (step 3 was skipped)
  for (int step = 4; step <= 6; ++step) {
    m.fill(w.rank(), after, step);
    (void)sh->step(m.views());
  }
  CHECK(sh->step_count() == ref.step_count());
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    INFO("tensor " << t);
    CHECK(std::memcmp(m.params[t].data(), ref_m.params[t].data(), sizes[t] * sizeof(T)) == 0);
  }
  if (Opt* local = sh->local()) {
    for (auto const& pc : sh->shares().pieces[w.rank()]) {
      for (slot const s : ref.state_layout().slots()) {
        std::vector<float> whole(sizes[pc.tensor]);
        std::vector<float> part(pc.count);
        ref.copy_state(name_of(pc.tensor), s, std::span<float>(whole));
        local->copy_state(sh->piece_name(pc), s, std::span<float>(part));
        INFO("piece " << sh->piece_name(pc));
        CHECK(std::memcmp(part.data(), whole.data() + pc.begin, pc.count * sizeof(float)) == 0);
      }
    }
  }
}

}  // namespace

TEST_CASE("a sharded checkpoint loads at any rank count, re-partitioned exactly", "[mpi][checkpoint]")
{
  using Nvme = OffloadedOptimizer<AdamW, Bf16Mixed, NvmeFile, Pipelined<2>>;
  Nvme::options nvme;
  nvme.tier.directory = "/tmp";
  for (auto const& [before, after] : {std::pair{2, 2}, {2, 1}, {1, 2}, {1, 3}, {2, 3}, {3, 2}}) {
    if (static_cast<std::size_t>(std::max(before, after)) > world->size()) { continue; }
    SECTION(std::to_string(before) + " ranks to " + std::to_string(after) + ", bf16 on NVMe") {
      check_resume<Nvme>(before, after, nvme);
    }
    SECTION(std::to_string(before) + " ranks to " + std::to_string(after) + ", fp32 in host memory") {
      check_resume<OffloadedOptimizer<AdamW, Fp32, PinnedHost>>(before, after, {});
    }
  }
}

TEST_CASE("a sharded checkpoint refused or failed changes nothing, and leaves nothing behind", "[mpi][checkpoint][errors]")
{
  using Opt             = OffloadedOptimizer<AdamW, Bf16Mixed, test::memory_tier>;
  auto& w               = *world;
  std::size_t const bad = w.size() - 1;
  bool fail_reads       = false;
  Opt::options o        = base<Opt>({}, 2.0, nonfinite_policy::skip_step);
  o.tier                = {nullptr, {}, &fail_reads};
  shared_dir dir;
  model<bf16> m;
  auto sh = make_sharded<Opt>(w, m, o);
  m.fill(w.rank(), w.size(), 1);
  (void)sh->step(m.views());
  sh->save(dir.path);
  std::size_t const files = w.rank() == 0 ? dir.files() : 0;
  m.fill(w.rank(), w.size(), 2);
  (void)sh->step(m.views());
  model<bf16> const after_two = m;

  SECTION("a save that fails on one rank fails on every rank; the previous save stays whole and alone")
  {
    fail_reads = w.rank() == bad;  // its state cannot be read
    CHECK_THROWS_AS(sh->save(dir.path), std::exception);
    fail_reads = false;
    MPI_Barrier(MPI_COMM_WORLD);
    if (w.rank() == 0) { CHECK(dir.files() == files); }
    sh->load(dir.path);  // the first save's
    CHECK(sh->step_count() == 1);
    sh->save(dir.path);  // and a good one replaces it, its files with it
    MPI_Barrier(MPI_COMM_WORLD);
    if (w.rank() == 0) { CHECK(dir.files() == files); }
  }
  SECTION("a damaged file refuses the load on every rank, naming it, with nothing changed")
  {
    if (w.rank() == 0) {
      for (auto const& e : std::filesystem::directory_iterator(dir.path)) {
        if (e.path().filename().string().rfind(ranks::detail::cat("rank", std::to_string(bad), "-"), 0) == 0) {
          std::FILE* f = std::fopen(e.path().c_str(), "r+b");
          std::fseek(f, 5000, SEEK_SET);
          std::fputc(0x5a, f);
          std::fclose(f);
        }
      }
    }
    MPI_Barrier(MPI_COMM_WORLD);
    try {
      sh->load(dir.path);
      FAIL("loaded");
    } catch (ranks::rank_failed const& e) {
      CHECK_THAT(e.what(), Catch::Contains("refused the load"));
    } catch (checkpoint_error const& e) {
      CHECK_THAT(e.what(), Catch::Contains(ranks::detail::cat("rank", std::to_string(bad), "-of-")) &&
                             Catch::Contains("checksum"));
    }
    CHECK(sh->step_count() == 2);
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      CHECK(std::memcmp(m.params[t].data(), after_two.params[t].data(), sizes[t] * sizeof(bf16)) == 0);
    }
  }
  SECTION("a manifest for other tensors is refused by name")
  {
    model<bf16> other;
    ranks::sharded<Opt, ranks::mpi> sh2(w, {}, o);
    sh2.add_tensor("t0", other.params[0].data(), sizes[0]);
    CHECK_THROWS_WITH(sh2.load(dir.path), Catch::Contains("tensors") || Catch::Contains("refused the load"));
  }
}

TEST_CASE("a sharded checkpoint's manifest: written and read back, and refused by name when wrong", "[checkpoint]")
{
  namespace rd = ranks::detail;
  rd::manifest m;
  m.step       = 7;
  m.generation = 0x0123456789abcdefULL;
  m.tensors    = {{"embed weight", 10000}, {"b", 33}};
  m.groups     = {{1e-3, 0.9, 0.999, 1e-8, 0.01, 0.0}, {3e-4, 0.9, 0.95, 1e-8, 0.0, 1.0}};
  m.files      = {{"rank0-of-2.x.tsck", 4096, 99, {{0, 0, 8192}}}, {"rank1-of-2.x.tsck", 8192, 5, {{0, 8192, 1808}, {1, 0, 33}}}};
  auto const text = rd::to_text(m);
  auto const back = rd::parse_manifest(text, "m");
  CHECK(back.tensors == m.tensors);
  CHECK(back.step == 7);
  CHECK(back.generation == m.generation);
  REQUIRE(back.files.size() == 2);
  CHECK(back.files[1].pieces == m.files[1].pieces);
  CHECK(back.files[1].checksum == 5);
  CHECK(back.groups == m.groups);
  auto changed = text;
  changed[text.find("step 7") + 5] = '8';
  CHECK_THROWS_WITH(rd::parse_manifest(changed, "m"), Catch::Contains("checksum"));
  CHECK_THROWS_WITH(rd::parse_manifest(text.substr(0, text.size() - 3), "m"), Catch::Contains("cut short"));
  auto gap = m;
  gap.files[1].pieces[0].begin = 8200;
  gap.files[1].pieces[0].count = 1800;
  CHECK_THROWS_WITH(rd::parse_manifest(rd::to_text(gap), "m"), Catch::Contains("exactly once") && Catch::Contains("embed weight"));
  auto beyond = m;
  beyond.files[1].pieces[1].count = 34;
  CHECK_THROWS_WITH(rd::parse_manifest(rd::to_text(beyond), "m"), Catch::Contains("do not have"));
  auto words = rd::to_text(m);
  words.replace(words.find("ranks 2"), 7, "ranks x");
  words = words.substr(0, words.rfind("end ")); // (its checksum made again)
  words += rd::cat("end ", rd::hex16(checkpoint::checksum(words.data(), words.size())), "\n");
  CHECK_THROWS_WITH(rd::parse_manifest(words, "m"), Catch::Contains("where a number belongs"));
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
  // Hyper-parameters are checked on every rank, owner of the group's elements or not.
  CHECK_THROWS_AS(sh.set_hyperparameters(0, {.lr = -1.0}), invalid_option);
  CHECK_THROWS_WITH(sh.set_hyperparameters(3, {}), Catch::Contains("no group 3"));
}

TEST_CASE("ranks whose settings differ are told so on every rank, without a hang", "[mpi][errors]")
{
  using Host = OffloadedOptimizer<AdamW, Fp32, PinnedHost>;
  auto const& w = *world;
  model<float> m;
  auto o = base<Host>({}, w.rank() == 0 ? 1.0 : 2.0, nonfinite_policy::skip_step);  // rank 0 clips elsewhere
  ranks::sharded<Host, ranks::mpi> sh(*world, {}, o);
  for (std::size_t t = 0; t < sizes.size(); ++t) { sh.add_tensor(name_of(t), m.params[t].data(), sizes[t]); }
  m.fill(w.rank(), w.size(), 1);
  if (w.size() > 1) { CHECK_THROWS_WITH(sh.step(m.views()), Catch::Contains("differ")); }

  // A learning rate set on one rank only.
  ranks::sharded<Host, ranks::mpi> same(*world, {}, base<Host>({}, 1.0, nonfinite_policy::skip_step));
  for (std::size_t t = 0; t < sizes.size(); ++t) { same.add_tensor(name_of(t), m.params[t].data(), sizes[t]); }
  CHECK(same.step(m.views()).step == 1);
  if (w.rank() == 0) { same.set_hyperparameters(0, {.lr = 5e-4}); }
  if (w.size() > 1) { CHECK_THROWS_WITH(same.step(m.views()), Catch::Contains("differ")); }
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
