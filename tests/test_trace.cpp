// SPDX-License-Identifier: Apache-2.0
// The tracer (core/trace.hpp): a traced NvmeFile + Pipelined<2> step has each chunk's phases
// once, in order, with reads running ahead of the compute; the JSON it writes is what Chrome's
// trace-event format asks for (tests/check_trace.py parses a real one); tracing never changes
// a bit of the result; a full tracer drops and counts; a bad path is an io_error and leaves
// nothing. And progress (core/progress.hpp): making the state, save, and load's two passes
// each report every chunk, rising to the total, and a callback that throws cancels cleanly.
#include "memory_tier.hpp"
#include "nvme_support.hpp"

#include <tierstate/tierstate.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <map>
#include <stdexcept>
#include <thread>
#include <tuple>
#include <sstream>
#include <vector>

using namespace tierstate;
using namespace tierstate::test;

namespace {

constexpr std::size_t chunk_elements = std::size_t{1} << 18;

/// A few tensors over ten chunks (the last one partly full).
std::vector<std::size_t> const sizes = {chunk_elements * 3 + 5, 7, chunk_elements * 6 + 1000};

struct model {
  std::vector<std::vector<float>> params, grads;
  explicit model(std::uint64_t seed)
  {
    for (std::size_t n : sizes) {
      std::vector<float> p(n), g(n);
      for (std::size_t i = 0; i < n; ++i) {
        p[i] = init_value(i + seed);
        g[i] = grad_value(i, seed);
      }
      params.push_back(std::move(p));
      grads.push_back(std::move(g));
      ++seed;
    }
  }
  std::vector<grad_view<float>> views() const
  {
    std::vector<grad_view<float>> v;
    for (auto const& g : grads) { v.push_back({g.data(), g.size()}); }
    return v;
  }
};

template <class Optimizer>
void add_tensors(Optimizer& opt, model& m)
{
  for (std::size_t t = 0; t < m.params.size(); ++t) {
    opt.add_tensor(tensor_name(t), m.params[t].data(), m.params[t].size());
  }
}

/// The events of `phase` for each chunk.
std::map<std::int64_t, std::vector<trace_event>> by_chunk(tracer const& t, trace_phase phase)
{
  std::map<std::int64_t, std::vector<trace_event>> out;
  for (auto const& e : t.events()) {
    if (e.phase == phase) { out[e.chunk].push_back(e); }
  }
  return out;
}

std::size_t count(tracer const& t, trace_phase phase)
{
  auto const ev = t.events();
  return static_cast<std::size_t>(std::count_if(ev.begin(), ev.end(), [&](auto const& e) { return e.phase == phase; }));
}

}  // namespace

