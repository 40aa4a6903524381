// SPDX-License-Identifier: Apache-2.0
// The device side: the Thrust kernels against the host kernels, and the four device
// compositions against PinnedHost + Synchronous on the host, bit for bit.
//
// Built twice. On every machine, with a Thrust host backend (THRUST_DEVICE_SYSTEM = CPP or
// OMP, set by the build) over the emulated device of core/device_runtime.hpp, whose streams
// are threads. And by nvcc with TIERSTATE_ENABLE_CUDA (test_device_cuda.cu), on the GPU,
// where it runs only when there is a device.
#include "block_codec.hpp"
#include <tierstate/codecs/dynamic8.hpp>
#include "device_matrix.hpp"
#include "nvme_support.hpp"
#include "row_column_rule.hpp"
#include "rule_references.hpp"
#include "throttled.hpp"
#include <tierstate/state/offloaded_params.hpp>

#include <catch2/catch.hpp>

#include <atomic>
#include <cmath>
#include <cstring>
#include <cstdlib>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

using namespace tierstate;
using namespace tierstate::test;
using namespace tierstate::test::matrix;

namespace {

/// An array in host memory and its copy in device memory.
template <class T>
struct mirrored {
  std::vector<T> host;
  T* device = nullptr;
  explicit mirrored(std::vector<T> v) : host(std::move(v))
  {
    device = static_cast<T*>(device::allocate_async(host.size() * sizeof(T), {}));
    device::stream_view{}.synchronize();
    upload();
  }
  ~mirrored() { device::deallocate_async(device, {}); }
  mirrored(mirrored const&)            = delete;
  mirrored& operator=(mirrored const&) = delete;
  void upload() { device::copy(device, host.data(), host.size() * sizeof(T)); }
  std::vector<T>& download()
  {
    device::copy(host.data(), device, host.size() * sizeof(T));
    return host;
  }
};

std::size_t large_size()
{
  static std::size_t const n = [] {
    std::size_t size = (std::size_t{1} << 20) + 3;
    if (char const* env = std::getenv("TIERSTATE_TEST_LARGE_SIZE")) {
      size = std::max<std::size_t>(std::strtoull(env, nullptr, 10), 4097);
    }
    return size;
  }();
  return n;
}

/// One rule and precision: `steps` steps of the device kernel and of the host kernel from
/// the same inputs; returns the number of elements whose params or state differ in a bit.
template <class R, class P>
std::size_t kernel_mismatches(std::size_t n, int steps, typename R::hyperparameters const& h)
{
  using param_t = typename P::param_type;
  using grad_t  = typename P::grad_type;
  using state_t = typename P::state_type;
  constexpr std::size_t S = R::slot_count;
  struct arrays {
    std::vector<param_t> param;
    std::vector<grad_t> grad;
    std::vector<float> master;
    std::vector<std::vector<state_t>> state;
    update_arrays<P, S> view()
    {
      update_arrays<P, S> a;
      a.param  = param.data();
      a.grad   = grad.data();
      a.master = P::has_master ? master.data() : nullptr;
      for (std::size_t j = 0; j != S; ++j) { a.state[j] = state[j].data(); }
      return a;
    }
  };
  auto make = [&] {
    arrays a;
    a.param.resize(n);
    a.grad.resize(n);
    a.master.resize(n);
    a.state.assign(S, std::vector<state_t>(n, convert<state_t>(0.0f)));
    for (std::size_t i = 0; i < n; ++i) {
      a.master[i] = init_value(i);
      a.param[i]  = convert<param_t>(init_value(i));
    }
    return a;
  };
  arrays host_side = make();
  arrays start     = make();
  mirrored<param_t> d_param(start.param);
  mirrored<grad_t> d_grad(start.grad);
  mirrored<float> d_master(start.master);
  std::vector<std::unique_ptr<mirrored<state_t>>> d_state;
  for (std::size_t j = 0; j != S; ++j) { d_state.push_back(std::make_unique<mirrored<state_t>>(start.state[j])); }
  update_arrays<P, S> on_device;
  on_device.param  = d_param.device;
  on_device.grad   = d_grad.device;
  on_device.master = P::has_master ? d_master.device : nullptr;
  for (std::size_t j = 0; j != S; ++j) { on_device.state[j] = d_state[j]->device; }
  thread_pool pool(2);
  device::stream s;
  for (int t = 1; t <= steps; ++t) {
    for (std::size_t i = 0; i < n; ++i) {
      // Every 97th gradient is huge or tiny, to reach overflow and underflow of the state.
      float g = grad_value(i, t);
      if (i % 97 == 5) { g *= 1e30f; }
      if (i % 97 == 6) { g *= 1e-30f; }
      host_side.grad[i] = d_grad.host[i] = convert<grad_t>(g);
    }
    d_grad.upload();
    auto const k = R::coefficients_for(h, t, t % 3 == 0 ? 1024.0 : 1.0);
    host::update<R, P>(pool, k, host_side.view(), n);
    device::update_async<R, P>(s, k, on_device, n);
    s.synchronize();
  }
  arrays device_side;
  device_side.param  = d_param.download();
  device_side.master = d_master.download();
  for (std::size_t j = 0; j != S; ++j) { device_side.state.push_back(d_state[j]->download()); }
  // The same bits; two NaNs count as the same (CUDA's conversions make the canonical NaN,
  // tierstate's keep the payload).
  auto same = [](auto a, auto b) {
    float const fa = convert<float>(a), fb = convert<float>(b);
    return bits(a) == bits(b) || (fa != fa && fb != fb);
  };
  std::size_t bad = 0;
  for (std::size_t i = 0; i < n; ++i) {
    bool ok = same(host_side.param[i], device_side.param[i]);
    if constexpr (P::has_master) { ok = ok && same(host_side.master[i], device_side.master[i]); }
    for (std::size_t j = 0; j != S; ++j) { ok = ok && same(host_side.state[j][i], device_side.state[j][i]); }
    bad += ok ? 0 : 1;
  }
  return bad;
}

template <class R, class P>
void check_rule()
{
  typename R::hyperparameters h;
  h.lr           = 3e-3;
  h.weight_decay = 0.1;
  for (std::size_t const n : {std::size_t{1}, std::size_t{7}, std::size_t{4095}, std::size_t{4097}, large_size()}) {
    INFO(R::name << " " << P::name() << " n=" << n);
    CHECK(kernel_mismatches<R, P>(n, 5, h) == 0);
  }
  h = unusual_hyperparameters<R>();  // maximize, and each rule's other branches
  h.lr = 3e-3;
  INFO(R::name << " " << P::name() << " maximize, beta1 0.3 or Nesterov");
  CHECK(kernel_mismatches<R, P>(4097, 7, h) == 0);
  if constexpr (requires { h.dampening; }) {
    h    = unusual_hyperparameters_2<R>();  // SGD: dampening instead of Nesterov
    h.lr = 3e-3;
    INFO(R::name << " " << P::name() << " dampening");
    CHECK(kernel_mismatches<R, P>(4097, 7, h) == 0);
  }
}

}  // namespace

