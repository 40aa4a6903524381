// SPDX-License-Identifier: Apache-2.0
// The device routes' events on the emulated device (Thrust's CPP backend for OnDevice): each
// chunk's copies and kernel timed by the streams that run them (core/detail/stream_trace.hpp),
// on the device's tracks, in the order the streams' events impose, with the step's bytes; and
// tracing changes no bit. The same code times CUDA's streams (bench/gpu_script.sh runs the
// CUDA build's trace).
#include <tierstate/kernels/device/on_device.hpp>
#include <tierstate/tierstate.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstring>
#include <map>
#include <sstream>
#include <vector>

using namespace tierstate;

namespace {

/// An array in (emulated) device memory.
struct device_array {
  float* p = nullptr;
  std::size_t n;
  explicit device_array(std::vector<float> const& h) : n(h.size())
  {
    p = static_cast<float*>(device::allocate_async(n * sizeof(float), {}));
    device::copy(p, h.data(), n * sizeof(float));
  }
  ~device_array() { device::deallocate_async(p, {}); }
  device_array(device_array const&)            = delete;
  device_array& operator=(device_array const&) = delete;
  [[nodiscard]] std::vector<float> download() const
  {
    std::vector<float> h(n);
    device::copy(h.data(), p, n * sizeof(float));
    return h;
  }
};

struct run_result {
  std::vector<std::vector<float>> params;
  step_stats last{};
  std::vector<trace_event> events;  ///< the last step's
  std::string json;
};

std::vector<std::size_t> const sizes = {100003, 70001, 5};  // 170009 elements: 3 chunks of 2^16

/// Three steps of `Opt` (device params and gradients) with 2^16-element chunks; the last traced
/// when `traced`.
template <class Opt>
run_result train(bool traced)
{
  std::vector<std::unique_ptr<device_array>> params, grads;
  for (std::size_t k = 0; k < sizes.size(); ++k) {
    std::vector<float> p(sizes[k]), g(sizes[k]);
    for (std::size_t i = 0; i < sizes[k]; ++i) { p[i] = 0.01f * static_cast<float>((i * 7 + k) % 101) - 0.5f; }
    params.push_back(std::make_unique<device_array>(p));
    grads.push_back(std::make_unique<device_array>(g));
  }
  typename Opt::options o;
  o.chunk_elements = std::size_t{1} << 16;
  if constexpr (requires { o.tier.directory; }) { o.tier.directory = "/tmp"; }
  Opt opt({.lr = 1e-3, .weight_decay = 0.01}, o);
  for (std::size_t k = 0; k < sizes.size(); ++k) {
    opt.add_tensor("t" + std::to_string(k), params[k]->p, sizes[k], location::device);
  }
  tracer t;
  run_result r;
  for (int s = 0; s < 3; ++s) {
    std::vector<grad_view<float>> views;
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      std::vector<float> g(sizes[k]);
      for (std::size_t i = 0; i < sizes[k]; ++i) { g[i] = 1e-3f * static_cast<float>((i * 13 + k * 5 + s * 3) % 29) - 0.014f; }
      device::copy(grads[k]->p, g.data(), g.size() * sizeof(float));
      views.push_back({grads[k]->p, sizes[k], location::device});
    }
    if (traced && s == 2) { opt.trace(&t); }
    r.last = opt.step(views).stats;
  }
  opt.trace(nullptr);
  for (auto const& p : params) { r.params.push_back(p->download()); }
  r.events.assign(t.events().begin(), t.events().end());
  std::ostringstream json;
  t.write_chrome_json(json);
  r.json = json.str();
  return r;
}

/// Per chunk, its events of `phase` (each chunk's, in the order recorded).
std::map<std::int64_t, std::vector<trace_event>> by_chunk(std::vector<trace_event> const& evs, trace_phase phase)
{
  std::map<std::int64_t, std::vector<trace_event>> out;
  for (auto const& e : evs) {
    if (e.phase == phase) { out[e.chunk].push_back(e); }
  }
  return out;
}

std::uint64_t bytes_of(std::vector<trace_event> const& evs, trace_phase phase)
{
  std::uint64_t b = 0;
  for (auto const& e : evs) { b += e.phase == phase ? e.bytes : 0; }
  return b;
}

trace_event step_event(std::vector<trace_event> const& evs)
{
  auto const it = std::find_if(evs.begin(), evs.end(), [](trace_event const& e) { return e.phase == trace_phase::step; });
  REQUIRE(it != evs.end());
  return *it;
}

constexpr std::size_t chunk_count = 3;  // 170009 elements in chunks of 65536

}  // namespace

