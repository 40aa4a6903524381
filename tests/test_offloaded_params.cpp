// SPDX-License-Identifier: Apache-2.0
// offloaded_params (state/offloaded_params.hpp): weights that rest in a tier and come into a
// bounded window of buffers layer by layer. Every view is checked against the values last
// written, over iterations in the expected order, out of it, with gradient accumulation,
// writes racing read-ahead, I/O failures and misuse; the buffers' memory against its bound.
#include "memory_tier.hpp"
#include "nvme_support.hpp"

#include <tierstate/io/fault.hpp>
#include <tierstate/optimizer.hpp>
#include <tierstate/state/offloaded_params.hpp>
#include <tierstate/tiers/nvme_file.hpp>
#include <tierstate/tiers/pinned_host.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <memory_resource>
#include <numeric>
#include <stdexcept>
#include <thread>
#include <utility>
#include <vector>

using namespace tierstate;

namespace {

/// A tier whose reads take `delay` and fail while `*fail_reads` is set.
class slow_tier {
 public:
  struct options {
    std::atomic<int>* delay_ms = nullptr;  ///< each read sleeps this long
    std::atomic<bool>* fail_reads = nullptr;
    std::atomic<int>* reads       = nullptr;
    std::atomic<int>* started     = nullptr;  ///< reads begun
  };
  static constexpr std::string_view name = "slow_tier";
  slow_tier(std::size_t bytes, options const& o) : bytes_(bytes), o_(o) {}
  [[nodiscard]] std::size_t size() const { return bytes_.size(); }
  void read(std::size_t offset, std::span<std::byte> to) const
  {
    if (o_.started != nullptr) { ++*o_.started; }
    if (o_.delay_ms != nullptr) { std::this_thread::sleep_for(std::chrono::milliseconds(o_.delay_ms->load())); }
    if (o_.reads != nullptr) { ++*o_.reads; }
    if (o_.fail_reads != nullptr && o_.fail_reads->load()) { throw std::runtime_error("slow_tier: read failed"); }
    std::memcpy(to.data(), bytes_.data() + offset, to.size());
  }
  void write(std::size_t offset, std::span<std::byte const> from)
  {
    std::memcpy(bytes_.data() + offset, from.data(), from.size());
  }

 private:
  std::vector<std::byte> bytes_;
  options o_;
};

/// Counts the bytes the window's buffers take, and says whether a pointer is in them.
class counting_resource : public std::pmr::memory_resource {
 public:
  std::size_t live = 0, peak = 0, allocations = 0;
  std::vector<std::pair<std::byte const*, std::size_t>> blocks;
  [[nodiscard]] bool holds(void const* p) const
  {
    auto const* b = static_cast<std::byte const*>(p);
    return std::any_of(blocks.begin(), blocks.end(), [&](auto const& k) { return b >= k.first && b < k.first + k.second; });
  }
  explicit counting_resource(std::pmr::memory_resource* upstream = std::pmr::new_delete_resource()) : up_(upstream) {}

 private:
  void* do_allocate(std::size_t bytes, std::size_t align) override
  {
    void* p = up_->allocate(bytes, align);
    blocks.emplace_back(static_cast<std::byte const*>(p), bytes);
    live += bytes;
    peak = std::max(peak, live);
    ++allocations;
    return p;
  }
  void do_deallocate(void* p, std::size_t bytes, std::size_t align) override
  {
    live -= bytes;
    std::erase_if(blocks, [&](auto const& k) { return k.first == p; });
    up_->deallocate(p, bytes, align);
  }
  [[nodiscard]] bool do_is_equal(memory_resource const& o) const noexcept override { return this == &o; }
  std::pmr::memory_resource* up_;
};

// Awkward sizes: a layer of one element, tensors across 4 KiB boundaries, a large layer,
// small tensors that stay resident under a threshold of 64.
std::vector<std::vector<std::size_t>> const model_sizes = {{4097, 7, 63}, {1}, {2048, 2049, 5}, {30011}, {64, 3, 999}, {13}};

float value_of(std::size_t t, std::size_t i, int version) { return static_cast<float>((t * 131 + i * 7) % 1000) * 0.25f + version; }

template <class W>
struct model {
  W w;
  std::vector<typename W::layer_id> layers;
  std::vector<std::vector<typename W::tensor_id>> tensors;  // [layer][i]

  explicit model(typename W::options const& o) : w(o)
  {
    for (std::size_t l = 0; l < model_sizes.size(); ++l) {
      layers.push_back(w.add_layer(std::string("layer").append(std::to_string(l))));
      tensors.emplace_back();
      for (std::size_t i = 0; i < model_sizes[l].size(); ++i) {
        tensors[l].push_back(w.add_tensor(layers[l], std::string("l").append(std::to_string(l)).append(".t").append(std::to_string(i)),
                                          model_sizes[l][i]));
      }
    }
  }
  void write_all(int version)
  {
    for (auto const& layer : tensors) {
      for (auto const t : layer) {
        std::vector<float> v(w.tensor_size(t));
        for (std::size_t i = 0; i < v.size(); ++i) { v[i] = value_of(t, i, version); }
        w.write(t, 0, v);
      }
    }
  }
  /// Acquires layer l, checks every value against `version`, releases it.
  void use(std::size_t l, int version)
  {
    auto const v = w.acquire(layers[l]);
    REQUIRE(v.layer() == layers[l]);
    REQUIRE(v.size() == tensors[l].size());
    for (std::size_t i = 0; i < v.size(); ++i) {
      auto const s = v.tensor(i);
      REQUIRE(s.size() == model_sizes[l][i]);
      bool same = true;
      for (std::size_t e = 0; e < s.size(); ++e) { same = same && s[e] == value_of(tensors[l][i], e, version); }
      REQUIRE(same);
    }
    w.release(layers[l]);
  }
  void iteration(int version, int passes = 1)
  {
    for (int p = 0; p < passes; ++p) {
      for (std::size_t l = 0; l < layers.size(); ++l) { use(l, version); }
      for (std::size_t l = layers.size(); l-- > 0;) { use(l, version); }
    }
  }
};

template <class Tier>
typename offloaded_params<float, Tier>::options options_for(unsigned window, std::size_t threshold,
                                                            typename Tier::options tier = {})
{
  typename offloaded_params<float, Tier>::options o;
  o.window                = window;
  o.persistence_threshold = threshold;
  o.tier                  = tier;
  return o;
}

template <class Tier>
void train_and_check(typename Tier::options const& tier)
{
  for (unsigned const window : {1u, 3u}) {
    for (std::size_t const threshold : {std::size_t{0}, std::size_t{64}}) {
      CAPTURE(window, threshold);
      model<offloaded_params<float, Tier>> m(options_for<Tier>(window, threshold, tier));
      m.write_all(0);
      // First iteration: forward then backward, as expected before any was recorded.
      m.iteration(0);
      auto s = m.w.stats();
      CHECK(s.out_of_order == 0);
      CHECK(s.on_demand == 0);
      m.write_all(1);  // the optimizer's update: every buffer holding a layer is old now
      m.w.end_iteration();
      for (int it = 1; it < 4; ++it) {
        m.iteration(it);
        m.write_all(it + 1);
        m.w.end_iteration();
      }
      s = m.w.stats();
      CHECK(s.out_of_order == 0);
      CHECK(s.on_demand == 0);
      CHECK(s.ready + s.waited == s.acquires);
      // Backward takes forward's last layer (and, with a window, more) from its buffer.
      CHECK(s.reads < s.acquires);
      for (std::size_t t = 0; t < m.w.tensor_count(); ++t) {
        std::vector<float> back(m.w.tensor_size(t));
        m.w.read(t, 0, back);
        for (std::size_t i = 0; i < back.size(); ++i) { REQUIRE(back[i] == value_of(t, i, 4)); }
        CHECK(m.w.resident(t) == (threshold > 0 && m.w.tensor_size(t) < threshold));
      }
    }
  }
}

}  // namespace

TEST_CASE("offloaded params: every view holds the last values written, in host tiers and on NVMe", "[offload]")
{
  SECTION("PinnedHost") { train_and_check<PinnedHost>({}); }
  SECTION("a user's tier (not addressable)") { train_and_check<test::memory_tier>({}); }
  SECTION("NvmeFile")
  {
    test::scratch_dir dir;
    NvmeFile::options o;
    o.directory = dir.path;
    train_and_check<NvmeFile>(o);
    CHECK(dir.entries().empty());  // the tier's file goes with it
  }
}

TEST_CASE("offloaded params: the layout packs each layer into one aligned range; buffers are window + 1 of the largest",
          "[offload]")
{
  counting_resource counted;
  auto o    = options_for<PinnedHost>(2, 64);
  o.buffers = &counted;
  {
    model<offloaded_params<float, PinnedHost>> m(o);
    CHECK(counted.allocations == 0);  // nothing before the tier is made
    m.write_all(0);
    // The largest layer without its resident tensors: 30011 floats -> 120044 bytes -> 30 pages.
    std::size_t largest = 0, total = 0;
    for (auto const& sizes : model_sizes) {
      std::size_t bytes = 0;
      for (auto const n : sizes) {
        if (n >= 64) { bytes += (n * sizeof(float) + 63) / 64 * 64; }
      }
      bytes = (bytes + 4095) / 4096 * 4096;
      largest = std::max(largest, bytes);
      total += bytes;
    }
    CHECK(m.w.buffer_bytes() == largest);
    CHECK(m.w.buffer_count() == 3);
    CHECK(m.w.tier_bytes() == total);
    CHECK(m.w.resident_bytes() >= (7 + 63 + 1 + 5 + 3 + 13) * sizeof(float));
    for (int it = 0; it < 3; ++it) {
      m.iteration(it == 0 ? 0 : it - 1);
      if (it > 0) { m.write_all(it); }
      m.w.end_iteration();
      // The bound: (window + 1) x the largest layer, allocated once.
      CHECK(counted.peak <= (o.window + 1) * largest);
      CHECK(counted.allocations == o.window + 1);
    }
  }
  CHECK(counted.live == 0);
}

