// SPDX-License-Identifier: Apache-2.0
#include <tierstate/core/thread_pool.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <stdexcept>
#include <thread>
#include <vector>

#include <sched.h>

using namespace tierstate;

TEST_CASE("the default size is the affinity mask's CPU count", "[thread_pool]")
{
  thread_pool pool;
  CHECK(available_cpus() >= 1);
  CHECK(pool.size() == available_cpus());
  CHECK_THROWS_AS(thread_pool(5000), invalid_option);
}

TEST_CASE("parallel_for covers the range once, on grain boundaries", "[thread_pool]")
{
  for (std::size_t const threads : {1u, 2u, 3u, 8u}) {
    thread_pool pool(threads);
    CHECK(pool.size() == threads);
    for (std::size_t const n : {0u, 1u, 63u, 64u, 65u, 1000u, 100003u}) {
      for (std::size_t const grain : {1u, 16u, 1024u}) {
        std::vector<std::atomic<int>> hits(n);
        std::atomic<int> parts{0};
        std::atomic<bool> misaligned{false};
        pool.parallel_for(n, grain, [&](std::size_t b, std::size_t e) {
          ++parts;
          if (b % grain != 0 || (e != n && e % grain != 0) || b >= e) { misaligned = true; }
          for (std::size_t i = b; i < e; ++i) { ++hits[i]; }
        });
        INFO("threads " << threads << " n " << n << " grain " << grain);
        CHECK_FALSE(misaligned);
        CHECK(static_cast<std::size_t>(parts.load()) <= threads);
        std::size_t wrong = 0;
        for (auto const& h : hits) { wrong += h.load() != 1; }
        CHECK(wrong == 0);
      }
    }
  }
}

TEST_CASE("an exception in a part reaches the caller, and the pool keeps working", "[thread_pool]")
{
  thread_pool pool(4);
  CHECK_THROWS_WITH(pool.parallel_for(4000, 1, [](std::size_t b, std::size_t) {
                      if (b > 0) { throw std::runtime_error("part failed"); }
                    }),
                    "part failed");
  std::atomic<std::size_t> sum{0};
  pool.parallel_for(4000, 1, [&](std::size_t b, std::size_t e) { sum += e - b; });
  CHECK(sum == 4000);
}

TEST_CASE("several threads may call parallel_for at once", "[thread_pool]")
{
  thread_pool pool(3);
  std::atomic<std::size_t> total{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < 4; ++c) {
    callers.emplace_back([&] {
      for (int r = 0; r < 50; ++r) {
        pool.parallel_for(1000, 8, [&](std::size_t b, std::size_t e) { total += e - b; });
      }
    });
  }
  for (auto& t : callers) { t.join(); }
  CHECK(total == 4u * 50u * 1000u);
}

TEST_CASE("physical_cores binds each worker to one CPU of its own core; the caller is never bound", "[thread_pool]")
{
  std::vector<int> const cores = physical_core_cpus();
  REQUIRE(!cores.empty());
  CHECK(cores.size() <= available_cpus());
  CHECK(std::is_sorted(cores.begin(), cores.end()));
  cpu_set_t caller_before;
  REQUIRE(sched_getaffinity(0, sizeof caller_before, &caller_before) == 0);
  SECTION("threads = 0: one per physical core")
  {
    thread_pool pool(0, thread_binding::physical_cores);
    CHECK(pool.size() == cores.size());
    auto const cpus = pool.bound_cpus();
    REQUIRE(cpus.size() == pool.size());
    CHECK(cpus[0] == -1);
    for (std::size_t i = 1; i < cpus.size(); ++i) { CHECK(cpus[i] == cores[i % cores.size()]); }
    // Each worker runs where it is bound: every part reports its CPU.
    std::vector<int> ran(pool.size(), -2);
    pool.parallel_for(pool.size(), 1, [&](std::size_t b, std::size_t e) {
      for (std::size_t i = b; i < e; ++i) { ran[i] = sched_getcpu(); }
    });
    for (std::size_t i = 1; i < ran.size(); ++i) { CHECK(ran[i] == cpus[i]); }
  }
  SECTION("more threads than cores: the cores, then their siblings, every allowed CPU before any twice")
  {
    std::size_t const cpus_allowed = available_cpus();
    thread_pool pool(cpus_allowed * 2 + 1, thread_binding::physical_cores);
    auto const cpus = pool.bound_cpus();
    for (std::size_t i = 1; i < cores.size(); ++i) { CHECK(cpus[i] == cores[i]); }
    std::vector<int> first_round(cpus.begin() + 1, cpus.begin() + static_cast<std::ptrdiff_t>(cpus_allowed));
    std::sort(first_round.begin(), first_round.end());
    CHECK(std::adjacent_find(first_round.begin(), first_round.end()) == first_round.end());  // none twice
    for (std::size_t i = 1; i + cpus_allowed < cpus.size(); ++i) { CHECK(cpus[i + cpus_allowed] == cpus[i]); }
  }
  SECTION("none binds nothing")
  {
    thread_pool pool(3);
    CHECK(pool.bound_cpus() == std::vector<int>{-1, -1, -1});
  }
  cpu_set_t caller_after;
  REQUIRE(sched_getaffinity(0, sizeof caller_after, &caller_after) == 0);
  CHECK(CPU_EQUAL(&caller_before, &caller_after));
}