TEST_CASE("host compute for device params (CudaOverlapped): each chunk's gradients down, its update, its params up, "
          "timed on their streams")
{
  using Opt  = OffloadedOptimizer<AdamW, Fp32, PinnedHost, CudaOverlapped<2>>;
  auto const plain  = train<Opt>(false);
  auto const traced = train<Opt>(true);
  CHECK(traced.params == plain.params);  // tracing changes no bit

  auto const& evs  = traced.events;
  auto const down  = by_chunk(evs, trace_phase::from_device);
  auto const landed = by_chunk(evs, trace_phase::grads);
  auto const comp  = by_chunk(evs, trace_phase::compute);
  auto const up    = by_chunk(evs, trace_phase::to_device);
  REQUIRE(down.size() == chunk_count);
  REQUIRE(comp.size() == chunk_count);
  REQUIRE(up.size() == chunk_count);
  auto const step = step_event(evs);
  for (std::int64_t k = 0; k < static_cast<std::int64_t>(chunk_count); ++k) {
    INFO("chunk " << k);
    REQUIRE(down.at(k).size() == 1);
    REQUIRE(landed.at(k).size() == 1);
    REQUIRE(comp.at(k).size() == 1);
    REQUIRE(up.at(k).size() == 1);
    CHECK(down.at(k)[0].track == tracer::device_track(tracer::device_stream::from_device));
    CHECK(up.at(k)[0].track == tracer::device_track(tracer::device_stream::to_device));
    // The gradients landed (the stream's mark) before the step's thread saw them, and the
    // params went up after the update.
    CHECK(down.at(k)[0].end_ns <= landed.at(k)[0].end_ns);
    CHECK(landed.at(k)[0].end_ns <= comp.at(k)[0].begin_ns);
    CHECK(comp.at(k)[0].end_ns <= up.at(k)[0].begin_ns);
    CHECK(down.at(k)[0].begin_ns >= step.begin_ns);
    CHECK(up.at(k)[0].end_ns <= step.end_ns);
  }
  CHECK(bytes_of(evs, trace_phase::from_device) == traced.last.d2h_bytes);
  CHECK(bytes_of(evs, trace_phase::to_device) == traced.last.h2d_bytes);
  CHECK(traced.last.h2d_bytes == 170009 * sizeof(float));
  CHECK(traced.json.find("\"device stream: from device\"") != std::string::npos);
  CHECK(traced.json.find("\"device stream: to device\"") != std::string::npos);
  CHECK(traced.json.find("\"cat\":\"device\"") != std::string::npos);
}

TEST_CASE("device compute with the state streamed from the host: up, kernel, down per chunk, in the streams' order")
{
  using Opt = OffloadedOptimizer<AdamW, Fp32, PinnedHost, CudaOverlapped<2>, OnDevice>;
  auto const plain  = train<Opt>(false);
  auto const traced = train<Opt>(true);
  CHECK(traced.params == plain.params);

  auto const& evs = traced.events;
  auto const up   = by_chunk(evs, trace_phase::to_device);
  auto const run  = by_chunk(evs, trace_phase::device_compute);
  auto const down = by_chunk(evs, trace_phase::from_device);
  REQUIRE(up.size() == chunk_count);
  REQUIRE(run.size() == chunk_count);
  REQUIRE(down.size() == chunk_count);
  auto const step = step_event(evs);
  for (std::int64_t k = 0; k < static_cast<std::int64_t>(chunk_count); ++k) {
    INFO("chunk " << k);
    REQUIRE(up.at(k).size() == 1);
    REQUIRE(run.at(k).size() == 1);
    REQUIRE(down.at(k).size() == 1);
    CHECK(run.at(k)[0].track == tracer::device_track(tracer::device_stream::compute));
    CHECK(up.at(k)[0].end_ns <= run.at(k)[0].begin_ns);    // the compute stream waited for the state's copy
    CHECK(run.at(k)[0].end_ns <= down.at(k)[0].begin_ns);  // and the copy back for the kernel
    CHECK(down.at(k)[0].end_ns <= step.end_ns);
  }
  CHECK(bytes_of(evs, trace_phase::to_device) == traced.last.h2d_bytes);
  CHECK(bytes_of(evs, trace_phase::from_device) == traced.last.d2h_bytes);
  CHECK(traced.json.find("\"device stream: compute\"") != std::string::npos);
}

TEST_CASE("state in the Device tier: one kernel per chunk on the compute stream, one after another")
{
  using Opt = OffloadedOptimizer<AdamW, Fp32, Device, CudaOverlapped<2>, OnDevice>;
  auto const plain  = train<Opt>(false);
  auto const traced = train<Opt>(true);
  CHECK(traced.params == plain.params);

  std::vector<trace_event> runs;
  for (auto const& e : traced.events) {
    if (e.phase == trace_phase::device_compute) { runs.push_back(e); }
  }
  REQUIRE(runs.size() == chunk_count);
  std::sort(runs.begin(), runs.end(), [](auto const& a, auto const& b) { return a.begin_ns < b.begin_ns; });
  auto const step = step_event(traced.events);
  for (std::size_t i = 0; i < runs.size(); ++i) {
    INFO("kernel " << i);
    if (i > 0) { CHECK(runs[i - 1].end_ns <= runs[i].begin_ns); }  // one stream: no overlap
    CHECK(runs[i].begin_ns >= step.begin_ns);
    CHECK(runs[i].end_ns <= step.end_ns);
    CHECK(runs[i].bytes > 0);
  }
  // No copies on this route.
  CHECK(by_chunk(traced.events, trace_phase::to_device).empty());
  CHECK(by_chunk(traced.events, trace_phase::from_device).empty());
}