TEST_CASE("offloaded params: gradient accumulation's passes and an order that changes are followed exactly",
          "[offload]")
{
  model<offloaded_params<float, test::memory_tier>> m(options_for<test::memory_tier>(2, 0));
  m.write_all(0);
  m.iteration(0, 2);  // two forward/backward passes: the second is out of the first guess
  auto const first = m.w.stats().out_of_order;
  CHECK(first > 0);
  m.w.end_iteration();
  CHECK(m.w.expected_order().size() == 4 * model_sizes.size());
  m.iteration(0, 2);
  m.w.end_iteration();
  m.iteration(0, 2);
  CHECK(m.w.stats().out_of_order == first);  // from the second iteration on, none
  m.w.end_iteration();

  // Another order (a model that skips layer 1 and runs 4 before 3): the first iteration
  // misses, is read on demand and still right; the next follows it.
  std::vector<std::size_t> const order = {0, 2, 4, 3, 5, 5, 3, 4, 2, 0};
  auto const before                    = m.w.stats();
  for (auto const l : order) { m.use(l, 0); }
  auto const mid = m.w.stats();
  CHECK(mid.out_of_order > before.out_of_order);
  m.w.end_iteration();
  CHECK(m.w.expected_order() == std::vector<std::size_t>(order.begin(), order.end()));
  for (auto const l : order) { m.use(l, 0); }
  auto const after = m.w.stats();
  CHECK(after.out_of_order == mid.out_of_order);
  CHECK(after.on_demand == mid.on_demand);
  m.w.end_iteration();
}

TEST_CASE("offloaded params: a write while a layer is read ahead, or held, is never missed", "[offload]")
{
  std::atomic<int> started{0}, delay_ms{0};
  slow_tier::options t;
  t.delay_ms = &delay_ms;
  t.started  = &started;
  model<offloaded_params<float, slow_tier>> m(options_for<slow_tier>(1, 0, t));
  m.write_all(0);
  m.iteration(0);
  m.write_all(1);  // drops the buffers kept from backward
  int const before = started;
  delay_ms         = 500;  // (the writes below begin within it, however loaded the machine)
  m.w.end_iteration();     // starts the read of layer 0
  auto const t0 = std::chrono::steady_clock::now();
  while (started == before) {
    REQUIRE(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(20));
    std::this_thread::yield();
  }
  m.write_all(2);  // ... which these writes overtake
  delay_ms = 0;
  m.use(0, 2);
  CHECK(m.w.stats().discarded >= 1);

  // Written while acquired: the trainer's view stays as it was; the next acquire sees the new.
  auto const v  = m.w.acquire(m.layers[2]);
  float const a = v.tensor(0)[0];
  std::vector<float> nine(m.w.tensor_size(m.tensors[2][0]), 9.0f);
  m.w.write(m.tensors[2][0], 0, nine);
  CHECK(v.tensor(0)[0] == a);
  m.w.release(m.layers[2]);
  auto const v2 = m.w.acquire(m.layers[2]);
  CHECK(v2.tensor(0)[0] == 9.0f);
  CHECK(v2.tensor(0)[m.w.tensor_size(m.tensors[2][0]) - 1] == 9.0f);
  m.w.release(m.layers[2]);
}

TEST_CASE("offloaded params: a held view keeps its values while a resident tensor is written", "[offload]")
{
  model<offloaded_params<float, PinnedHost>> m(options_for<PinnedHost>(1, 64));
  m.write_all(0);
  auto const small = m.tensors[0][1];  // 7 elements: resident
  REQUIRE(m.w.resident(small));
  auto const v = m.w.acquire(m.layers[0]);
  std::vector<float> five(7, 5.0f);
  m.w.write(small, 0, five);  // from the holder's thread: no wait
  std::thread([&] { m.w.write(small, 2, std::span<float const>(five).first(3)); }).join();
  CHECK(v.tensor(1)[0] == value_of(small, 0, 0));
  CHECK(v.tensor(1)[3] == value_of(small, 3, 0));
  std::vector<float> now(7);
  m.w.read(small, 0, now);
  CHECK(now == five);
  m.w.release(m.layers[0]);
  auto const v2 = m.w.acquire(m.layers[0]);
  CHECK(v2.tensor(1)[3] == 5.0f);
  CHECK(v2.tensor(0)[3] == value_of(m.tensors[0][0], 3, 0));  // the layer's other tensors as they were
  m.w.release(m.layers[0]);
}

TEST_CASE("offloaded params: a failed read is the acquire's error, and the next acquire reads again", "[offload]")
{
  SECTION("a user's tier")
  {
    std::atomic<bool> fail{false};
    slow_tier::options t;
    t.fail_reads = &fail;
    model<offloaded_params<float, slow_tier>> m(options_for<slow_tier>(1, 0, t));
    m.write_all(0);
    m.iteration(0);
    m.w.end_iteration();
    fail = true;
    CHECK_THROWS_WITH(m.w.acquire(m.layers[3]), Catch::Contains("slow_tier: read failed"));
    fail = false;
    m.use(3, 0);  // read again
    m.iteration(0);
  }
  SECTION("NvmeFile: EIO from the disk")
  {
    test::scratch_dir dir;
    NvmeFile::options t;
    t.directory = dir.path;
    auto plan   = std::make_shared<io::fault_plan>();
    t.io.faults = plan;
    model<offloaded_params<float, NvmeFile>> m(options_for<NvmeFile>(1, 0, t));
    m.write_all(0);
    m.iteration(0);
    m.w.end_iteration();
    plan->fail_from(io::op::read, 1, EIO);
    try {
      (void)m.w.acquire(m.layers[3]);
      FAIL("acquire did not throw");
    } catch (io_error const& e) {
      CHECK(e.code().value() == EIO);
      CHECK(std::string(e.what()).find(dir.path.string()) != std::string::npos);
    }
    plan->clear();
    m.use(3, 0);
    m.iteration(0);
  }
}

TEST_CASE("offloaded params: misuse is refused by name and changes nothing", "[offload]")
{
  using W = offloaded_params<float, PinnedHost>;
  CHECK_THROWS_AS(W(options_for<PinnedHost>(0, 0)), invalid_option);
  CHECK_THROWS_AS(W(options_for<PinnedHost>(65, 0)), invalid_option);
  model<W> m(options_for<PinnedHost>(1, 0));
  CHECK_THROWS_AS(m.w.add_tensor(99, "x", 4), tierstate::logic_error);
  CHECK_THROWS_AS(m.w.add_tensor(0, "l0.t0", 4), tierstate::logic_error);  // the name is taken
  CHECK_THROWS_AS(m.w.add_tensor(0, "empty", 0), tierstate::logic_error);
  m.write_all(0);
  CHECK_THROWS_WITH(m.w.add_layer("late"), Catch::Contains("made already"));
  CHECK_THROWS_AS(m.w.acquire(99), tierstate::logic_error);
  CHECK_THROWS_WITH(m.w.release(m.layers[1]), Catch::Contains("layer 1 'layer1'") && Catch::Contains("not acquired"));
  std::vector<float> big(m.w.tensor_size(0) + 1);
  CHECK_THROWS_WITH(m.w.write(0, 0, big), Catch::Contains("outside"));
  CHECK_THROWS_AS(m.w.read(0, 1, std::span<float>(big).first(m.w.tensor_size(0))), tierstate::logic_error);

  auto const a = m.w.acquire(m.layers[0]);
  CHECK_THROWS_WITH(m.w.acquire(m.layers[0]), Catch::Contains("acquired already"));
  (void)m.w.acquire(m.layers[1]);
  // Window 1: two buffers, both held.
  CHECK_THROWS_WITH(m.w.acquire(m.layers[2]), Catch::Contains("all 2 buffers"));
  CHECK_THROWS_WITH(m.w.end_iteration(), Catch::Contains("still acquired"));
  CHECK(a.tensor(0)[5] == value_of(m.tensors[0][0], 5, 0));
  m.w.release(m.layers[0]);
  m.w.release(m.layers[1]);
  m.use(2, 0);  // the refusals left everything usable
  m.w.end_iteration();
  m.iteration(0);
}

// --- with the optimizer -------------------------------------------------------------------

namespace {

/// A model's gradient as a function of its params and the step: what a backward pass over
/// the params in a layer's view gives, computed the same way with and without offload.
template <class G, class P>
void gradient_of(std::span<P const> params, std::size_t tensor, int step, int micro, std::span<G> out)
{
  for (std::size_t i = 0; i < params.size(); ++i) {
    float const p = static_cast<float>(params[i]);
    out[i] = G(std::sin(p * 3.0f + static_cast<float>(i % 97) * 0.01f + static_cast<float>(tensor + step + micro)) * 0.1f);
  }
}

std::string tensor_name(std::size_t t) { return std::string("t").append(std::to_string(t)); }

template <class P>
P initial_param(std::size_t t, std::size_t i)
{
  return P(static_cast<float>((t * 37 + i * 11) % 2000) * 1e-3f - 1.0f);
}

enum class step_kind { whole, streaming };

/// Trains the awkward model `steps` steps with the params in host arrays, and again with them
/// in offloaded_params<ParamTier> (the same layers), and compares every param's bits and the
/// whole state.
template <class Opt, class ParamTier>
void check_parity(typename Opt::options const& opt_options, typename ParamTier::options const& param_tier,
                  unsigned window, step_kind kind, unsigned micro_batches, std::size_t threshold = 0,
                  bool keep_grads = true)
{
  using P = typename Opt::param_type;
  using G = typename Opt::grad_type;
  constexpr int steps = 6;
  typename Opt::hyperparameters h;
  h.lr           = 1e-2;
  h.weight_decay = 0.1;

  std::vector<std::size_t> sizes;
  for (auto const& layer : model_sizes) { sizes.insert(sizes.end(), layer.begin(), layer.end()); }

  // Plain: params in host arrays.
  std::vector<std::vector<P>> plain(sizes.size());
  Opt ref(h, opt_options);
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    plain[t].resize(sizes[t]);
    for (std::size_t i = 0; i < sizes[t]; ++i) { plain[t][i] = initial_param<P>(t, i); }
    ref.add_tensor(tensor_name(t), plain[t].data(), sizes[t]);
  }