TEST_CASE("a traced NvmeFile + Pipelined<2> step: each chunk's phases once, in order, reads ahead of compute",
          "[trace][nvme]")
{
  scratch_dir d;
  using Optimizer = OffloadedOptimizer<AdamW, Fp32, NvmeFile, Pipelined<2>>;
  Optimizer::options o;
  o.tier.directory  = d.path;
  o.chunk_elements  = chunk_elements;
  o.threads         = 2;
  model m(7);
  Optimizer opt({.lr = 1e-3, .weight_decay = 0.01}, o);
  add_tensors(opt, m);
  auto const grads = m.views();
  (void)opt.step(grads);  // the state made, the file written once

  tracer t;
  opt.trace(&t);
  CHECK(opt.tracing() == &t);
  step_result const r = opt.step(grads);
  opt.trace(nullptr);
  (void)opt.step(grads);  // not traced
  std::size_t const chunks = opt.state_layout().chunk_count();
  REQUIRE(chunks == 10);
  std::uint64_t const chunk_bytes = opt.state_layout().chunk_bytes();

  CHECK(t.dropped() == 0);
  CHECK(count(t, trace_phase::step) == 1);
  CHECK(count(t, trace_phase::check) == 1);
  CHECK(count(t, trace_phase::write_wait) == 1);
  auto const reads = by_chunk(t, trace_phase::read), waits = by_chunk(t, trace_phase::read_wait),
             computes = by_chunk(t, trace_phase::compute), writes = by_chunk(t, trace_phase::write),
             kernels = by_chunk(t, trace_phase::kernel);
  auto const step = by_chunk(t, trace_phase::step).at(-1).front();
  std::uint64_t read_bytes = 0, written_bytes = 0;
  for (std::size_t k = 0; k < chunks; ++k) {
    INFO("chunk " << k);
    auto const key = static_cast<std::int64_t>(k);
    REQUIRE(reads.at(key).size() == 1);
    REQUIRE(waits.at(key).size() == 1);
    REQUIRE(computes.at(key).size() == 1);
    REQUIRE(writes.at(key).size() == 1);
    auto const& rd = reads.at(key)[0];
    auto const& wt = waits.at(key)[0];
    auto const& cp = computes.at(key)[0];
    auto const& wr = writes.at(key)[0];
    // In order: read, its wait, compute (every thread's part inside it), write; all in the step.
    CHECK(step.begin_ns <= rd.begin_ns);
    CHECK(rd.begin_ns <= rd.end_ns);
    CHECK(rd.end_ns <= wt.end_ns);
    CHECK(wt.end_ns <= cp.begin_ns);
    CHECK(cp.end_ns <= wr.begin_ns);
    CHECK(wr.end_ns <= step.end_ns);
    CHECK(rd.bytes == chunk_bytes);
    CHECK(wr.bytes == chunk_bytes);
    CHECK(rd.track >= tracer::io_track_base);
    CHECK(wr.track >= tracer::io_track_base);
    CHECK(cp.track == step.track);
    REQUIRE(!kernels.at(key).empty());
    for (auto const& kn : kernels.at(key)) {
      CHECK(cp.begin_ns <= kn.begin_ns);
      CHECK(kn.end_ns <= cp.end_ns);
    }
    read_bytes += rd.bytes;
    written_bytes += wr.bytes;
  }
  CHECK(read_bytes == r.stats.tier_bytes_read);
  CHECK(written_bytes == r.stats.tier_bytes_written);
  // And the reads ran ahead: chunk k+1's read was in flight before chunk k's compute ended
  // (the first Depth + 1 reads start together, before any compute: a pipeline that waited for
  // each compute before its next read would have none). Whether a read is still running when
  // the compute starts depends on the disk's speed against the compute's: counted, and shown.
  std::size_t ahead = 0, overlapping = 0;
  for (std::size_t k = 0; k + 1 < chunks; ++k) {
    auto const& next = reads.at(static_cast<std::int64_t>(k + 1))[0];
    auto const& cp   = computes.at(static_cast<std::int64_t>(k))[0];
    ahead += next.begin_ns < cp.end_ns ? 1 : 0;
    overlapping += next.begin_ns < cp.end_ns && next.end_ns > cp.begin_ns ? 1 : 0;
  }
  WARN("chunk k+1's read began before chunk k's compute ended for " << ahead << " of " << chunks - 1
       << " chunks, and was still running when it began for " << overlapping);
  CHECK(ahead > 0);
  CHECK(d.entries().empty());
}