TEMPLATE_LIST_TEST_CASE("the device kernel under Thrust's host backend gives the host kernel's bits",
                        "[device][kernel]", kernel_precisions)
{
  INFO("Thrust device system: " << device::system_name());
  check_rule<Adam, TestType>();
  check_rule<AdamW, TestType>();
  check_rule<AdamAmsgrad, TestType>();
  check_rule<AdamWAmsgrad, TestType>();
  check_rule<SGD, TestType>();
  check_rule<SGDMomentum, TestType>();
  check_rule<Lion, TestType>();
}

TEST_CASE("the device kernel refuses missing arrays, and finds non-finite values", "[device][kernel]")
{
  device::stream s;
  update_arrays<Bf16Mixed, 2> a;
  auto const k = AdamW::coefficients_for({}, 1);
  CHECK_THROWS_AS((device::update_async<AdamW, Bf16Mixed>(s, k, a, 10)), tierstate::logic_error);
  CHECK_NOTHROW((device::update_async<AdamW, Bf16Mixed>(s, k, a, 0)));

  mirrored<bf16> g(std::vector<bf16>(5000, bf16(1.0f)));
  CHECK_FALSE(device::any_nonfinite(s, g.device, 5000));
  g.host[4999] = bf16(std::numeric_limits<float>::infinity());
  g.upload();
  CHECK(device::any_nonfinite(s, g.device, 5000));
  mirrored<fp16> h(std::vector<fp16>(3, fp16(1.0f)));
  h.host[1] = fp16(std::numeric_limits<float>::quiet_NaN());
  h.upload();
  CHECK(device::any_nonfinite(s, h.device, 3));
  CHECK_FALSE(device::any_nonfinite(s, h.device, 1));

  // The queued form: tensors mark one flag, read once.
  auto* flag     = static_cast<std::uint32_t*>(device::allocate_async(sizeof(std::uint32_t), s));
  auto read_flag = [&] {
    std::uint32_t v = 7;
    device::copy_async(&v, flag, sizeof v, s);
    s.synchronize();
    return v;
  };
  device::zero_async(flag, sizeof(std::uint32_t), s);
  mirrored<float> f(std::vector<float>(70001, 0.5f));
  device::mark_nonfinite_async(s, f.device, 70001, flag);
  device::mark_nonfinite_async(s, h.device, 1, flag);
  CHECK(read_flag() == 0);
  device::mark_nonfinite_async(s, g.device, 5000, flag);  // the infinity at 4999
  device::mark_nonfinite_async(s, f.device, 70001, flag);  // leaves the mark as it is
  CHECK(read_flag() == 1);
  device::zero_async(flag, sizeof(std::uint32_t), s);
  f.host[0] = -std::numeric_limits<float>::infinity();
  f.upload();
  device::mark_nonfinite_async(s, f.device, 70001, flag);
  CHECK(read_flag() == 1);
  device::deallocate_async(flag, s);
  s.synchronize();
}

TEST_CASE("TIERSTATE_CUDA_TRY lets success through and throws cuda_error naming a failed call", "[device][runtime]")
{
  int calls = 0;
#if defined(TIERSTATE_ENABLE_CUDA)
  auto const status = [&](bool ok) {
    ++calls;
    return ok ? cudaSuccess : cudaErrorInvalidValue;
  };
  char const* const reason = "cudaErrorInvalidValue";
#else
  // The emulation's statuses: integral or enum, zero for success, as cudaError_t.
  enum class emulated_status : int { ok = 0, refused = 22 };
  auto const status = [&](bool ok) {
    ++calls;
    return ok ? emulated_status::ok : emulated_status::refused;
  };
  char const* const reason = "status 22";
  CHECK_NOTHROW([] { TIERSTATE_CUDA_TRY(0); }());
  CHECK_THROWS_AS([] { TIERSTATE_CUDA_TRY(-1); }(), tierstate::cuda_error);
#endif
  CHECK_NOTHROW([&] { TIERSTATE_CUDA_TRY(status(true)); }());
  CHECK(calls == 1);
  try {
    TIERSTATE_CUDA_TRY(status(false));
    FAIL("a failed status did not throw");
  } catch (tierstate::cuda_error const& e) {
    CHECK_THAT(e.what(), Catch::Matchers::Contains("status(false)") && Catch::Matchers::Contains(reason));
  }
  CHECK(calls == 2);  // evaluated once
}

// The OMP build (test_device_omp) has the kernel tests only: the compositions below call the
// kernels those tests check under OMP, and that build never ran them (it ran `[kernel]`);
// it compiled them for nothing.
#if !defined(TIERSTATE_TEST_DEVICE_KERNEL_ONLY)

// --- the compositions --------------------------------------------------------------------

namespace {

static_assert(device_tier<Device> && !addressable_tier<Device>);
static_assert(is_cuda_overlapped_v<CudaOverlapped<3>> && CudaOverlapped<3>::staging_buffers == 5);

template <class T>
std::vector<std::vector<std::uint32_t>> bits_of(std::vector<std::vector<T>> const& v)
{
  std::vector<std::vector<std::uint32_t>> out;
  for (auto const& x : v) {
    out.emplace_back();
    for (auto const& e : x) { out.back().push_back(bits(e)); }
  }
  return out;
}

/// The model's params and gradients in (emulated) device memory: tensors for which
/// `on_device(t)` holds are registered as device memory, the rest as host memory.
template <class Opt>
run_result train_on_device(int steps, typename Opt::options const& o,
                           bool (*on_device)(std::size_t) = nullptr,
                           std::vector<step_result>* results = nullptr,
                           bool (*absent)(std::size_t, int) = nullptr)
{
  if (on_device == nullptr) {
    on_device = [](std::size_t) { return true; };
  }
  using P = typename Opt::precision_type;
  nvme_model<P> m;
  std::vector<std::unique_ptr<mirrored<typename P::param_type>>> params;
  std::vector<std::unique_ptr<mirrored<typename P::grad_type>>> grads;
  Opt opt(schedule<Opt>(1), o);
  for (std::size_t k = 0; k < m.params.size(); ++k) {
    params.push_back(std::make_unique<mirrored<typename P::param_type>>(m.params[k]));
    grads.push_back(std::make_unique<mirrored<typename P::grad_type>>(m.grads[k]));
    opt.add_tensor(tensor_name(k), on_device(k) ? params[k]->device : m.params[k].data(),
                   m.params[k].size(), on_device(k) ? location::device : location::host);
  }
  typename Opt::hyperparameters h;
  h.lr           = 3e-3;
  h.betas        = {0.8, 0.99};
  h.weight_decay = 0.0;
  opt.add_group(h, {"t1", "t4"});
  for (int t = 1; t <= steps; ++t) {
    m.fill_grads(t);
    opt.set_hyperparameters(0, schedule<Opt>(t));
    auto views = m.views();
    for (std::size_t k = 0; k < views.size(); ++k) {
      if (on_device(k)) {
        grads[k]->host = m.grads[k];
        grads[k]->upload();
        views[k] = {grads[k]->device, m.grads[k].size(), location::device};
      }
      if (absent != nullptr && absent(k, t)) { views[k] = {}; }
    }
    auto const r = opt.step(views);
    if (results != nullptr) { results->push_back(r); }
  }
  opt.flush();  // delayed_update: the last update's params into the model
  for (std::size_t k = 0; k < m.params.size(); ++k) {
    if (on_device(k)) { m.params[k] = params[k]->download(); }
  }
  return snapshot(opt, m);
}

}  // namespace