  // Offloaded: the same tensors, grouped by layer.
  typename offloaded_params<P, ParamTier>::options wo;
  wo.window                = window;
  wo.tier                  = param_tier;
  wo.persistence_threshold = threshold;  // (64: the small tensors stay in host memory)
  wo.keep_grads            = keep_grads;
  offloaded_params<P, ParamTier> w(wo);
  std::vector<std::vector<std::size_t>> by_layer;
  for (std::size_t l = 0, t = 0; l < model_sizes.size(); ++l) {
    auto const layer = w.add_layer(std::string("layer").append(std::to_string(l)));
    by_layer.emplace_back();
    for (std::size_t i = 0; i < model_sizes[l].size(); ++i, ++t) {
      by_layer[l].push_back(w.add_tensor(layer, tensor_name(t), sizes[t]));
    }
  }
  Opt off(h, opt_options);
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    std::vector<P> init(sizes[t]);
    for (std::size_t i = 0; i < sizes[t]; ++i) { init[i] = initial_param<P>(t, i); }
    w.write(t, 0, init);
    REQUIRE(off.add_tensor(w, t) == t);
  }

  std::vector<std::vector<G>> grads_ref(sizes.size()), grads_off(sizes.size()), part(sizes.size());
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    grads_ref[t].resize(sizes[t]);
    grads_off[t].resize(sizes[t]);
    part[t].resize(sizes[t]);
  }
  auto const views_of = [&](std::vector<std::vector<G>> const& g) {
    std::vector<grad_view<G>> v;
    for (auto const& x : g) { v.push_back({x.data(), x.size()}); }
    return v;
  };
  for (int s = 0; s < steps; ++s) {
    // Reference: gradients (summed over micro-batches) from the host arrays.
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      std::fill(grads_ref[t].begin(), grads_ref[t].end(), G(0.0f));
      for (unsigned m = 0; m < micro_batches; ++m) {
        gradient_of<G, P>(plain[t], t, s, static_cast<int>(m), part[t]);
        for (std::size_t i = 0; i < sizes[t]; ++i) {
          grads_ref[t][i] = G(static_cast<float>(grads_ref[t][i]) + static_cast<float>(part[t][i]));
        }
      }
    }
    auto const rv = views_of(grads_ref);
    REQUIRE(!ref.step(rv).skipped);

    // Offloaded: forward and backward through the window, each micro-batch.
    if (kind == step_kind::streaming) { off.begin_step(1.0, micro_batches); }
    for (std::size_t t = 0; t < sizes.size(); ++t) { std::fill(grads_off[t].begin(), grads_off[t].end(), G(0.0f)); }
    for (unsigned m = 0; m < micro_batches; ++m) {
      for (std::size_t l = 0; l < model_sizes.size(); ++l) {
        (void)w.acquire(l);  // forward: the params are there
        w.release(l);
      }
      for (std::size_t l = model_sizes.size(); l-- > 0;) {
        auto const v = w.acquire(l);
        for (std::size_t i = 0; i < v.size(); ++i) {
          std::size_t const t = by_layer[l][i];
          gradient_of<G, P>(v.tensor(i), t, s, static_cast<int>(m), part[t]);
          for (std::size_t e = 0; e < sizes[t]; ++e) {
            grads_off[t][e] = G(static_cast<float>(grads_off[t][e]) + static_cast<float>(part[t][e]));
          }
          if (kind == step_kind::streaming) {
            off.grad_ready(t, {grads_off[t].data(), sizes[t]});
            if (m + 1 == micro_batches && keep_grads) {
              // Kept by the params' source: the trainer's memory is free once grad_ready returns.
              std::fill(grads_off[t].begin(), grads_off[t].end(), G(std::numeric_limits<float>::quiet_NaN()));
            }
          }
        }
        w.release(l);
      }
    }
    if (kind == step_kind::streaming) {
      REQUIRE(!off.finish_step().skipped);
    } else {
      auto const ov = views_of(grads_off);
      REQUIRE(!off.step(ov).skipped);
    }
    w.end_iteration();
  }

  for (std::size_t t = 0; t < sizes.size(); ++t) {
    std::vector<P> back(sizes[t]);
    w.read(t, 0, back);
    REQUIRE(std::memcmp(back.data(), plain[t].data(), sizes[t] * sizeof(P)) == 0);
    std::vector<slot> slots = {slot::exp_avg, slot::exp_avg_sq};
    if constexpr (Opt::precision_type::has_master) { slots.push_back(slot::master); }
    if constexpr (Opt::precision_type::has_compensation) { slots.push_back(slot::compensation); }
    for (auto const sl : slots) {
      std::vector<float> a(sizes[t]), b(sizes[t]);
      ref.copy_state(tensor_name(t), sl, a);
      off.copy_state(tensor_name(t), sl, b);
      REQUIRE(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
    }
  }
  auto const st = w.stats();
  if (micro_batches == 1) { CHECK(st.out_of_order == 0); }  // (more passes: the first iteration's guess misses)
  CHECK(st.on_demand <= st.out_of_order);
  CHECK(st.bytes_written > 0);
  if (kind == step_kind::streaming && keep_grads) {  // every gradient kept, and read back once a step
    CHECK(st.grad_bytes_written > 0);
    CHECK(st.grad_bytes_read == st.grad_bytes_written);  // (each element read back once a step)
  } else {
    CHECK(st.grad_bytes_written == 0);
  }
}

}  // namespace

TEST_CASE("offloaded params with the optimizer: the same bits as params in memory", "[offload][optimizer]")
{
  // Every window, whole and streaming steps, with and without gradient accumulation.
  auto const each = [](auto&& run) {
    for (unsigned const window : {1u, 3u}) {
      for (auto const kind : {step_kind::whole, step_kind::streaming}) {
        for (unsigned const micro : {1u, 2u}) {
          CAPTURE(window, static_cast<int>(kind), micro);
          run(window, kind, micro);
        }
      }
    }
  };
  SECTION("fp32 params, their own master, in PinnedHost; state in PinnedHost")
  {
    using Opt = OffloadedOptimizer<AdamW, Fp32, PinnedHost>;
    typename Opt::options o;
    o.chunk_elements = 4096;
    o.threads        = 2;
    each([&](unsigned window, step_kind kind, unsigned micro) { check_parity<Opt, PinnedHost>(o, {}, window, kind, micro); });
    // The trainer keeping its gradients until finish_step (keep_grads false): nothing written.
    check_parity<Opt, PinnedHost>(o, {}, 2, step_kind::streaming, 2, 0, false);
  }
  SECTION("bf16 params with an fp32 master, on NVMe; state on NVMe, pipelined; no checks")
  {
    test::scratch_dir dir;
    using Opt = OffloadedOptimizer<AdamW, Bf16Mixed, NvmeFile, Pipelined<2>>;
    typename Opt::options o;
    o.chunk_elements = 4096;
    o.threads        = 2;
    o.on_nonfinite   = nonfinite_policy::ignore;
    o.tier.directory = dir.path;
    NvmeFile::options pt;
    pt.directory = dir.path;
    each([&](unsigned window, step_kind kind, unsigned micro) { check_parity<Opt, NvmeFile>(o, pt, window, kind, micro); });
    CHECK(dir.entries().empty());
  }
  SECTION("bf16 params, Kahan-compensated, in a user's tier, small tensors resident; clipping")
  {
    using Opt = OffloadedOptimizer<AdamW, Precision<bf16, bf16, Compensated, float>, test::memory_tier>;
    typename Opt::options o;
    o.chunk_elements = 2048;
    o.threads        = 1;
    o.max_grad_norm  = 0.5;
    each([&](unsigned window, step_kind kind, unsigned micro) {
      check_parity<Opt, test::memory_tier>(o, {}, window, kind, micro, 64);
    });
  }
}

TEST_CASE("offloaded params with the optimizer: compositions that cannot take them say so", "[offload][optimizer]")
{
  offloaded_params<bf16, PinnedHost> w;
  auto const l = w.add_layer("l");
  auto const t = w.add_tensor(l, "w", 100);
  using Opt    = OffloadedOptimizer<AdamW, Bf16Mixed, PinnedHost>;
  typename Opt::options o;
  o.delayed_update = true;
  Opt delayed({}, o);
  CHECK_THROWS_WITH(delayed.add_tensor(w, t), Catch::Contains("delayed update"));
  CHECK(delayed.tensor_count() == 0);
  Opt fine;
  CHECK(fine.add_tensor(w, t) == 0);
  CHECK_THROWS_WITH(fine.add_tensor(w, t), Catch::Contains("registered already, as 'w'"));
  CHECK_THROWS_WITH(fine.add_tensor(w, t, "again"), Catch::Contains("registered already, as 'w'"));
  Opt named;  // (one source, an optimizer's own names: tierstate_torch's "p0", "p1", ...)
  CHECK(named.add_tensor(w, t, "p0") == 0);
  CHECK(named.step_count("p0") == 0);
  CHECK_THROWS_AS(named.step_count("w"), tierstate::logic_error);  // (the source's name is not the optimizer's)
  CHECK_THROWS_AS(fine.add_tensor(w, 7), tierstate::logic_error);
  OffloadedOptimizer<Adafactor, Bf16Mixed, PinnedHost> factored;
  CHECK_THROWS_WITH(factored.add_tensor(w, t), Catch::Contains("tensor phase"));
  CHECK(factored.tensor_count() == 0);
}

