// SPDX-License-Identifier: Apache-2.0
// The rules beyond Adam in whole compositions: SGD (no slot; on fp32 params no state at
// all), SGD with momentum and Lion, through NvmeFile with Pipelined<2>, in streaming steps,
// and across a checkpoint into another tier, bit for bit as PinnedHost's plain steps; and a
// checkpoint of one rule refused by another, by name, with nothing changed.
#include "nvme_support.hpp"

#include <catch2/catch.hpp>

#include <string>
#include <tuple>
#include <utility>
#include <vector>

using namespace tierstate;
using namespace tierstate::test;

namespace {

template <class R, class P>
using host_opt = OffloadedOptimizer<R, P, PinnedHost, Synchronous>;
template <class R, class P>
using nvme_opt = OffloadedOptimizer<R, P, NvmeFile, Pipelined<2>>;

template <class Opt>
typename Opt::options options_for(std::size_t chunk, scratch_dir const* d = nullptr)
{
  typename Opt::options o;
  o.chunk_elements = chunk;
  if constexpr (std::is_same_v<typename Opt::tier_type, NvmeFile>) { o.tier = in(*d); }
  return o;
}

/// Opt over the test model, stepped on train()'s schedule from step `from` to `to`.
template <class Opt>
struct trainer {
  nvme_model<typename Opt::precision_type> m;
  Opt opt;
  explicit trainer(typename Opt::options const& o) : opt(schedule<Opt>(1), o) { register_model(opt, m); }
  void steps(int from, int to)
  {
    for (int t = from; t <= to; ++t) {
      m.fill_grads(t);
      opt.set_hyperparameters(0, schedule<Opt>(t));
      auto const views = m.views();
      opt.step(views);
    }
  }
};

}  // namespace

TEMPLATE_TEST_CASE("each rule gives PinnedHost's bits on NvmeFile, streaming, and across a checkpoint",
                   "[rules][nvme][checkpoint]", (std::pair<SGD, Fp32>), (std::pair<SGD, Bf16Mixed>),
                   (std::pair<SGDMomentum, Bf16Mixed>), (std::pair<Lion, Fp32>))
{
  using R = typename TestType::first_type;
  using P = typename TestType::second_type;
  scratch_dir d;
  run_result const straight = train<host_opt<R, P>>(9, options_for<host_opt<R, P>>(2048));
  CHECK(straight.steps == 9);
  CHECK(straight.slots.size() == R::slots.size() + (P::has_master ? 1 : 0));

  SECTION("NvmeFile, Pipelined<2>")
  {
    auto const got = train<nvme_opt<R, P>>(9, options_for<nvme_opt<R, P>>(2048, &d));
    CHECK(got == straight);
  }
  SECTION("streaming steps")
  {
    auto const got = train<host_opt<R, P>>(9, options_for<host_opt<R, P>>(4096), true);
    CHECK(got == straight);
  }
  SECTION("PinnedHost, saved after 5 steps, loaded into NvmeFile, 4 more")
  {
    auto const ckpt = d.path / "opt.ckpt";
    trainer<host_opt<R, P>> a(options_for<host_opt<R, P>>(2048));
    a.steps(1, 5);
    a.opt.save(ckpt);
    trainer<nvme_opt<R, P>> b(options_for<nvme_opt<R, P>>(2048, &d));
    b.m.params = a.m.params;  // the model's weights, which the user checkpoints
    b.opt.load(ckpt);
    CHECK(b.opt.step_count() == 5);
    b.steps(6, 9);
    CHECK(snapshot(b.opt, b.m) == straight);
    std::filesystem::remove(ckpt);
  }
  CHECK(d.entries().empty());  // no scratch file, no temporary left behind
}

TEST_CASE("a checkpoint of SGD is refused by SGD with momentum, by the rule's name, and changes nothing",
          "[rules][checkpoint][errors]")
{
  scratch_dir d;
  auto const ckpt = d.path / "sgd.ckpt";
  trainer<host_opt<SGD, Bf16Mixed>> a(options_for<host_opt<SGD, Bf16Mixed>>(2048));
  a.steps(1, 3);
  a.opt.save(ckpt);

  trainer<host_opt<SGDMomentum, Bf16Mixed>> b(options_for<host_opt<SGDMomentum, Bf16Mixed>>(2048));
  b.steps(1, 2);
  auto const before = snapshot(b.opt, b.m);
  try {
    b.opt.load(ckpt);
    FAIL("an sgd checkpoint was loaded into sgd_momentum");
  } catch (checkpoint_error const& e) {
    std::string const what = e.what();
    CHECK(what.find("was saved with rule 'sgd', and this optimizer has 'sgd_momentum'") != std::string::npos);
    CHECK(what.find(ckpt.string()) != std::string::npos);
  }
  CHECK(snapshot(b.opt, b.m) == before);
  b.steps(3, 3);  // and it goes on
  CHECK(b.opt.step_count() == 3);
}