TEMPLATE_LIST_TEST_CASE("the four device compositions give PinnedHost + Synchronous's bits over 50 steps",
                        "[device][compositions]", state_precisions)
{
  using P = TestType;
  for (std::size_t const chunk : {std::size_t{2048}, std::size_t{6144}, std::size_t{1} << 20}) {
    INFO("chunk_elements " << chunk);
    run_result const expected = reference<P>(50, chunk);
    scratch_dir d;
    SECTION("state on the device, compute on the device") {
      CHECK(train_on_device<DeviceResident<P>>(50, chunked<DeviceResident<P>>(chunk)) == expected);
    }
    SECTION("state in PinnedHost, compute on the host (ZeRO-Offload)") {
      CHECK(train_on_device<ZeroOffload<P, 1>>(50, chunked<ZeroOffload<P, 1>>(chunk)) == expected);
      CHECK(train_on_device<ZeroOffload<P, 2>>(50, chunked<ZeroOffload<P, 2>>(chunk, 1)) == expected);
      CHECK(train_on_device<ZeroOffload<P, 3>>(50, chunked<ZeroOffload<P, 3>>(chunk)) == expected);
    }
    SECTION("ZeRO-Offload's delayed parameter update, after a flush") {
      auto o           = chunked<ZeroOffload<P, 2>>(chunk);
      o.delayed_update = true;
      CHECK(train_on_device<ZeroOffload<P, 2>>(50, o) == expected);
      auto n           = chunked<ZeroInfinity<P, 2>>(chunk);
      n.tier           = in(d);
      n.delayed_update = true;
      CHECK(train_on_device<ZeroInfinity<P, 2>>(50, n) == expected);
    }
    SECTION("state in NvmeFile through PinnedHost, compute on the host (ZeRO-Infinity)") {
      auto o     = chunked<ZeroInfinity<P, 1>>(chunk);
      o.tier     = in(d);
      CHECK(train_on_device<ZeroInfinity<P, 1>>(50, o) == expected);
      auto o3    = chunked<ZeroInfinity<P, 3>>(chunk);
      o3.tier    = in(d);
      CHECK(train_on_device<ZeroInfinity<P, 3>>(50, o3) == expected);
      CHECK(d.entries().empty());
    }
    SECTION("state in PinnedHost or NvmeFile, compute on the device (state streamed to the GPU)") {
      CHECK(train_on_device<Streamed<P, PinnedHost, 1>>(50, chunked<Streamed<P, PinnedHost, 1>>(chunk)) == expected);
      CHECK(train_on_device<Streamed<P, PinnedHost, 2>>(50, chunked<Streamed<P, PinnedHost, 2>>(chunk)) == expected);
      auto o  = chunked<Streamed<P, NvmeFile, 2>>(chunk);
      o.tier  = in(d);
      CHECK(train_on_device<Streamed<P, NvmeFile, 2>>(50, o) == expected);
      auto o1 = chunked<Streamed<P, NvmeFile, 1>>(chunk);
      o1.tier = in(d);
      CHECK(train_on_device<Streamed<P, NvmeFile, 1>>(50, o1) == expected);
    }
  }
}

/// The test model with params and gradients in device memory.
template <class P>
struct device_model {
  test_model<P> m;
  std::vector<std::unique_ptr<mirrored<typename P::param_type>>> params;
  std::vector<std::unique_ptr<mirrored<typename P::grad_type>>> grads;
  explicit device_model(std::vector<std::size_t> const& sizes = nvme_sizes) : m(sizes)
  {
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      params.push_back(std::make_unique<mirrored<typename P::param_type>>(m.params[k]));
      grads.push_back(std::make_unique<mirrored<typename P::grad_type>>(m.grads[k]));
    }
  }
  template <class Opt>
  void register_in(Opt& opt)
  {
    for (std::size_t k = 0; k < params.size(); ++k) {
      opt.add_tensor(tensor_name(k), params[k]->device, m.params[k].size(), location::device);
    }
  }
  std::vector<grad_view<typename P::grad_type>> views(int t)
  {
    m.fill_grads(t);
    std::vector<grad_view<typename P::grad_type>> v;
    for (std::size_t k = 0; k < grads.size(); ++k) {
      grads[k]->host = m.grads[k];
      grads[k]->upload();
      v.push_back({grads[k]->device, m.grads[k].size(), location::device});
    }
    return v;
  }
  test_model<P> const& downloaded()
  {
    for (std::size_t k = 0; k < params.size(); ++k) { m.params[k] = params[k]->download(); }
    return m;
  }
};

namespace {

/// As train_on_device, with streaming steps: every gradient handed over from 3 threads in
/// a shuffled order, each with its own "backward" stream.
template <class Opt>
run_result train_on_device_streaming(int steps, typename Opt::options const& o)
{
  using P = typename Opt::precision_type;
  device_model<P> dm;
  Opt opt(schedule<Opt>(1), o);
  dm.register_in(opt);
  typename Opt::hyperparameters h;
  h.lr           = 3e-3;
  h.betas        = {0.8, 0.99};
  h.weight_decay = 0.0;
  opt.add_group(h, {"t1", "t4"});
  std::mt19937 rng(11);
  device::stream backward[3];
  for (int t = 1; t <= steps; ++t) {
    opt.set_hyperparameters(0, schedule<Opt>(t));
    auto const views = dm.views(t);
    std::vector<std::size_t> order(views.size());
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::shuffle(order.begin(), order.end(), rng);
    opt.begin_step();
    std::atomic<std::size_t> next{0};
    std::vector<std::thread> threads;
    for (int w = 0; w < 3; ++w) {
      threads.emplace_back([&, w] {
        for (std::size_t i; (i = next.fetch_add(1)) < order.size();) {
          opt.grad_ready(order[i], views[order[i]], backward[w]);
        }
      });
    }
    for (auto& th : threads) { th.join(); }
    opt.finish_step();
  }
  return snapshot(opt, dm.downloaded());
}

}  // namespace