TEMPLATE_TEST_CASE("offloaded params with the optimizer: a checkpoint keeps the weights, a block at a time",
                   "[offload][optimizer][checkpoint]", Fp32, Bf16Mixed, Bf16Compensated)
{
  // The file's params region holds every offloaded tensor's params (for Bf16Mixed also the
  // master's rounding): a fresh optimizer and tier (all zero) load them, and training goes on
  // with the same bits.
  using Opt = OffloadedOptimizer<AdamW, TestType, PinnedHost>;
  using P   = typename Opt::param_type;
  using W   = offloaded_params<P, NvmeFile>;
  test::scratch_dir dir;
  auto const file = dir.path / "ckpt";
  typename Opt::options o;
  o.chunk_elements = 2048;
  auto const make = [&](W& w, Opt& opt, bool init) {
    for (std::size_t l = 0, t = 0; l < model_sizes.size(); ++l) {
      auto const layer = w.add_layer(std::string("layer").append(std::to_string(l)));
      for (auto const n : model_sizes[l]) { w.add_tensor(layer, tensor_name(t++), n); }
    }
    for (std::size_t t = 0; t < w.tensor_count(); ++t) {
      if (init) {
        std::vector<P> v(w.tensor_size(t));
        for (std::size_t i = 0; i < v.size(); ++i) { v[i] = initial_param<P>(t, i); }
        w.write(t, 0, v);
      }
      opt.add_tensor(w, t);
    }
  };
  auto const train = [&](W& w, Opt& opt, int from, int to) {
    for (int s = from; s < to; ++s) {
      std::vector<std::vector<P>> g(w.tensor_count());
      std::vector<grad_view<P>> views;
      for (std::size_t l = model_sizes.size(), t = w.tensor_count(); l-- > 0;) {
        auto const v = w.acquire(l);
        t -= v.size();
        for (std::size_t i = 0; i < v.size(); ++i) {
          g[t + i].resize(v.tensor(i).size());
          gradient_of<P, P>(v.tensor(i), t + i, s, 0, g[t + i]);
        }
        w.release(l);
      }
      for (auto const& x : g) { views.push_back({x.data(), x.size()}); }
      REQUIRE(!opt.step(views).skipped);
      w.end_iteration();
    }
  };
  auto const bits = [](W& w) {
    std::vector<unsigned char> out;
    for (std::size_t t = 0; t < w.tensor_count(); ++t) {
      std::vector<P> v(w.tensor_size(t));
      w.read(t, 0, v);
      auto const* b = reinterpret_cast<unsigned char const*>(v.data());
      out.insert(out.end(), b, b + v.size() * sizeof(P));
    }
    return out;
  };
  typename W::options wo;
  wo.tier.directory = dir.path;
  std::vector<unsigned char> saved, after;
  {
    W w(wo);
    Opt opt({}, o);
    make(w, opt, true);
    train(w, opt, 0, 3);
    opt.save(file);
    saved = bits(w);
    train(w, opt, 3, 6);
    after = bits(w);
  }
  {
    W w(wo);
    Opt opt({}, o);
    make(w, opt, false);
    opt.load(file);
    CHECK(bits(w) == saved);
    train(w, opt, 3, 6);
    CHECK(bits(w) == after);
  }
  // A flipped byte in the params region is found before anything changes.
  {
    auto const size = std::filesystem::file_size(file);
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    // The params region ends where the table (its last 4 KiB here: fewer than 500 blocks) begins.
    f.seekg(static_cast<std::streamoff>(size - 4096 - 100));
    char c = 0;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x5a);
    f.seekp(static_cast<std::streamoff>(size - 4096 - 100));
    f.write(&c, 1);
  }
  W w(wo);
  Opt opt({}, o);
  make(w, opt, true);
  auto const before = bits(w);
  CHECK_THROWS_WITH(opt.load(file), Catch::Contains("params block") && Catch::Contains("corrupt"));
  CHECK(bits(w) == before);
}

TEST_CASE("offloaded params with the optimizer: a failed param write loses the state, and a checkpoint restores all",
          "[offload][optimizer][checkpoint]")
{
  // The param tier's writes fail part-way through a step's update: the step throws, the
  // optimizer refuses to go on (state_lost) instead of mixing new and old weights, and a
  // checkpoint brings state and weights back to where they were.
  using Opt = OffloadedOptimizer<AdamW, Fp32, PinnedHost>;
  using W   = offloaded_params<float, test::memory_tier>;
  test::scratch_dir dir;
  int writes_left = 1 << 30;
  W::options wo;
  wo.tier.writes_left = &writes_left;
  W w(wo);
  std::vector<std::size_t> sizes;
  for (std::size_t l = 0, t = 0; l < model_sizes.size(); ++l) {
    auto const layer = w.add_layer(std::string("layer").append(std::to_string(l)));
    for (auto const n : model_sizes[l]) {
      w.add_tensor(layer, tensor_name(t++), n);
      sizes.push_back(n);
    }
  }
  typename Opt::options o;
  o.chunk_elements = 2048;
  o.threads        = 2;
  Opt opt({}, o);
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    std::vector<float> v(sizes[t]);
    for (std::size_t i = 0; i < v.size(); ++i) { v[i] = initial_param<float>(t, i); }
    w.write(t, 0, v);
    opt.add_tensor(w, t);
  }
  std::vector<std::vector<float>> g(sizes.size());
  std::vector<grad_view<float>> views;
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    g[t].assign(sizes[t], 0.01f * static_cast<float>(t + 1));
    views.push_back({g[t].data(), g[t].size()});
  }
  auto const weights = [&] {
    std::vector<std::vector<float>> all(sizes.size());
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      all[t].resize(sizes[t]);
      w.read(t, 0, all[t]);
    }
    return all;
  };
  REQUIRE(!opt.step(views).skipped);
  opt.save(dir.path / "ckpt");
  auto const saved = weights();
  writes_left = 3;  // a few pieces of the next update land, then the tier fails
  CHECK_THROWS_WITH(opt.step(views), Catch::Contains("memory_tier: write failed"));
  CHECK(opt.state_lost());
  CHECK_THROWS_AS(opt.step(views), state_lost);
  writes_left = 1 << 30;
  opt.load(dir.path / "ckpt");
  CHECK(!opt.state_lost());
  CHECK(weights() == saved);
  REQUIRE(!opt.step(views).skipped);
  CHECK(opt.step_count() == 2);
}

