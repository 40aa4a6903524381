// SPDX-License-Identifier: Apache-2.0
// A user's own transfer (tests/throttled.hpp: Throttled<Depth>, written against the transfer
// concept only) over the host routes: in place, and staged through NvmeFile with and without
// the I/O thread, plain and streaming steps, and through a user's own tier with a write that
// fails; bit for bit as Synchronous does. tests/test_device.cpp runs it over the device routes.
#include "memory_tier.hpp"
#include "nvme_support.hpp"
#include "throttled.hpp"

#include <catch2/catch.hpp>

#include <cstddef>
#include <cstring>
#include <span>
#include <stdexcept>
#include <string_view>
#include <vector>

namespace {

using namespace tierstate;
using namespace tierstate::test;

static_assert(transfer<Throttled<0>> && transfer<Throttled<3>>);
static_assert(transfer<Synchronous> && transfer<Pipelined<1>>);

template <class Transfer>
typename NvmeOpt<Bf16Mixed, Transfer>::options nvme_options(scratch_dir const& d)
{
  typename NvmeOpt<Bf16Mixed, Transfer>::options o;
  o.chunk_elements = 2048;  // 21 chunks: many more than any depth here
  o.tier           = in(d);
  return o;
}

}  // namespace

TEMPLATE_TEST_CASE("a user's transfer over the host-staged route matches Synchronous bit for bit",
                   "[transfer][nvme]", Throttled<0>, Throttled<1>, Throttled<3>)
{
  scratch_dir d;
  auto const sync = on_nvme<Bf16Mixed, Synchronous>(12, 2048, in(d));
  REQUIRE(sync == reference<Bf16Mixed>(12, 2048));
  throttled_computes = 0;
  CHECK(on_nvme<Bf16Mixed, TestType>(12, 2048, in(d)) == sync);
  CHECK(throttled_computes > 12);  // the schedule drove every chunk of every step
  // The step's accounting is the route's, whatever the schedule: the same bytes and chunks.
  using Opt = NvmeOpt<Bf16Mixed, TestType>;
  nvme_model<Bf16Mixed> m;
  Opt opt(schedule<Opt>(1), nvme_options<TestType>(d));
  register_model(opt, m);
  m.fill_grads(1);
  auto const s = opt.step(m.views()).stats;
  std::size_t const chunks = opt.state_layout().chunk_count();
  CHECK(s.chunks == chunks);
  CHECK(s.tier_bytes_read == chunks * opt.state_layout().chunk_bytes());
  CHECK(s.tier_bytes_written == s.tier_bytes_read);
  CHECK(s.tier_bytes_in_place == 0);
}

TEMPLATE_TEST_CASE("a user's transfer runs streaming steps, bit for bit as Synchronous does",
                   "[transfer][nvme][streaming]", Throttled<0>, Throttled<2>)
{
  scratch_dir d;
  auto const sync = train<NvmeOpt<Bf16Mixed, Synchronous>>(8, nvme_options<Synchronous>(d), true);
  CHECK(train<NvmeOpt<Bf16Mixed, TestType>>(8, nvme_options<TestType>(d), true) == sync);
}

TEST_CASE("a user's transfer with an addressable tier: computed in place, as Synchronous", "[transfer]")
{
  using Opt = OffloadedOptimizer<AdamW, Bf16Mixed, PinnedHost, Throttled<2>>;
  Opt::options o;
  o.chunk_elements = 2048;
  CHECK(train<Opt>(12, o) == reference<Bf16Mixed>(12, 2048));
}

TEST_CASE("a user's transfer over a user's tier, and a write that fails: the error, nothing in flight, the state lost",
          "[transfer][errors]")
{
  using Opt = OffloadedOptimizer<AdamW, Bf16Mixed, memory_tier, Throttled<2>>;
  using Sync = OffloadedOptimizer<AdamW, Bf16Mixed, memory_tier, Synchronous>;
  Opt::options o;
  o.chunk_elements = 2048;
  Sync::options so;
  so.chunk_elements = 2048;
  auto const plain = train<Sync>(12, so);
  REQUIRE(plain == reference<Bf16Mixed>(12, 2048));
  CHECK(train<Opt>(12, o) == plain);

  int budget = 1'000'000;
  o.tier = {&budget, {}};
  nvme_model<Bf16Mixed> m;
  Opt opt(schedule<Opt>(1), o);
  register_model(opt, m);
  m.fill_grads(1);
  CHECK(opt.step(m.views()).step == 1);
  budget = 5;  // the sixth write of the next step fails, with later reads and writes queued
  m.fill_grads(2);
  CHECK_THROWS_WITH(opt.step(m.views()), "memory_tier: write failed");
  CHECK(opt.step_count() == 1);
  budget = 1'000'000;
  // Part of the state was updated: the optimizer says so instead of stepping on it.
  CHECK_THROWS_AS(opt.step(m.views()), state_lost);
  std::vector<float> master(m.params[0].size());
  CHECK_THROWS_AS(opt.copy_state(tensor_name(0), slot::master, master), state_lost);
}  // ~Opt: the I/O thread has nothing of the failed step left to finish