TEMPLATE_LIST_TEST_CASE("streaming steps on the device compositions give step()'s bits",
                        "[device][streaming]", device_streaming_compositions)
{
  using P = typename TestType::precision_type;
  scratch_dir d;
  for (auto const policy : {nonfinite_policy::ignore, nonfinite_policy::skip_step}) {
    for (std::size_t const chunk : {std::size_t{2048}, std::size_t{16384}}) {
      INFO("chunk " << chunk << ", checks " << (policy == nonfinite_policy::ignore ? "off" : "on"));
      auto o         = chunked<TestType>(chunk);
      o.on_nonfinite = policy;
      if constexpr (requires { o.tier.directory; }) { o.tier.directory = d.path; }
      CHECK(train_on_device_streaming<TestType>(20, o) == reference<P>(20, chunk));
    }
  }
}

namespace {

/// The device compositions under a user's transfer (tests/throttled.hpp) that says
/// params_on_device: every device route, each against the same composition under
/// CudaOverlapped<2>, the pipelined schedule.
template <class P, class Tier, class Compute, unsigned Depth>
using throttled_on_device = OffloadedOptimizer<AdamW, P, Tier, Throttled<Depth, true>, Compute>;
template <class P, class Tier, class Compute>
using overlapped_on_device = OffloadedOptimizer<AdamW, P, Tier, CudaOverlapped<2>, Compute>;

/// 2048-element chunks; an NvmeFile's state in `d`.
template <class Opt>
typename Opt::options chunked_in(scratch_dir const& d)
{
  auto o = chunked<Opt>(2048);
  if constexpr (requires { o.tier.directory; }) { o.tier.directory = d.path; }
  return o;
}

}  // namespace

/// (state tier, compute) of every device route; reduced: one OnHost and one OnDevice route.
using device_routes =
  pick<std::tuple<std::pair<Device, OnDevice>, std::pair<PinnedHost, OnDevice>, std::pair<NvmeFile, OnDevice>,
                  std::pair<PinnedHost, OnHost<>>, std::pair<NvmeFile, OnHost<>>>,
       std::tuple<std::pair<NvmeFile, OnDevice>, std::pair<PinnedHost, OnHost<>>>>;

TEMPLATE_LIST_TEST_CASE("a user's transfer over every device route gives CudaOverlapped's bits, plain and streaming",
                        "[device][transfer]", device_routes)
{
  using Tier    = typename TestType::first_type;
  using Compute = typename TestType::second_type;
  using P       = Bf16Mixed;
  using Pipe    = overlapped_on_device<P, Tier, Compute>;
  scratch_dir d;
  auto const expected = train_on_device<Pipe>(12, chunked_in<Pipe>(d));
  REQUIRE(expected == reference<P>(12, 2048));
  throttled_computes = 0;
  using T1 = throttled_on_device<P, Tier, Compute, 1>;
  using T3 = throttled_on_device<P, Tier, Compute, 3>;
  CHECK(train_on_device<T1>(12, chunked_in<T1>(d)) == expected);
  CHECK(throttled_computes > 12);  // the user's schedule drove the chunks
  CHECK(train_on_device<T3>(12, chunked_in<T3>(d)) == expected);
  CHECK(train_on_device_streaming<T1>(12, chunked_in<T1>(d)) == reference<P>(12, 2048));
}

TEMPLATE_LIST_TEST_CASE("a tensor without a gradient keeps its own step count on every device route",
                        "[device][steps]", device_routes)
{
  using Tier    = typename TestType::first_type;
  using Compute = typename TestType::second_type;
  using P       = Bf16Mixed;
  using Pipe    = overlapped_on_device<P, Tier, Compute>;
  // t5 (in a group of its own hyper-parameters' schedule) misses every third step, t2 all but
  // the first: their bias corrections are their own counts', as on the host.
  auto const absent = [](std::size_t t, int step) { return (t == 5 && step % 3 == 0) || (t == 2 && step > 1); };
  scratch_dir d;
  typename HostOpt<P>::options host;
  host.chunk_elements = 2048;
  CHECK(train_on_device<Pipe>(12, chunked_in<Pipe>(d), nullptr, nullptr, absent) ==
        train<HostOpt<P>>(12, host, false, absent));
}

// The 8-bit moments take the element-parallel kernels (a thread an element, then the blocks'
// scales, then the codes); the test's block codec and StochasticRounding alone, the block ones.
static_assert(device::TIERSTATE_DEVICE_ABI::detail::elementwise_blocks<AdamW, Bf16Mixed8bit, 2>);
static_assert(device::TIERSTATE_DEVICE_ABI::detail::elementwise_blocks<AdamW, Precision<bf16, bf16, Compensated, Bf16Mixed8bit::state_type>, 2>);
static_assert(!device::TIERSTATE_DEVICE_ABI::detail::elementwise_blocks<AdamW, Bf16MixedInt8M, 2>);
static_assert(!device::TIERSTATE_DEVICE_ABI::detail::elementwise_blocks<AdamW, Bf16Stochastic, 2>);

/// The test's block codecs (tests/block_codec.hpp) over the device routes: all five with 8-bit
/// m in blocks of 256, two with blocks of 64 (smaller than some chunks' pieces, larger than
/// others), and Compensated (no master) on an OnDevice and an OnHost route (whose params
/// come down from the device, since the update reads them); the library's 8-bit moments
/// (codecs/dynamic8.hpp: its tables are the device's own copies under nvcc) on three routes,
/// and StochasticRounding (its bits a hash of the element's place) on two; reduced: one OnHost
/// and three OnDevice routes.
using codec_device_routes =
  pick<std::tuple<overlapped_on_device<Bf16MixedInt8M, Device, OnDevice>,
                  overlapped_on_device<Bf16MixedInt8M, PinnedHost, OnDevice>,
                  overlapped_on_device<Bf16MixedInt8M, NvmeFile, OnDevice>,
                  overlapped_on_device<Bf16MixedInt8M, PinnedHost, OnHost<>>,
                  overlapped_on_device<Bf16MixedInt8M, NvmeFile, OnHost<>>,
                  overlapped_on_device<Fp32Int8M, Device, OnDevice>, overlapped_on_device<Fp32Int8M, NvmeFile, OnHost<>>,
                  overlapped_on_device<Bf16Compensated, Device, OnDevice>,
                  overlapped_on_device<Bf16Compensated, PinnedHost, OnHost<>>,
                  overlapped_on_device<Bf16Mixed8bit, Device, OnDevice>,
                  overlapped_on_device<Bf16Mixed8bit, NvmeFile, OnDevice>,
                  overlapped_on_device<Bf16Mixed8bit, PinnedHost, OnHost<>>,
                  overlapped_on_device<Bf16Stochastic, Device, OnDevice>,
                  overlapped_on_device<Bf16Stochastic, PinnedHost, OnHost<>>>,
       std::tuple<overlapped_on_device<Bf16MixedInt8M, NvmeFile, OnDevice>,
                  overlapped_on_device<Bf16Compensated, PinnedHost, OnHost<>>,
                  overlapped_on_device<Bf16Mixed8bit, Device, OnDevice>,
                  overlapped_on_device<Bf16Stochastic, Device, OnDevice>>>;