TEST_CASE("offloaded params: gradients written behind return at once, the last write_grad's outcome counts, and "
          "the bytes behind are bounded",
          "[offload]")
{
  using W = offloaded_params<float, test::memory_tier>;
  std::mutex m;
  std::condition_variable cv;
  bool armed = false, hold = false;
  int entered = 0;          // writes of the gradients' tier begun since armed
  std::vector<char> fails;  // which of them fail
  W::options wo;
  wo.tier.before_write = [&] {
    std::unique_lock lk(m);
    if (!armed) { return; }
    int const k = entered++;
    cv.notify_all();
    cv.wait(lk, [&] { return !hold; });
    if (static_cast<std::size_t>(k) < fails.size() && fails[k] != 0) {
      throw std::runtime_error("memory_tier: write " + std::to_string(k) + " failed");
    }
  };
  wo.write_behind_bytes = 4096;  // less than one gradient: one behind at a time
  W w(wo);
  auto const l = w.add_layer("l");
  auto const a = w.add_tensor(l, "a", 3000);
  auto const b = w.add_tensor(l, "b", 3000);
  std::vector<float> const x(3000, 1.0f), y(3000, 2.0f);
  std::vector<float> back(3000);
  w.write(a, 0, x);
  w.flush();  // (the params' write, before the hook counts)
  {
    std::lock_guard lk(m);
    armed = true;
    hold  = true;
    fails = {1, 0, 0, 1};
  }
  w.write_grad(a, x);  // returns while the gradients' thread is held in its write
  {
    std::unique_lock lk(m);
    cv.wait(lk, [&] { return entered == 1; });
  }
  std::atomic<bool> queued{false};
  std::thread second([&] {  // a second gradient waits for room
    w.write_grad(a, y);
    queued = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK(!queued);
  {
    std::lock_guard lk(m);
    hold = false;
  }
  cv.notify_all();
  second.join();
  // Write 0 (x) failed, write 1 (y) did not: the last one counts.
  w.wait_grad(a);
  w.read_grad(a, 0, back);
  CHECK(back == y);
  // Write 2 (x) goes in, write 3 (y) fails: the failure counts, until the next write_grad.
  w.write_grad(b, x);
  w.write_grad(b, y);
  CHECK_THROWS_WITH(w.wait_grad(b), Catch::Contains("write 3 failed"));
  CHECK_THROWS_WITH(w.read_grad(b, 0, back), Catch::Contains("write 3 failed"));
  w.write_grad(b, x);
  w.read_grad(b, 0, back);
  CHECK(back == x);
  CHECK(entered == 5);
  CHECK(w.stats().grad_bytes_written == 3 * 3000 * sizeof(float));
}

namespace {

/// Trains the awkward model with the trainer on the (emulated) device: the window's buffers
/// are device memory, and the gradients it makes there go to CudaOverlapped's host update,
/// which writes the new params into the window's tier. The reference keeps its params in
/// device memory. With `keep_grads`, the trainer makes each layer's gradients in one device
/// buffer of the largest layer's size, on a stream of its own behind slow work, and reuses
/// it (poisoned with NaN) as soon as grad_ready, told that stream, returns; without, it keeps
/// every tensor's until the step ends. An inf in one gradient of
/// step `inf_step` (both runs) is skipped or reported as the options say. (The emulated
/// device's memory is host memory: the test reads views and writes gradients directly.)
template <class Opt>
void check_device_parity(typename Opt::options const& o, unsigned window, bool keep_grads, int inf_step = -1)
{
  using W             = offloaded_params<bf16, test::memory_tier>;
  constexpr int steps = 4;
  std::vector<std::size_t> sizes;
  std::size_t largest = 0;
  for (auto const& layer : model_sizes) {
    sizes.insert(sizes.end(), layer.begin(), layer.end());
    largest = std::max(largest, std::accumulate(layer.begin(), layer.end(), std::size_t{0}));
  }
  auto const device_array = [](std::size_t n) {
    auto* p = static_cast<bf16*>(device::allocate_async(n * sizeof(bf16), {}));
    device::stream_view{}.synchronize();
    return p;
  };
  std::vector<bf16*> ref_params, ref_grads, off_grads;
  Opt ref({}, o), off({}, o);
  counting_resource counted(&default_device_memory_resource());  // the window's device buffers, counted
  W::options wo;
  wo.window                = window;
  wo.where                 = location::device;
  wo.persistence_threshold = 64;
  wo.buffers               = &counted;
  wo.keep_grads            = keep_grads;
  W w(wo);
  for (std::size_t l = 0, t = 0; l < model_sizes.size(); ++l) {
    auto const layer = w.add_layer(std::string("layer").append(std::to_string(l)));
    for (auto const n : model_sizes[l]) { w.add_tensor(layer, tensor_name(t++), n); }
  }
  bf16* const layer_grads = keep_grads ? device_array(largest) : nullptr;  // the trainer's one buffer
  device::stream made;  // where it makes them
  std::size_t const slow_bytes = std::size_t{16} << 20;
  void* const slow = keep_grads ? device::allocate_async(slow_bytes, {}) : nullptr;
  std::vector<std::vector<bf16>> host_grads(sizes.size());  // (sources of copies on `made`: kept until the step ends)
  std::vector<bf16> const poison(largest, bf16(std::numeric_limits<float>::quiet_NaN()));
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    std::vector<bf16> init(sizes[t]);
    for (std::size_t i = 0; i < sizes[t]; ++i) { init[i] = initial_param<bf16>(t, i); }
    ref_params.push_back(device_array(sizes[t]));
    device::copy(ref_params[t], init.data(), sizes[t] * sizeof(bf16));
    ref.add_tensor(tensor_name(t), ref_params[t], sizes[t], location::device);
    w.write(t, 0, init);
    off.add_tensor(w, t);
    CHECK(off.keeps_gradient(t) == keep_grads);
    ref_grads.push_back(device_array(sizes[t]));
    off_grads.push_back(keep_grads ? nullptr : device_array(sizes[t]));
  }
  std::size_t const inf_tensor = 4;  // (in layer 2, offloaded)
  for (int s = 0; s < steps; ++s) {
    std::vector<grad_view<bf16>> rv;
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      gradient_of<bf16, bf16>(std::span<bf16 const>(ref_params[t], sizes[t]), t, s, 0, std::span<bf16>(ref_grads[t], sizes[t]));
      if (s == inf_step && t == inf_tensor) { ref_grads[t][7] = bf16(std::numeric_limits<float>::infinity()); }
      rv.push_back({ref_grads[t], sizes[t], location::device});
    }
    auto const r = ref.step(rv);
    off.begin_step();
    for (std::size_t l = model_sizes.size(), t = sizes.size(); l-- > 0;) {
      auto const v = w.acquire(l);
      t -= v.size();
      for (std::size_t i = 0; i < v.size(); ++i) { REQUIRE(counted.holds(v.tensor(i).data())); }  // (device memory, resident or not)
      for (std::size_t i = 0, at = 0; i < v.size(); at += sizes[t + i], ++i) {
        bf16* const g = keep_grads ? layer_grads + at : off_grads[t + i];
        if (!keep_grads) {
          gradient_of<bf16, bf16>(v.tensor(i), t + i, s, 0, std::span<bf16>(g, sizes[t + i]));
          if (s == inf_step && t + i == inf_tensor) { g[7] = bf16(std::numeric_limits<float>::infinity()); }
          off.grad_ready(t + i, {g, sizes[t + i], location::device});
          continue;
        }
        auto& h = host_grads[t + i];  // (made on the host, sent up behind slow work on `made`)
        h.resize(sizes[t + i]);
        gradient_of<bf16, bf16>(v.tensor(i), t + i, s, 0, std::span<bf16>(h));
        if (s == inf_step && t + i == inf_tensor) { h[7] = bf16(std::numeric_limits<float>::infinity()); }
        device::zero_async(slow, slow_bytes, made);
        device::copy_async(g, h.data(), h.size() * sizeof(bf16), made);
        off.grad_ready(t + i, {g, sizes[t + i], location::device}, made);
      }
      if (keep_grads) { device::copy_async(layer_grads, poison.data(), largest * sizeof(bf16), made); }  // the next layer's
      w.release(l, {});
    }
    auto const f = off.finish_step();
    CHECK(f.skipped == r.skipped);
    CHECK(f.found_nonfinite == r.found_nonfinite);
    CHECK(std::memcmp(&f.grad_norm, &r.grad_norm, sizeof(double)) == 0);  // (NaN after an inf reported)
    CHECK(r.skipped == (s == inf_step && o.on_nonfinite == nonfinite_policy::skip_step));
    if (s == inf_step) { CHECK(r.found_nonfinite == (o.on_nonfinite != nonfinite_policy::ignore)); }
    w.end_iteration();
  }
  made.synchronize();  // (the last poisoning copy, before its buffer is freed)
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    std::vector<bf16> a(sizes[t]), b(sizes[t]);
    device::copy(a.data(), ref_params[t], sizes[t] * sizeof(bf16));
    w.read(t, 0, b);
    REQUIRE(std::memcmp(a.data(), b.data(), sizes[t] * sizeof(bf16)) == 0);
    std::vector<float> ma(sizes[t]), mb(sizes[t]);
    for (auto const sl : {slot::exp_avg, slot::exp_avg_sq, slot::master}) {
      ref.copy_state(tensor_name(t), sl, ma);
      off.copy_state(tensor_name(t), sl, mb);
      REQUIRE(std::memcmp(ma.data(), mb.data(), sizes[t] * sizeof(float)) == 0);
    }
    device::deallocate_async(ref_params[t], {});
    device::deallocate_async(ref_grads[t], {});
    device::deallocate_async(off_grads[t], {});
  }
  device::deallocate_async(layer_grads, {});
  device::deallocate_async(slow, {});
  device::stream_view{}.synchronize();
  auto const st = w.stats();
  // Backward only: the first iteration's guess (forward, then backward) misses twice (at
  // L-1, then at L-2, which it expected after a second L-1); the next ones follow.
  CHECK(st.out_of_order == 2);
  CHECK(st.on_demand <= 2);
  CHECK(w.buffer_count() == window + 1);
  // Device memory: (window + 1) x the largest layer (30011 bf16 -> 15 pages), and what views
  // of the resident tensors show (each rounded up to 64 elements), allocated once; the
  // gradients' is the trainer's: one layer's when kept, else all.
  std::size_t resident = 0;
  for (auto const n : sizes) { resident += n < 64 ? 64 * sizeof(bf16) : 0; }
  CHECK(resident == 6 * 64 * sizeof(bf16));
  CHECK(w.resident_bytes() == (keep_grads ? 2 : 1) * resident);  // (the values, and the kept gradients; no host copy for views)
  CHECK(counted.allocations == window + 2);
  CHECK(counted.peak == (window + 1) * w.buffer_bytes() + resident);
  CHECK(w.buffer_bytes() == 15 * 4096);
  if (keep_grads) {  // (each element read back once a step, except in a step skipped)
    CHECK(st.grad_bytes_written > 0);
    bool const skipped = inf_step >= 0 && o.on_nonfinite == nonfinite_policy::skip_step;
    CHECK((st.grad_bytes_read == st.grad_bytes_written) == !skipped);
  } else {
    CHECK(st.grad_bytes_written == 0);
  }
}

}  // namespace

TEST_CASE("offloaded params on the (emulated) device: device buffers, device gradients, CudaOverlapped",
          "[offload][optimizer][device]")
{
  using Opt = OffloadedOptimizer<AdamW, Bf16Mixed, PinnedHost, CudaOverlapped<2>>;
  typename Opt::options o;
  o.chunk_elements = 2048;
  o.threads        = 2;
  SECTION("the trainer keeps every gradient until the step ends") { check_device_parity<Opt>(o, 2, false); }
  SECTION("each layer's gradients are copied down and kept beside the weights; one device buffer reused")
  {
    for (unsigned const window : {1u, 3u}) {
      CAPTURE(window);
      check_device_parity<Opt>(o, window, true);
    }
    o.max_grad_norm = 0.5;  // the norm from the kept block sums
    check_device_parity<Opt>(o, 2, true);
    check_device_parity<Opt>(o, 2, true, 2);  // an inf seen only in a kept gradient skips the step
    o.on_nonfinite = nonfinite_policy::report;
    check_device_parity<Opt>(o, 2, true, 1);
    o.on_nonfinite  = nonfinite_policy::ignore;
    o.max_grad_norm = 0.0;
    check_device_parity<Opt>(o, 2, true);
  }
  SECTION("state on NVMe, staged")
  {
    test::scratch_dir dir;
    using Nvme = OffloadedOptimizer<AdamW, Bf16Mixed, NvmeFile, CudaOverlapped<2>>;
    typename Nvme::options n;
    n.chunk_elements = 2048;
    n.threads        = 2;
    n.tier.directory = dir.path;
    check_device_parity<Nvme>(n, 2, true);
    n.max_grad_norm = 0.5;
    check_device_parity<Nvme>(n, 1, true, 3);
  }
}