TEST_CASE("tracing changes no bit of the result, on every route", "[trace]")
{
  scratch_dir d;
  auto run = [&]<class Optimizer>(std::type_identity<Optimizer>, typename Optimizer::options o, bool traced) {
    o.chunk_elements = chunk_elements;
    model m(11);
    Optimizer opt({.lr = 1e-3, .weight_decay = 0.01}, o);
    add_tensors(opt, m);
    tracer t;
    if (traced) { opt.trace(&t); }
    for (int s = 0; s < 3; ++s) { (void)opt.step(m.views()); }
    if (traced) { CHECK(count(t, trace_phase::step) == 3); }
    return m.params;
  };
  using Pinned = OffloadedOptimizer<AdamW, Fp32, PinnedHost>;
  using Nvme   = OffloadedOptimizer<AdamW, Fp32, NvmeFile, Pipelined<2>>;
  using Staged = OffloadedOptimizer<AdamW, Fp32, memory_tier, Synchronous>;
  CHECK(run(std::type_identity<Pinned>{}, {}, true) == run(std::type_identity<Pinned>{}, {}, false));
  Nvme::options no;
  no.tier.directory = d.path;
  CHECK(run(std::type_identity<Nvme>{}, no, true) == run(std::type_identity<Nvme>{}, no, false));
  CHECK(run(std::type_identity<Staged>{}, {}, true) == run(std::type_identity<Staged>{}, {}, false));
}

TEST_CASE("the tracer's JSON, its limits, and its file", "[trace]")
{
  using Optimizer = OffloadedOptimizer<AdamW, Fp32, memory_tier, Synchronous>;
  Optimizer::options o;
  o.chunk_elements = chunk_elements;
  model m(3);
  Optimizer opt({.lr = 1e-3}, o);
  add_tensors(opt, m);

  SECTION("a synchronous staged step: read and write on the step's thread")
  {
    tracer t;
    opt.trace(&t);
    (void)opt.step(m.views());
    auto const reads = by_chunk(t, trace_phase::read);
    REQUIRE(reads.size() == 10);
    CHECK(reads.at(0)[0].track == tracer::this_thread_track());
    std::ostringstream json;
    t.write_chrome_json(json);
    std::string const s = json.str();
    CHECK(s.rfind("{\"displayTimeUnit\":\"ms\"", 0) == 0);
    CHECK(s.find("\"traceEvents\":[") != std::string::npos);
    CHECK(s.find("\"name\":\"read\",\"cat\":\"io\",\"ph\":\"X\"") != std::string::npos);
    CHECK(s.find("\"name\":\"step thread ") != std::string::npos);
    CHECK(s.substr(s.size() - 4) == "\n]}\n");
  }
  SECTION("a full tracer drops and counts; clear() empties it")
  {
    tracer t(5);
    opt.trace(&t);
    (void)opt.step(m.views());
    CHECK(t.events().size() == 5);
    CHECK(t.dropped() > 0);
    t.clear();
    CHECK(t.events().empty());
    CHECK(t.dropped() == 0);
  }
  SECTION("bad capacities and paths are refused by name, and leave nothing")
  {
    CHECK_THROWS_AS(tracer(0), invalid_option);
    CHECK_THROWS_WITH(tracer(0), Catch::Contains("tracer.capacity"));
    tracer t;
    scratch_dir d;
    CHECK_THROWS_AS(t.save(d.path / "no" / "such" / "dir.json"), io_error);
    CHECK_THROWS_WITH(t.save(d.path / "missing" / "x.json"), Catch::Contains("missing/x.json"));
    t.save(d.path / "ok.json");
    CHECK(d.entries() == std::vector<std::string>{"ok.json"});
  }
  SECTION("trace() is refused during a streaming step")
  {
    tracer t;
    opt.begin_step();
    CHECK_THROWS_AS(opt.trace(&t), logic_error);
    CHECK(opt.tracing() == nullptr);
    (void)opt.finish_step();
  }
}