TEMPLATE_LIST_TEST_CASE("a block codec through every device route gives PinnedHost's bits, plain and streaming",
                        "[device][codec]", codec_device_routes)
{
  using P = typename TestType::precision_type;
  scratch_dir d;
  for (std::size_t const chunk : {std::size_t{2048}, std::size_t{16384}}) {
    INFO("chunk_elements " << chunk);
    auto o = chunked<TestType>(chunk);
    if constexpr (requires { o.tier.directory; }) { o.tier.directory = d.path; }
    auto const want = reference<P>(12, chunk);  // test_codec.cpp: a plain loop's bits
    CHECK(train_on_device<TestType>(12, o) == want);
    CHECK(train_on_device_streaming<TestType>(12, o) == want);
  }
}

/// A rule with a tensor phase (tests/row_column_rule.hpp) on the device routes: its passes
/// read device gradients (OnDevice: its per-tensor state goes to the device for the kernels).
template <class P, class Tier, class Compute>
using row_column_on_device = OffloadedOptimizer<RowColumn, P, Tier, CudaOverlapped<2>, Compute>;
using tensor_phase_device_routes =
  pick<std::tuple<row_column_on_device<Bf16Mixed, Device, OnDevice>, row_column_on_device<Bf16Mixed, NvmeFile, OnDevice>,
                  row_column_on_device<Bf16Mixed, PinnedHost, OnHost<>>, row_column_on_device<Fp32, NvmeFile, OnHost<>>>,
       std::tuple<row_column_on_device<Bf16Mixed, NvmeFile, OnDevice>, row_column_on_device<Bf16Mixed, PinnedHost, OnHost<>>>>;

TEMPLATE_LIST_TEST_CASE("a rule with a tensor phase through the device routes gives the plain loop's bits, plain and streaming",
                        "[device][tensor_phase]", tensor_phase_device_routes)
{
  using Opt     = TestType;
  using P       = typename Opt::precision_type;
  using param_t = typename P::param_type;
  using grad_t  = typename P::grad_type;
  scratch_dir d;
  int const steps = 6;
  auto const want = rc_plain<P>(steps);
  for (bool const streaming : {false, true}) {
    INFO("streaming " << streaming);
    auto o = chunked<Opt>(2048);
    if constexpr (requires { o.tier.directory; }) { o.tier.directory = d.path; }
    Opt opt(rc_hyper(), o);
    std::vector<std::unique_ptr<mirrored<param_t>>> w;
    std::vector<std::unique_ptr<mirrored<grad_t>>> g;
    for (std::size_t t = 0; t < rc_shapes.size(); ++t) {
      std::vector<param_t> init(rc_shapes[t].elements());
      for (std::size_t i = 0; i < init.size(); ++i) { init[i] = convert<param_t>(0.001f * static_cast<float>(i % 97) - 0.05f); }
      w.push_back(std::make_unique<mirrored<param_t>>(std::move(init)));
      g.push_back(std::make_unique<mirrored<grad_t>>(std::vector<grad_t>(rc_shapes[t].elements())));
      opt.add_tensor(std::string(rc_names[t]), w[t]->device, rc_shapes[t], location::device);
    }
    for (int s = 1; s <= steps; ++s) {
      std::vector<grad_view<grad_t>> views;
      for (std::size_t t = 0; t < rc_shapes.size(); ++t) {
        for (std::size_t i = 0; i < g[t]->host.size(); ++i) { g[t]->host[i] = convert<grad_t>(rc_grad(s, t, i)); }
        g[t]->upload();
        views.push_back({g[t]->device, g[t]->host.size(), location::device});
      }
      rc_step(opt, views, streaming);
    }
    rc_result got;
    for (std::size_t t = 0; t < rc_shapes.size(); ++t) {
      got.params.emplace_back();
      for (auto const x : w[t]->download()) { got.params.back().push_back(convert<float>(x)); }
      got.momentum.emplace_back(rc_shapes[t].elements());
      opt.copy_state(rc_names[t], slot{"momentum"}, got.momentum.back());
      got.tensor_state.emplace_back(opt.tensor_state_size(rc_names[t]));
      opt.copy_tensor_state(rc_names[t], got.tensor_state.back());
    }
    CHECK(got == want);
  }
}

/// Adafactor on the device routes: its passes read device gradients and device params (the
/// param's RMS), and the kernels read its statistics on the device; against the host's bits.
template <class P, class Tier, class Compute>
using adafactor_on_device = OffloadedOptimizer<Adafactor, P, Tier, CudaOverlapped<2>, Compute>;
using adafactor_device_routes =
  pick<std::tuple<adafactor_on_device<Bf16Mixed, Device, OnDevice>, adafactor_on_device<Bf16Mixed, NvmeFile, OnDevice>,
                  adafactor_on_device<Bf16Mixed, PinnedHost, OnHost<>>, adafactor_on_device<Fp32, NvmeFile, OnHost<>>>,
       std::tuple<adafactor_on_device<Bf16Mixed, NvmeFile, OnDevice>, adafactor_on_device<Fp32, PinnedHost, OnHost<>>>>;