TEST_CASE("offloaded params on the (emulated) device: a device gradient goes to its source behind grad_ready, which "
          "waits for none of its copy, checks and write; a failure there is finish_step's, with nothing changed",
          "[offload][optimizer][device]")
{
  using Opt = OffloadedOptimizer<AdamW, Bf16Mixed, PinnedHost, CudaOverlapped<2>>;
  using W   = offloaded_params<bf16, test::memory_tier>;
  std::mutex m;
  std::condition_variable cv;
  bool armed = false, hold = false, fail = false, timed_out = false;
  int entered = 0;  // writes begun since armed
  W::options wo;
  wo.where                 = location::device;
  wo.write_behind_bytes    = 0;  // (each gradient written before write_grad returns: on the keeper's thread)
  wo.tier.before_write = [&] {
    std::unique_lock lk(m);
    if (!armed) { return; }
    ++entered;
    cv.notify_all();
    timed_out = timed_out || !cv.wait_for(lk, std::chrono::seconds(5), [&] { return !hold; });
    if (fail) { throw std::runtime_error("memory_tier: the gradient's write failed"); }
  };
  W w(wo);
  auto const layer             = w.add_layer("l");
  std::vector<std::size_t> const sizes = {5000, 3000};
  typename Opt::options o;
  o.chunk_elements = 2048;
  o.max_grad_norm  = 0.5;
  Opt opt({}, o), ref({}, o);
  std::vector<bf16*> ref_params;
  for (std::size_t t = 0; t < sizes.size(); ++t) { w.add_tensor(layer, tensor_name(t), sizes[t]); }
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    std::vector<bf16> init(sizes[t]);
    for (std::size_t i = 0; i < sizes[t]; ++i) { init[i] = initial_param<bf16>(t, i); }
    w.write(t, 0, init);
    opt.add_tensor(w, t);
    ref_params.push_back(static_cast<bf16*>(device::allocate_async(sizes[t] * sizeof(bf16), {})));
    device::copy(ref_params[t], init.data(), sizes[t] * sizeof(bf16));
    ref.add_tensor(tensor_name(t), ref_params[t], sizes[t], location::device);
  }
  w.flush();
  device::stream made;  // the trainer's stream, and its one gradient buffer, reused
  auto* const buffer = static_cast<bf16*>(device::allocate_async(8000 * sizeof(bf16), made));
  std::vector<bf16> const poison(8000, bf16(std::numeric_limits<float>::quiet_NaN()));
  std::vector<std::vector<bf16>> host(sizes.size()), ref_grads(sizes.size());
  auto const backward = [&](int s) {  // each gradient made in the buffer on `made`, handed over, then the buffer poisoned
    opt.begin_step();
    for (std::size_t t = sizes.size(); t-- > 0;) {
      host[t].resize(sizes[t]);
      std::vector<bf16> p(sizes[t]);
      w.read(t, 0, p);
      gradient_of<bf16, bf16>(std::span<bf16 const>(p), t, s, 0, std::span<bf16>(host[t]));
      ref_grads[t] = host[t];
      device::copy_async(buffer, host[t].data(), sizes[t] * sizeof(bf16), made);
      opt.grad_ready(t, {buffer, sizes[t], location::device}, made);
      device::copy_async(buffer, poison.data(), sizes[t] * sizeof(bf16), made);
    }
  };
  auto const reference_step = [&] {
    std::vector<bf16*> d;
    std::vector<grad_view<bf16>> views;
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      d.push_back(static_cast<bf16*>(device::allocate_async(sizes[t] * sizeof(bf16), {})));
      device::copy(d[t], ref_grads[t].data(), sizes[t] * sizeof(bf16));
      views.push_back({d[t], sizes[t], location::device});
    }
    auto const r = ref.step(views);
    for (auto* p : d) { device::deallocate_async(p, {}); }
    return r;
  };
  auto const same_as_reference = [&] {
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      std::vector<bf16> a(sizes[t]), b(sizes[t]);
      device::copy(a.data(), ref_params[t], sizes[t] * sizeof(bf16));
      w.read(t, 0, b);
      REQUIRE(std::memcmp(a.data(), b.data(), a.size() * sizeof(bf16)) == 0);
      std::vector<float> ma(sizes[t]), mb(sizes[t]);
      ref.copy_state(tensor_name(t), slot::exp_avg_sq, ma);
      opt.copy_state(tensor_name(t), slot::exp_avg_sq, mb);
      REQUIRE(std::memcmp(ma.data(), mb.data(), ma.size() * sizeof(float)) == 0);
    }
  };
  {
    std::lock_guard lk(m);
    armed = hold = true;
  }
  // The trainer's stream held first (the emulated device's: a task that waits), so that
  // neither the gradients' copies up nor their copies down have run when backward returns.
  bool stream_held = true, stream_timed_out = false;
#if !defined(TIERSTATE_ENABLE_CUDA)
  made.native()->enqueue([&] {
    std::unique_lock lk(m);
    stream_timed_out = !cv.wait_for(lk, std::chrono::seconds(5), [&] { return !stream_held; });
  });
#endif
  backward(0);  // returns while the stream is held
  {
    std::unique_lock lk(m);
    CHECK(entered == 0);  // (no copy down yet, so nothing looked at or written)
    stream_held = false;
  }
  cv.notify_all();
  {
    std::unique_lock lk(m);  // now the first gradient's write begins, and is held
    CHECK(cv.wait_for(lk, std::chrono::seconds(5), [&] { return entered == 1; }));
    CHECK(hold);
    hold  = false;
    armed = false;
  }
  cv.notify_all();
  auto const r0 = opt.finish_step();
  CHECK(!stream_timed_out);  // (grad_ready waiting for its copy down would have waited the 5 s out)
  CHECK(!timed_out);         // (...or writing before it returns)
  CHECK(r0.grad_norm == reference_step().grad_norm);
  same_as_reference();
  // A write that fails behind: finish_step's error; the checks wait for every gradient, so
  // nothing changed, and the step can be taken again.
  {
    std::lock_guard lk(m);
    armed = fail = true;
  }
  backward(1);
  CHECK_THROWS_WITH(opt.finish_step(), Catch::Contains("the gradient's write failed"));
  CHECK(!opt.state_lost());
  CHECK(opt.step_count() == 1);
  same_as_reference();
  {
    std::lock_guard lk(m);
    armed = fail = false;
  }
  backward(1);
  auto const r1 = opt.finish_step();
  CHECK(r1.grad_norm == reference_step().grad_norm);
  CHECK(opt.step_count() == 2);
  same_as_reference();
  device::deallocate_async(buffer, made);
  made.synchronize();
  for (auto* p : ref_params) { device::deallocate_async(p, {}); }
  device::stream_view{}.synchronize();
}