TEST_CASE("progress: making the state, save, and load's verify and load passes", "[progress][checkpoint]")
{
  scratch_dir d;
  using Optimizer = OffloadedOptimizer<AdamW, Bf16Mixed, NvmeFile, Pipelined<2>>;
  std::vector<std::tuple<progress_phase, std::uint64_t, std::uint64_t>> heard;
  Optimizer::options o;
  o.tier.directory = d.path;
  o.chunk_elements = 4096;
  o.progress       = [&](progress_phase p, std::uint64_t done, std::uint64_t total) { heard.emplace_back(p, done, total); };
  std::vector<bf16> p(4096 * 5 + 77), g(p.size());
  for (std::size_t i = 0; i < p.size(); ++i) {
    p[i] = bf16(init_value(i));
    g[i] = bf16(grad_value(i, 1));
  }
  Optimizer opt({.lr = 1e-3}, o);
  opt.add_tensor("w", p.data(), p.size());
  std::vector<grad_view<bf16>> grads{{g.data(), g.size()}};
  /// The calls of phase `ph`: rising by whole chunks to the total, which the last one reaches.
  auto check_phase = [&](progress_phase ph, std::uint64_t total, std::size_t calls) {
    INFO(to_string(ph));
    std::vector<std::pair<std::uint64_t, std::uint64_t>> seen;
    for (auto const& [q, done, tot] : heard) {
      if (q == ph) { seen.emplace_back(done, tot); }
    }
    REQUIRE(seen.size() == calls);
    for (std::size_t i = 0; i < seen.size(); ++i) {
      CHECK(seen[i].second == total);
      if (i > 0) { CHECK(seen[i].first > seen[i - 1].first); }
    }
    CHECK(seen.back().first == total);
  };
  (void)opt.step(grads);  // makes the state: 6 chunks
  std::uint64_t const state_bytes = opt.state_layout().total_bytes();
  check_phase(progress_phase::make_state, state_bytes, 6);

  heard.clear();
  auto const file = d.path / "ckpt";
  opt.save(file);
  check_phase(progress_phase::save, std::filesystem::file_size(file), 6 + 1);  // the chunks, then the table
  heard.clear();
  opt.load(file);
  check_phase(progress_phase::verify, state_bytes, 6);
  check_phase(progress_phase::load, state_bytes, 6);

  SECTION("a callback that throws in save leaves no file, in load's verify pass changes nothing")
  {
    std::filesystem::remove(file);
    checkpoint_options co;
    co.progress = [](progress_phase, std::uint64_t done, std::uint64_t) {
      if (done > 0) { throw std::runtime_error("cancelled by the user"); }
    };
    CHECK_THROWS_WITH(opt.save(file, co), "cancelled by the user");
    CHECK(d.entries().empty());
    opt.save(file);
    std::vector<float> before(p.size()), after(p.size());
    opt.copy_state("w", slot::exp_avg, before);
    (void)opt.step(grads);
    opt.copy_state("w", slot::exp_avg, after);
    CHECK_THROWS_WITH(opt.load(file, co), "cancelled by the user");
    CHECK_FALSE(opt.state_lost());
    std::vector<float> now(p.size());
    opt.copy_state("w", slot::exp_avg, now);
    CHECK(now == after);
    opt.load(file);
    opt.copy_state("w", slot::exp_avg, now);
    CHECK(now == before);
  }
}

TEST_CASE("a step that mostly waits for its tier is told once, after the warm-up", "[notice]")
{
  using Optimizer = OffloadedOptimizer<AdamW, Fp32, memory_tier, Synchronous>;
  Optimizer::options o;
  o.chunk_elements      = 4096;
  o.tier.before_write   = [] { std::this_thread::sleep_for(std::chrono::milliseconds(2)); };  // a slow disk
  std::vector<float> p(4096 * 3, 0.5f), g(p.size(), 0.01f);
  Optimizer opt({.lr = 1e-3}, o);
  opt.add_tensor("w", p.data(), p.size());
  std::vector<grad_view<float>> grads{{g.data(), g.size()}};
  notice_capture told;
  for (int s = 0; s < detail::io_watch::warm_up + detail::io_watch::in_a_row - 1; ++s) { (void)opt.step(grads); }
  CHECK(told.told.empty());
  (void)opt.step(grads);
  REQUIRE(told.told.size() == 1);
  CHECK_THAT(told.told[0], Catch::Contains("waits for its state's I/O (memory_tier)") && Catch::Contains("I/O-bound"));
  for (int s = 0; s < 10; ++s) { (void)opt.step(grads); }
  CHECK(told.told.size() == 1);  // once
}