TEMPLATE_LIST_TEST_CASE("Adafactor through the device routes gives the host's bits, plain and streaming",
                        "[device][tensor_phase][adafactor]", adafactor_device_routes)
{
  using Opt     = TestType;
  using P       = typename Opt::precision_type;
  using param_t = typename P::param_type;
  using grad_t  = typename P::grad_type;
  std::vector<tensor_shape> const shapes{tensor_shape::of({7, 33}), tensor_shape::of({2, 3, 5}),
                                         tensor_shape::of_vector(11), tensor_shape::of({37, 3})};
  auto const grad_at = [&](std::size_t t, std::size_t i, int s) {
    return (1.0f + static_cast<float>(i / shapes[t].columns % 3)) * grad_value(i + 1000 * t, static_cast<std::uint64_t>(s));
  };
  Adafactor::hyperparameters h;
  h.weight_decay = 0.1;
  int const steps = 6;
  // The host's: params and statistics after `steps` steps.
  std::vector<std::vector<float>> want_params, want_state;
  {
    OffloadedOptimizer<Adafactor, P, PinnedHost> host(h, chunked<OffloadedOptimizer<Adafactor, P, PinnedHost>>(2048));
    std::vector<std::vector<param_t>> w;
    std::vector<std::vector<grad_t>> g;
    for (std::size_t t = 0; t < shapes.size(); ++t) {
      w.emplace_back(shapes[t].elements());
      for (std::size_t i = 0; i < w[t].size(); ++i) { w[t][i] = convert<param_t>(init_value(i + 1000 * t)); }
      g.emplace_back(shapes[t].elements());
      host.add_tensor(tensor_name(t), w[t].data(), shapes[t]);
    }
    for (int s = 1; s <= steps; ++s) {
      std::vector<grad_view<grad_t>> views;
      for (std::size_t t = 0; t < shapes.size(); ++t) {
        for (std::size_t i = 0; i < g[t].size(); ++i) { g[t][i] = convert<grad_t>(grad_at(t, i, s)); }
        views.push_back({g[t].data(), g[t].size()});
      }
      (void)host.step(views);
    }
    for (std::size_t t = 0; t < shapes.size(); ++t) {
      want_params.emplace_back();
      for (auto const x : w[t]) { want_params.back().push_back(convert<float>(x)); }
      want_state.emplace_back(host.tensor_state_size(tensor_name(t)));
      host.copy_tensor_state(tensor_name(t), want_state.back());
    }
  }
  scratch_dir d;
  for (bool const streaming : {false, true}) {
    INFO("streaming " << streaming);
    auto o = chunked<Opt>(2048);
    if constexpr (requires { o.tier.directory; }) { o.tier.directory = d.path; }
    Opt opt(h, o);
    std::vector<std::unique_ptr<mirrored<param_t>>> w;
    std::vector<std::unique_ptr<mirrored<grad_t>>> g;
    for (std::size_t t = 0; t < shapes.size(); ++t) {
      std::vector<param_t> init(shapes[t].elements());
      for (std::size_t i = 0; i < init.size(); ++i) { init[i] = convert<param_t>(init_value(i + 1000 * t)); }
      w.push_back(std::make_unique<mirrored<param_t>>(std::move(init)));
      g.push_back(std::make_unique<mirrored<grad_t>>(std::vector<grad_t>(shapes[t].elements())));
      opt.add_tensor(tensor_name(t), w[t]->device, shapes[t], location::device);
    }
    for (int s = 1; s <= steps; ++s) {
      std::vector<grad_view<grad_t>> views;
      for (std::size_t t = 0; t < shapes.size(); ++t) {
        for (std::size_t i = 0; i < g[t]->host.size(); ++i) { g[t]->host[i] = convert<grad_t>(grad_at(t, i, s)); }
        g[t]->upload();
        views.push_back({g[t]->device, g[t]->host.size(), location::device});
      }
      rc_step(opt, views, streaming);  // (tests/row_column_rule.hpp: step() or a streaming step)
    }
    for (std::size_t t = 0; t < shapes.size(); ++t) {
      std::vector<float> params;
      for (auto const x : w[t]->download()) { params.push_back(convert<float>(x)); }
      CHECK(params == want_params[t]);
      std::vector<float> state(opt.tensor_state_size(tensor_name(t)));
      opt.copy_tensor_state(tensor_name(t), state);
      CHECK(state == want_state[t]);
    }
  }
}

TEST_CASE("with OnHost and CudaOverlapped, host and device tensors mix in one model", "[device][compositions]")
{
  auto const odd = [](std::size_t t) { return t % 2 == 1; };
  run_result const expected = reference<Bf16Mixed>(20, 2048);
  CHECK(train_on_device<ZeroOffload<Bf16Mixed>>(20, chunked<ZeroOffload<Bf16Mixed>>(2048), odd) == expected);
  scratch_dir d;
  auto o = chunked<ZeroInfinity<Bf16Mixed>>(2048);
  o.tier = in(d);
  CHECK(train_on_device<ZeroInfinity<Bf16Mixed>>(20, o, odd) == expected);
  // Fp32 params are their own master: they come device to host with the gradients.
  CHECK(train_on_device<ZeroOffload<Fp32>>(20, chunked<ZeroOffload<Fp32>>(2048), odd) == reference<Fp32>(20, 2048));
}

TEST_CASE("a device step moves the bytes its composition says, through fixed staging", "[device][stats]")
{
  std::vector<step_result> r;
  std::size_t const total = 1 + 4097 + 7 + 6144 + 30011 + 2047 + 3;  // nvme_sizes
  SECTION("ZeRO-Offload: gradients down, params up, state in place") {
    (void)train_on_device<ZeroOffload<Bf16Mixed>>(2, chunked<ZeroOffload<Bf16Mixed>>(4096), nullptr, &r);
    REQUIRE(r.size() == 2);
    CHECK(r[1].stats.d2h_bytes == total * sizeof(bf16));
    CHECK(r[1].stats.h2d_bytes == total * sizeof(bf16));
    CHECK(r[1].stats.tier_bytes_read == 0);
    CHECK(r[1].stats.chunks == (total + 4095) / 4096);
  }
  SECTION("streamed to the device: each chunk's state both ways") {
    (void)train_on_device<Streamed<Bf16Mixed>>(2, chunked<Streamed<Bf16Mixed>>(4096), nullptr, &r);
    std::size_t const chunk_bytes = 4096 * 12;
    CHECK(r[1].stats.h2d_bytes == r[1].stats.chunks * chunk_bytes);
    CHECK(r[1].stats.d2h_bytes == r[1].stats.chunks * chunk_bytes);
  }
  SECTION("the staging is (Depth + 2) chunks whatever the model") {
    mirrored<bf16> w(std::vector<bf16>(100000, bf16(0.5f)));
    ZeroOffload<Bf16Mixed, 3> a({}, chunked<ZeroOffload<Bf16Mixed, 3>>(8192));
    a.add_tensor("w", w.device, 100000, location::device);
    (void)a.state_layout();
    CHECK(a.staging_bytes() == 5 * 8192 * (sizeof(bf16) + sizeof(bf16)));
    CHECK(a.device_staging_bytes() == 0);
    Streamed<Bf16Mixed, PinnedHost, 2> b({}, chunked<Streamed<Bf16Mixed, PinnedHost, 2>>(8192));
    b.add_tensor("w", w.device, 100000, location::device);
    (void)b.state_layout();
    CHECK(b.device_staging_bytes() == 4 * 8192 * 12);
    CHECK(b.staging_bytes() == 0);
  }
}