TEST_CASE("grad_keeper: its ring is used in order and wraps, a submit waits for room, a gradient over its size "
          "is refused, and it grows between uses",
          "[offload][device]")
{
  detail::grad_keeper<float> k;
  std::mutex m;
  std::condition_variable cv;
  bool hold_first = true;
  std::vector<float> seen_first;          // each job's first element, in the order handed on
  int bad = 0;                            // jobs whose copy was not their source's
  auto* const src = static_cast<float*>(device::allocate_async(1000 * sizeof(float), {}));
  auto fill = [&](float v, std::size_t n) {  // (stream_view{}: copies at once, on this thread)
    std::vector<float> h(n, v);
    device::copy(src, h.data(), n * sizeof(float));
  };
  auto then = [&](float v, bool first) {
    return [&, v, first](std::span<float const> h, std::exception_ptr failed) {
      std::unique_lock lk(m);
      if (first) { cv.wait(lk, [&] { return !hold_first; }); }
      bad += failed != nullptr || std::any_of(h.begin(), h.end(), [&](float x) { return x != v; }) ? 1 : 0;
      seen_first.push_back(h.empty() ? -1.0f : h[0]);
      cv.notify_all();
    };
  };
  k.size_for(1000);  // a ring of 2 x 4096 bytes
  CHECK(k.ring_bytes() == 0);
  CHECK_THROWS_WITH(k.submit(src, 1001, {}, then(0, false)), Catch::Contains("more than the 1000"));
  for (int j = 0; j < 3; ++j) {  // 600 floats (2560 bytes) each: at 0, 2560 and 5120, the first held
    fill(static_cast<float>(j + 1), 600);
    k.submit(src, 600, {}, then(static_cast<float>(j + 1), j == 0));
  }
  CHECK(k.ring_bytes() == 8192);
  std::atomic<bool> fourth_in{false};
  std::thread fourth([&] {  // no room after 7680, none before the first's end: waits for it
    fill(4, 600);
    k.submit(src, 600, {}, then(4, false));
    fourth_in = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  CHECK(!fourth_in);
  {
    std::lock_guard lk(m);
    hold_first = false;
  }
  cv.notify_all();
  fourth.join();  // (at 0 now: the ring wrapped)
  fill(5, 1000);
  k.submit(src, 1000, {}, then(5, false));  // (waits for the second and third)
  {
    std::unique_lock lk(m);
    cv.wait(lk, [&] { return seen_first.size() == 5; });
  }
  k.size_for(3000);  // grows at the next submit, nothing being queued
  auto* const big = static_cast<float*>(device::allocate_async(3000 * sizeof(float), {}));
  std::vector<float> h(3000, 6.0f);
  device::copy(big, h.data(), h.size() * sizeof(float));
  k.submit(big, 3000, {}, then(6, false));
  CHECK(k.ring_bytes() == 2 * 12032);
  {
    std::unique_lock lk(m);
    cv.wait(lk, [&] { return seen_first.size() == 6; });
  }
  CHECK(bad == 0);
  CHECK(seen_first == std::vector<float>{1, 2, 3, 4, 5, 6});  // in the order submitted
  device::deallocate_async(src, {});
  device::deallocate_async(big, {});
}

TEST_CASE("offloaded params: writes behind are bounded, read back in order, and a failure is flush()'s", "[offload]")
{
  int writes_left = 1 << 30;
  auto o                = options_for<test::memory_tier>(1, 0, {&writes_left, {}});
  o.write_behind_bytes  = 4096;  // most writes wait for room: every one is behind another
  model<offloaded_params<float, test::memory_tier>> m(o);
  m.write_all(0);
  m.iteration(0);
  m.w.flush();
  writes_left = 0;
  m.write_all(1);  // each returns once queued (or once there is room)
  CHECK_THROWS_WITH(m.w.flush(), Catch::Contains("memory_tier: write failed"));
  CHECK_NOTHROW(m.w.flush());  // thrown once
  writes_left = 1 << 30;
  m.write_all(2);
  m.w.end_iteration();
  m.iteration(2);  // every view holds the last writes
  m.w.flush();
  for (std::size_t t = 0; t < m.w.tensor_count(); ++t) {
    std::vector<float> back(m.w.tensor_size(t));
    m.w.read(t, 0, back);
    for (std::size_t i = 0; i < back.size(); ++i) { REQUIRE(back[i] == value_of(t, i, 2)); }
  }
}

TEST_CASE("offloaded params on NVMe: a partial write, behind or not, keeps the bytes around it in its first and last "
          "blocks", "[offload]")
{
  test::scratch_dir dir;
  NvmeFile::options t;
  t.directory = dir.path;
  for (std::size_t const behind : {std::size_t{0}, std::size_t{64} << 20}) {
    CAPTURE(behind);
    auto o               = options_for<NvmeFile>(2, 0, t);
    o.write_behind_bytes = behind;
    model<offloaded_params<float, NvmeFile>> m(o);
    m.write_all(0);
    std::vector<std::vector<float>> shadow(m.w.tensor_count());
    for (std::size_t k = 0; k < shadow.size(); ++k) {
      shadow[k].resize(m.w.tensor_size(k));
      for (std::size_t i = 0; i < shadow[k].size(); ++i) { shadow[k][i] = value_of(k, i, 0); }
    }
    // (offset, count) in floats, 1024 to a 4 KiB block: inside one block (a head and a tail
    // in the same block), across a boundary, from a boundary, to one, whole blocks.
    std::vector<std::pair<std::size_t, std::size_t>> const ranges = {
      {1, 1}, {3, 1000}, {1000, 30}, {0, 1024}, {1024, 1024}, {1023, 2}, {5, 3000}, {0, 4097}, {2047, 1}};
    int version = 10;
    for (auto const& [offset, count] : ranges) {
      for (std::size_t k = 0; k < shadow.size(); ++k) {
        if (offset >= shadow[k].size()) { continue; }
        std::size_t const n = std::min(count, shadow[k].size() - offset);
        std::vector<float> v(n);
        for (std::size_t i = 0; i < n; ++i) { v[i] = shadow[k][offset + i] = static_cast<float>(version) + i; }
        m.w.write(k, offset, v);
        ++version;
      }
    }
    m.w.flush();
    // An empty write, at an offset inside a block: nothing to do, nothing done.
    auto const written = m.w.stats().bytes_written;
    m.w.write(0, 3, std::span<float const>{});
    m.w.flush();
    CHECK(m.w.stats().bytes_written == written);
    for (std::size_t k = 0; k < shadow.size(); ++k) {
      std::vector<float> back(shadow[k].size());
      m.w.read(k, 0, back);
      CAPTURE(k);
      REQUIRE(back == shadow[k]);
    }
  }
}

TEST_CASE("offloaded params with the optimizer: a rule without per-element state (SGD, fp32) checkpoints them too",
          "[offload][optimizer][checkpoint]")
{
  // The chunks hold no bytes here: the params region is in 1 MiB blocks.
  using Opt = OffloadedOptimizer<SGD, Fp32, PinnedHost>;
  using W   = offloaded_params<float, PinnedHost>;
  test::scratch_dir dir;
  auto const make = [](W& w, Opt& opt) {
    auto const layer = w.add_layer("all");
    w.add_tensor(layer, "a", 300001);  // more than a 1 MiB block
    w.add_tensor(layer, "b", 7);
    opt.add_tensor(w, 0);
    opt.add_tensor(w, 1);
  };
  std::vector<float> a(300001), b(7);
  for (std::size_t i = 0; i < a.size(); ++i) { a[i] = static_cast<float>(i % 1000) * 1e-3f; }
  std::vector<float> ga(a.size(), 0.5f), gb(b.size(), -1.0f);
  std::vector<grad_view<float>> const g = {{ga.data(), ga.size()}, {gb.data(), gb.size()}};
  std::vector<float> after_a(a.size()), after_b(b.size());
  {
    W w;
    Opt opt({}, {});
    make(w, opt);
    w.write(0, 0, a);
    w.write(1, 0, b);
    REQUIRE(!opt.step(g).skipped);
    opt.save(dir.path / "sgd");
    w.read(0, 0, after_a);
    w.read(1, 0, after_b);
  }
  W w;
  Opt opt({}, {});
  make(w, opt);
  opt.load(dir.path / "sgd");
  std::vector<float> back_a(a.size()), back_b(b.size());
  w.read(0, 0, back_a);
  w.read(1, 0, back_b);
  CHECK(back_a == after_a);
  CHECK(back_b == after_b);
  CHECK(back_a[1] != a[1]);  // (the step changed them)
}

TEST_CASE("offloaded params with the optimizer: a write that failed behind is the next call's refusal",
          "[offload][optimizer]")
{
  // The trainer's initial values fail to land (behind, unseen): the first step refuses before
  // it makes any state, and save refuses before it makes any file.
  using Opt = OffloadedOptimizer<AdamW, Fp32, PinnedHost>;
  using W   = offloaded_params<float, test::memory_tier>;
  test::scratch_dir dir;
  int writes_left = 0;
  W::options wo;
  wo.tier.writes_left = &writes_left;
  W w(wo);
  auto const layer = w.add_layer("l");
  w.add_tensor(layer, "a", 5000);
  Opt opt;
  opt.add_tensor(w, 0);
  std::vector<float> a(5000, 0.25f), g(5000, 0.1f);
  std::vector<grad_view<float>> const views = {{g.data(), g.size()}};
  w.write(0, 0, a);
  CHECK_THROWS_WITH(opt.step(views), Catch::Contains("memory_tier: write failed"));
  CHECK(!opt.state_lost());
  CHECK(opt.step_count() == 0);
  writes_left = 1 << 30;
  w.write(0, 0, a);
  REQUIRE(!opt.step(views).skipped);
  writes_left = 0;
  w.write(0, 0, a);
  CHECK_THROWS_WITH(opt.save(dir.path / "x"), Catch::Contains("memory_tier: write failed"));
  CHECK(dir.entries().empty());
  CHECK(!opt.state_lost());
  writes_left = 1 << 30;
  REQUIRE(!opt.step(views).skipped);
  CHECK(opt.step_count() == 2);
}

TEST_CASE("offloaded params with the optimizer: gradients kept by the source feed the checks, and a failed keep "
          "hands nothing over",
          "[offload][optimizer]")
{
  // Each final gradient goes to the params' source in grad_ready, which the trainer then
  // overwrites: the clipping norm, the non-finite check and the update all come from what
  // was kept, bit for bit as the same gradients given to step() in memory.
  using Opt = OffloadedOptimizer<AdamW, Fp32, PinnedHost>;
  using W   = offloaded_params<float, test::memory_tier>;
  int writes_left = 1 << 30;
  W::options wo;
  wo.tier.writes_left      = &writes_left;
  wo.persistence_threshold = 100;  // "b" stays in host memory, its gradient too
  // Kept before grad_ready returns, or written behind (the default).
  wo.write_behind_bytes = GENERATE(std::size_t{0}, std::size_t{64} << 20);
  bool const behind     = wo.write_behind_bytes > 0;
  CAPTURE(behind);
  W w(wo);
  auto const layer = w.add_layer("l");
  std::vector<std::size_t> const sizes = {5000, 70, 4097};
  for (std::size_t t = 0; t < sizes.size(); ++t) { w.add_tensor(layer, tensor_name(t), sizes[t]); }
  typename Opt::options o;
  o.chunk_elements = 2048;
  o.max_grad_norm  = 0.5;
  Opt opt({}, o), ref({}, o);
  std::vector<std::vector<float>> plain(sizes.size()), g(sizes.size());
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    plain[t].resize(sizes[t]);
    g[t].resize(sizes[t]);
    for (std::size_t i = 0; i < sizes[t]; ++i) { plain[t][i] = initial_param<float>(t, i); }
    w.write(t, 0, plain[t]);
    opt.add_tensor(w, t);
    ref.add_tensor(tensor_name(t), plain[t].data(), sizes[t]);
  }
  auto const fill = [&](int s) {
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      for (std::size_t i = 0; i < sizes[t]; ++i) { g[t][i] = static_cast<float>((t * 7 + i * 3 + static_cast<std::size_t>(s)) % 101) * 1e-2f - 0.5f; }
    }
  };
  auto const ref_step = [&] {
    std::vector<grad_view<float>> v;
    for (auto const& x : g) { v.push_back({x.data(), x.size()}); }
    return ref.step(v);
  };
  auto const hand_over_all = [&](float poison) {
    for (std::size_t t = sizes.size(); t-- > 0;) {
      opt.grad_ready(t, {g[t].data(), g[t].size()});
      std::fill(g[t].begin(), g[t].end(), poison);
    }
  };
  auto const same_params = [&] {
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      std::vector<float> back(sizes[t]);
      w.read(t, 0, back);
      REQUIRE(std::memcmp(back.data(), plain[t].data(), back.size() * sizeof(float)) == 0);
    }
  };

  SECTION("clipping: the norm of the kept gradients")
  {
    for (int s = 0; s < 3; ++s) {
      fill(s);
      auto const r = ref_step();
      fill(s);
      opt.begin_step();
      hand_over_all(std::numeric_limits<float>::quiet_NaN());
      auto const k = opt.finish_step();
      CHECK(!k.skipped);
      CHECK(k.grad_norm == r.grad_norm);
      same_params();
    }
    CHECK(w.stats().grad_bytes_written == 3 * (5000 + 4097) * sizeof(float));
  }
  SECTION("an inf in a kept gradient skips the step")
  {
    fill(0);
    g[2][4096] = std::numeric_limits<float>::infinity();
    auto const r = ref_step();
    REQUIRE(r.skipped);
    fill(0);
    g[2][4096] = std::numeric_limits<float>::infinity();
    opt.begin_step();
    hand_over_all(0.25f);  // (finite: only the kept look saw the inf)
    auto const k = opt.finish_step();
    CHECK(k.skipped);
    CHECK(k.found_nonfinite);
    same_params();
  }
  SECTION("a keep that fails is grad_ready's error (behind: the step's, nothing changed); handed over again, the "
          "step is the same; left out, it has none")
  {
    for (int s = 0; s < 2; ++s) {
      fill(s);
      auto const r = ref_step();
      fill(s);
      opt.begin_step();
      if (s == 1 && !behind) {
        writes_left = 0;
        CHECK_THROWS_WITH(opt.grad_ready(0, {g[0].data(), g[0].size()}), Catch::Contains("memory_tier: write failed"));
        writes_left = 1 << 30;
      }
      if (s == 1 && behind) {  // grad_ready returns; the write fails on the gradients' thread
        writes_left = 0;
        opt.grad_ready(0, {g[0].data(), g[0].size()});
        CHECK_THROWS_WITH(w.wait_grad(0), Catch::Contains("memory_tier: write failed"));
        CHECK_THROWS_WITH(w.read_grad(0, 0, std::span<float>(g[1].data(), 1)), Catch::Contains("memory_tier: write failed"));
        writes_left = 1 << 30;
        opt.grad_ready(2, {g[2].data(), g[2].size()});
        opt.grad_ready(1, {g[1].data(), g[1].size()});
        CHECK_THROWS_WITH(opt.finish_step(), Catch::Contains("memory_tier: write failed"));  // before any update
        CHECK(!opt.state_lost());
        CHECK(opt.step_count() == 1);
        fill(s);  // (the trainer's backward, again)
        opt.begin_step();
      }
      hand_over_all(-1.0f);
      auto const k = opt.finish_step();
      CHECK(!k.skipped);
      CHECK(k.grad_norm == r.grad_norm);
      same_params();
    }
    if (behind) { return; }  // (a keep behind is never grad_ready's error)
    // Kept before, then a keep that fails: none is kept, and the step leaves the tensor out.
    fill(2);
    std::vector<grad_view<float>> v;
    for (auto const& x : g) { v.push_back({x.data(), x.size()}); }
    v[2] = {};
    auto const r = ref.step(v);
    opt.begin_step();
    writes_left = 0;
    CHECK_THROWS_WITH(opt.grad_ready(2, {g[2].data(), g[2].size()}), Catch::Contains("memory_tier: write failed"));
    writes_left = 1 << 30;
    CHECK_THROWS_WITH(w.read_grad(2, 0, std::span<float>(g[2].data(), 1)), Catch::Contains("no gradient is kept"));
    opt.grad_ready(1, {g[1].data(), g[1].size()});
    opt.grad_ready(0, {g[0].data(), g[0].size()});
    auto const k = opt.finish_step();
    CHECK(k.grad_norm == r.grad_norm);
    same_params();
    std::vector<float> a(sizes[2]), b(sizes[2]);  // (its moments: as the reference's, which had none this step)
    ref.copy_state(tensor_name(2), slot::exp_avg, a);
    opt.copy_state(tensor_name(2), slot::exp_avg, b);
    CHECK(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
  }
  SECTION("no checks: a keep behind that fails is the update's error, and the state is lost")
  {
    if (!behind) { return; }  // (the section above: grad_ready's error)
    o.on_nonfinite  = nonfinite_policy::ignore;
    o.max_grad_norm = 0.0;
    Opt fast({}, o);
    for (std::size_t t = 0; t < sizes.size(); ++t) { fast.add_tensor(w, t); }
    fill(5);
    fast.begin_step();
    writes_left = 0;
    fast.grad_ready(0, {g[0].data(), g[0].size()});
    CHECK_THROWS(w.wait_grad(0));
    writes_left = 1 << 30;
    fast.grad_ready(1, {g[1].data(), g[1].size()});
    fast.grad_ready(2, {g[2].data(), g[2].size()});
    // (backward's order: t2's chunks are updated before the first that needs t0's gradient)
    CHECK_THROWS_WITH(fast.finish_step(), Catch::Contains("memory_tier: write failed"));
    CHECK(fast.state_lost());
    CHECK_THROWS_WITH(fast.begin_step(), Catch::Contains("lost"));
  }
  SECTION("nonfinite_policy::report: the inf is reported, and the step goes on as in memory")
  {
    o.on_nonfinite = nonfinite_policy::report;
    o.max_grad_norm = 0.0;
    Opt rep_opt({}, o), rep_ref({}, o);
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      rep_opt.add_tensor(w, t);
      rep_ref.add_tensor(tensor_name(t) + "r", plain[t].data(), sizes[t]);
    }
    fill(4);
    g[0][17] = -std::numeric_limits<float>::infinity();
    std::vector<grad_view<float>> v;
    for (auto const& x : g) { v.push_back({x.data(), x.size()}); }
    auto const r = rep_ref.step(v);
    CHECK(r.found_nonfinite);
    rep_opt.begin_step();
    for (std::size_t t = sizes.size(); t-- > 0;) {
      rep_opt.grad_ready(t, {g[t].data(), g[t].size()});
      std::fill(g[t].begin(), g[t].end(), 0.5f);
    }
    auto const k = rep_opt.finish_step();
    CHECK(k.found_nonfinite);
    CHECK(!k.skipped);
    same_params();
  }
  SECTION("write_grad and read_grad: sizes and a source that keeps none")
  {
    CHECK_THROWS_WITH(w.read_grad(1, 0, std::span<float>(g[1].data(), 70)), Catch::Contains("no gradient is kept"));
    CHECK_THROWS_WITH(w.write_grad(0, std::span<float const>(g[0].data(), 10)), Catch::Contains("has 10 elements"));
    fill(3);
    w.write_grad(1, g[1]);
    std::vector<float> back(30);
    w.read_grad(1, 40, back);
    CHECK(std::memcmp(back.data(), g[1].data() + 40, back.size() * sizeof(float)) == 0);
    CHECK_THROWS_WITH(w.read_grad(1, 41, back), Catch::Contains("outside"));
    W::options none;
    none.keep_grads = false;
    W other(none);
    other.add_tensor(other.add_layer("l"), "x", 10);
    CHECK(!other.keeps_grads());
    CHECK_THROWS_WITH(other.write_grad(0, std::span<float const>(g[0].data(), 10)), Catch::Contains("keep_grads is false"));
  }
}

TEST_CASE("offloaded params on NVMe: gradients of one layer kept from several threads at once, blocks shared",
          "[offload][optimizer][nvme]")
{
  // Tensors of one layer share 4 KiB blocks of the gradients' tier (each starts 64-byte
  // aligned): kept concurrently, each write reads the blocks it shares and writes them back
  // whole, one tier call at a time, so no tensor's gradient overwrites its neighbour's.
  using Opt = OffloadedOptimizer<AdamW, Bf16Mixed, PinnedHost>;
  using W   = offloaded_params<bf16, NvmeFile>;
  test::scratch_dir dir;
  W::options wo;
  wo.tier.directory = dir.path;
  W w(wo);
  auto const layer = w.add_layer("l");
  std::vector<std::size_t> const sizes = {100, 3000, 7, 2049, 4096, 33, 1000, 1};
  for (std::size_t t = 0; t < sizes.size(); ++t) { w.add_tensor(layer, tensor_name(t), sizes[t]); }
  typename Opt::options o;
  o.chunk_elements = 2048;
  o.max_grad_norm  = 1.0;
  Opt opt({}, o), ref({}, o);
  std::vector<std::vector<bf16>> plain(sizes.size()), g(sizes.size());
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    plain[t].resize(sizes[t]);
    for (std::size_t i = 0; i < sizes[t]; ++i) { plain[t][i] = initial_param<bf16>(t, i); }
    w.write(t, 0, plain[t]);
    opt.add_tensor(w, t);
    ref.add_tensor(tensor_name(t), plain[t].data(), sizes[t]);
  }
  for (int s = 0; s < 4; ++s) {
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      g[t].resize(sizes[t]);
      for (std::size_t i = 0; i < sizes[t]; ++i) { g[t][i] = bf16(static_cast<float>((t * 5 + i + static_cast<std::size_t>(s) * 3) % 61) * 1e-2f - 0.3f); }
    }
    std::vector<grad_view<bf16>> v;
    for (auto const& x : g) { v.push_back({x.data(), x.size()}); }
    auto const r = ref.step(v);
    opt.begin_step();
    std::vector<std::thread> threads;
    for (std::size_t k = 0; k < 4; ++k) {
      threads.emplace_back([&, k] {
        for (std::size_t t = k; t < sizes.size(); t += 4) {
          opt.grad_ready(t, {g[t].data(), g[t].size()});
          std::fill(g[t].begin(), g[t].end(), bf16(1e4f));  // (free: only the kept copy counts)
        }
      });
    }
    for (auto& th : threads) { th.join(); }
    auto const k = opt.finish_step();
    REQUIRE(!k.skipped);
    CHECK(k.grad_norm == r.grad_norm);
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      std::vector<bf16> back(sizes[t]);
      w.read(t, 0, back);
      REQUIRE(std::memcmp(back.data(), plain[t].data(), back.size() * sizeof(bf16)) == 0);
    }
  }
}

namespace {

/// One tensor in host memory, whose write_grad takes a while and then fails.
class failing_keeper final : public param_source<float> {
 public:
  explicit failing_keeper(std::size_t n) : values(n, 0.5f) {}
  void read(std::size_t, std::size_t offset, std::span<float> to) override
  {
    std::copy_n(values.data() + offset, to.size(), to.data());
  }
  void write(std::size_t, std::size_t offset, std::span<float const> from) override
  {
    std::copy(from.begin(), from.end(), values.begin() + static_cast<std::ptrdiff_t>(offset));
  }
  [[nodiscard]] bool keeps_grads() const noexcept override { return true; }
  void write_grad(std::size_t, std::span<float const>) override
  {
    started = true;
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    throw std::runtime_error("failing_keeper: write_grad failed");
  }
  [[nodiscard]] std::size_t tensor_size(std::size_t) const override { return values.size(); }
  [[nodiscard]] std::string const& tensor_name(std::size_t) const override { return name; }

  std::vector<float> values;
  std::string name = "kept";
  std::atomic<bool> started{false};
};

}  // namespace

TEST_CASE("a keep that fails after finish_step began leaves the tensor out instead of hanging the step",
          "[offload][optimizer]")
{
  using Opt = OffloadedOptimizer<AdamW, Fp32, PinnedHost>;
  failing_keeper src(3000);
  std::vector<float> p(100, 1.0f), gp(100, 0.1f), g(3000, 0.2f);
  Opt opt;
  REQUIRE(opt.add_tensor(src, 0) == 0);
  opt.add_tensor("p", p.data(), p.size());
  CHECK(opt.keeps_gradient(0));
  CHECK(!opt.keeps_gradient(1));
  opt.begin_step();
  std::atomic<bool> threw{false};
  std::thread t([&] {
    try {
      opt.grad_ready(0, {g.data(), g.size()});
    } catch (std::runtime_error const&) {
      threw = true;
    }
  });
  while (!src.started) { std::this_thread::yield(); }
  opt.grad_ready(1, {gp.data(), gp.size()});
  auto const r = opt.finish_step();  // (returns once the keep has failed: the tensor has no gradient)
  t.join();
  CHECK(threw);
  CHECK(!r.skipped);
  CHECK(src.values == std::vector<float>(3000, 0.5f));  // not updated
  CHECK(p[0] != 1.0f);                                  // updated
}