TEMPLATE_LIST_TEST_CASE("a non-finite device gradient skips the step, with every composition",
                        "[device][nonfinite]", device_nonfinite_compositions)
{
  test_model<Bf16Mixed> m({5000, 30000});
  mirrored<bf16> a(m.params[0]), b(m.params[1]);
  auto const before = bits_of(m.params);
  TestType opt({}, chunked<TestType>(4096));
  opt.add_tensor("a", a.device, 5000, location::device);
  opt.add_tensor("b", b.device, 30000, location::device);
  m.fill_grads(1);
  m.grads[1][29999] = bf16(std::numeric_limits<float>::quiet_NaN());
  mirrored<bf16> ga(m.grads[0]), gb(m.grads[1]);
  std::vector<grad_view<bf16>> const views = {{ga.device, 5000, location::device},
                                             {gb.device, 30000, location::device}};
  auto r = opt.step(views);
  CHECK(r.found_nonfinite);
  CHECK(r.skipped);
  CHECK(opt.step_count() == 0);
  CHECK(bits_of(std::vector{a.download(), b.download()}) == before);
  gb.host[29999] = bf16(0.25f);
  gb.upload();
  r = opt.step(views);
  CHECK_FALSE(r.found_nonfinite);
  CHECK(opt.step_count() == 1);
  CHECK(bits_of(std::vector{a.download(), b.download()}) != before);
}

TEST_CASE("memory in the wrong place is refused with a reason, before anything changes", "[device][errors]")
{
  std::vector<bf16> w(10, bf16(1.0f));
  std::vector<bf16> g(10, bf16(1.0f));
  SECTION("device params need CudaOverlapped or OnDevice") {
    OffloadedOptimizer<AdamW, Bf16Mixed, PinnedHost, Synchronous> opt;
    CHECK_THROWS_WITH(opt.add_tensor("w", w.data(), 10, location::device),
                      Catch::Contains("'w'") && Catch::Contains("CudaOverlapped"));
  }
  SECTION("OnDevice needs device params and gradients") {
    Streamed<Bf16Mixed> opt;
    CHECK_THROWS_WITH(opt.add_tensor("w", w.data(), 10, location::host),
                      Catch::Contains("OnDevice") && Catch::Contains("location::device"));
    mirrored<bf16> dw(w);
    opt.add_tensor("w", dw.device, 10, location::device);
    grad_view<bf16> const host_grad{g.data(), 10, location::host};
    CHECK_THROWS_WITH(opt.step({&host_grad, 1}), Catch::Contains("'w'") && Catch::Contains("on the host"));
    CHECK(opt.step_count() == 0);
  }
  SECTION("the delayed update runs on the host") {
    Streamed<Bf16Mixed>::options o;
    o.delayed_update = true;
    CHECK_THROWS_WITH(Streamed<Bf16Mixed>({}, o), Catch::Contains("delayed_update") && Catch::Contains("OnHost"));
  }
  SECTION("a host composition refuses device gradients") {
    OffloadedOptimizer<AdamW, Bf16Mixed, PinnedHost, Synchronous> opt;
    opt.add_tensor("w", w.data(), 10);
    grad_view<bf16> const device_grad{g.data(), 10, location::device};
    CHECK_THROWS_WITH(opt.step({&device_grad, 1}), Catch::Contains("on the device"));
  }
}

TEST_CASE("checkpoints move between the device tier and the host tiers", "[device][checkpoint]")
{
  scratch_dir d;
  auto const file = d.path / "state.ckpt";
  // 20 steps on the device, saved; loaded into ZeRO-Infinity and into the device tier
  // again, 20 more steps each: both equal to 40 steps of the reference.
  run_result const expected = reference<Bf16Mixed>(40, 2048);
  auto train_from = [&]<class Opt>(Opt& opt, device_model<Bf16Mixed>& m, int from, int to) {
    for (int t = from; t <= to; ++t) {
      opt.set_hyperparameters(0, schedule<Opt>(t));
      opt.step(m.views(t));
    }
  };
  auto setup = [&]<class Opt>(Opt& opt, device_model<Bf16Mixed>& m) {
    m.register_in(opt);
    typename Opt::hyperparameters h;
    h.lr           = 3e-3;
    h.betas        = {0.8, 0.99};
    h.weight_decay = 0.0;
    opt.add_group(h, {"t1", "t4"});
  };
  {
    device_model<Bf16Mixed> m;
    DeviceResident<Bf16Mixed> opt(schedule<DeviceResident<Bf16Mixed>>(1), chunked<DeviceResident<Bf16Mixed>>(2048));
    setup(opt, m);
    train_from(opt, m, 1, 20);
    opt.save(file);
  }
  {
    device_model<Bf16Mixed> m;  // params as at step 0: load writes them from the master
    auto o = chunked<ZeroInfinity<Bf16Mixed>>(2048);
    o.tier = in(d);
    ZeroInfinity<Bf16Mixed> opt(schedule<ZeroInfinity<Bf16Mixed>>(1), o);
    setup(opt, m);
    opt.load(file);
    CHECK(opt.step_count() == 20);
    train_from(opt, m, 21, 40);
    CHECK(snapshot(opt, m.downloaded()) == expected);
  }
  {
    device_model<Bf16Mixed> m;
    DeviceResident<Bf16Mixed> opt(schedule<DeviceResident<Bf16Mixed>>(1), chunked<DeviceResident<Bf16Mixed>>(2048));
    setup(opt, m);
    opt.load(file);
    train_from(opt, m, 21, 40);
    CHECK(snapshot(opt, m.downloaded()) == expected);
  }
}

/// A device composition with its state on NVMe with planted faults, one step taken.
template <class Opt>
struct faulty_device_run {
  scratch_dir d;
  std::shared_ptr<io::fault_plan> faults = std::make_shared<io::fault_plan>();
  device_model<Bf16Mixed> m{{50000}};
  std::unique_ptr<Opt> opt;
  faulty_device_run()
  {
    auto o           = chunked<Opt>(2048);
    o.tier           = in(d);
    o.tier.io.faults = faults;
    opt              = std::make_unique<Opt>(typename Opt::hyperparameters{}, o);
    m.register_in(*opt);
    opt->step(m.views(1));
  }
};

TEMPLATE_LIST_TEST_CASE("an I/O error in a device step throws, and the optimizer refuses to go on",
                        "[device][errors]", device_nvme_compositions)
{
  faulty_device_run<TestType> run;
  run.faults->fail(io::op::write, run.faults->seen(io::op::write) + 10, EIO);
  CHECK_THROWS_AS(run.opt->step(run.m.views(2)), io_error);
  CHECK(run.opt->state_lost());
  CHECK_THROWS_AS(run.opt->step(run.m.views(3)), state_lost);
}

TEMPLATE_LIST_TEST_CASE("a failed first read of a device step changes nothing, and it can be retried",
                        "[device][errors]", device_nvme_compositions)
{
  faulty_device_run<TestType> run;
  auto const before = bits_of(run.m.downloaded().params);
  run.faults->fail(io::op::read, run.faults->seen(io::op::read) + 1, EIO);
  CHECK_THROWS_AS(run.opt->step(run.m.views(2)), io_error);
  CHECK_FALSE(run.opt->state_lost());
  CHECK(run.opt->step_count() == 1);
  CHECK(bits_of(run.m.downloaded().params) == before);
  run.opt->step(run.m.views(2));
  CHECK(run.opt->step_count() == 2);
}

TEMPLATE_TEST_CASE("offloaded params in device buffers, device gradients kept beside them: CudaOverlapped gives the "
                   "bits of params in device memory",
                   "[device][offload]", PinnedHost, NvmeFile)
{
  // The trainer's weights rest in a host tier (PinnedHost: copied up from it; NvmeFile:
  // through pinned staging) and come into device buffers a window at a time, small tensors
  // (resident) into device copies of their own. Each layer's gradients are made in one
  // device buffer, on the trainer's own stream, handed over (copied down on that stream,
  // kept beside the weights) and the buffer reused at once. The reference keeps its params
  // in device memory. All device memory is read and written through copies, so that this
  // runs on a GPU as it does on the emulated device.
  using Opt = OffloadedOptimizer<AdamW, Bf16Mixed, PinnedHost, CudaOverlapped<2>>;
  using W   = offloaded_params<bf16, TestType>;
  std::vector<std::vector<std::size_t>> const layers = {{4097, 7, 63}, {1}, {2048, 2049}, {30011}, {5, 3}};
  scratch_dir dir;
  typename W::options wo;
  if constexpr (std::is_same_v<TestType, NvmeFile>) { wo.tier = in(dir); }
  wo.window                = 2;
  wo.where                 = location::device;
  wo.persistence_threshold = 64;
  W w(wo);
  typename Opt::options o;
  o.chunk_elements = 2048;
  o.threads        = 2;
  o.max_grad_norm  = 0.5;
  Opt ref({}, o), off({}, o);
  std::vector<std::size_t> sizes;
  std::size_t largest = 0;
  for (std::size_t l = 0; l < layers.size(); ++l) {
    auto const id = w.add_layer(std::string("layer").append(std::to_string(l)));
    for (auto const n : layers[l]) {
      w.add_tensor(id, std::string("t").append(std::to_string(sizes.size())), n);
      sizes.push_back(n);
    }
    largest = std::max(largest, std::accumulate(layers[l].begin(), layers[l].end(), std::size_t{0}));
  }
  auto const gradient = [](std::vector<bf16> const& p, std::size_t t, int step) {
    std::vector<bf16> g(p.size());
    for (std::size_t i = 0; i < p.size(); ++i) {
      g[i] = bf16(std::sin(static_cast<float>(p[i]) * 3.0f + static_cast<float>(i % 97) * 0.01f +
                           static_cast<float>(t + static_cast<std::size_t>(step))) * 0.1f);
    }
    return g;
  };
  std::vector<std::unique_ptr<mirrored<bf16>>> ref_params, ref_grads;
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    std::vector<bf16> init(sizes[t]);
    for (std::size_t i = 0; i < sizes[t]; ++i) { init[i] = bf16(static_cast<float>((t * 37 + i * 11) % 2000) * 1e-3f - 1.0f); }
    ref_params.push_back(std::make_unique<mirrored<bf16>>(init));
    ref_grads.push_back(std::make_unique<mirrored<bf16>>(std::vector<bf16>(sizes[t])));
    ref.add_tensor(std::string("t").append(std::to_string(t)), ref_params[t]->device, sizes[t], location::device);
    w.write(t, 0, init);
    off.add_tensor(w, t);
    CHECK(off.keeps_gradient(t));
  }
  mirrored<bf16> layer_grads{std::vector<bf16>(largest)};  // the trainer's one gradient buffer
  device::stream made;                                     // and its stream
  std::size_t const slow_bytes = std::size_t{16} << 20;    // work that keeps it busy
  void* const slow = device::allocate_async(slow_bytes, made);
  std::vector<std::vector<bf16>> seen(sizes.size());       // what forward read from each view
  std::vector<std::vector<bf16>> up(sizes.size());         // what backward sends up (until the step ends)
  std::vector<bf16> const poison(largest, bf16(std::numeric_limits<float>::quiet_NaN()));
  for (int step = 0; step < 4; ++step) {
    // Forward: each view read on `made` behind slow work, and released at once with it: a
    // buffer (or resident copy) is refilled only once that read is done.
    for (std::size_t l = 0, t = 0; l < layers.size(); ++l) {
      auto const v = w.acquire(l);
      for (std::size_t i = 0; i < v.size(); ++i, ++t) {
        seen[t].resize(sizes[t]);
        device::zero_async(slow, slow_bytes, made);
        device::copy_async(seen[t].data(), v.tensor(i).data(), sizes[t] * sizeof(bf16), made);
      }
      w.release(l, made);
    }
    made.synchronize();
    std::vector<grad_view<bf16>> rv;
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      REQUIRE(std::memcmp(seen[t].data(), ref_params[t]->download().data(), sizes[t] * sizeof(bf16)) == 0);
      ref_grads[t]->host = gradient(ref_params[t]->download(), t, step);
      ref_grads[t]->upload();
      rv.push_back({ref_grads[t]->device, sizes[t], location::device});
    }
    auto const r = ref.step(rv);
    REQUIRE(!r.skipped);
    off.begin_step();
    for (std::size_t l = layers.size(), t = sizes.size(); l-- > 0;) {
      auto const v = w.acquire(l);
      t -= v.size();
      for (std::size_t i = 0, at = 0; i < v.size(); at += sizes[t + i], ++i) {
        std::vector<bf16> p(sizes[t + i]);
        device::copy(p.data(), v.tensor(i).data(), p.size() * sizeof(bf16));  // (a device pointer, resident or not)
        up[t + i] = gradient(p, t + i, step);
        device::zero_async(slow, slow_bytes, made);  // (grad_ready does not wait for it)
        device::copy_async(layer_grads.device + at, up[t + i].data(), p.size() * sizeof(bf16), made);
        off.grad_ready(t + i, {layer_grads.device + at, sizes[t + i], location::device}, made);
      }
      w.release(l, made);
      device::copy_async(layer_grads.device, poison.data(), largest * sizeof(bf16), made);  // reused at once: poisoned
    }
    auto const k = off.finish_step();
    REQUIRE(!k.skipped);
    CHECK(k.grad_norm == r.grad_norm);
    w.end_iteration();
  }
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    std::vector<bf16> b(sizes[t]);
    w.read(t, 0, b);
    REQUIRE(std::memcmp(ref_params[t]->download().data(), b.data(), b.size() * sizeof(bf16)) == 0);
  }
  auto const st = w.stats();
  CHECK(st.grad_bytes_written > 0);
  CHECK(st.grad_bytes_read == st.grad_bytes_written);
  CHECK(st.on_demand <= 2);
  CHECK(dir.entries().empty());  // (nothing left behind)
  device::deallocate_async(slow, made);
  made.synchronize();
}

#endif  // !TIERSTATE_TEST_DEVICE_KERNEL_ONLY
