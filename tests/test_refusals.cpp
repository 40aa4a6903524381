// SPDX-License-Identifier: Apache-2.0
// A refused call leaves no trace. For every call that can be refused (load, save,
// copy_state, write_state, step, add_tensor, add_group, set_hyperparameters, set_step_count,
// begin_step / grad_ready / finish_step), on a fresh optimizer and on one mid-training, in
// every composition below: two twins are built alike, the call is refused on one of them
// only, and from then on the twins must be indistinguishable: the same params, the same step
// count, tensors still accepted where they were (the state not yet made), the same result of
// the next steps, the same state after them, bit for bit.
//
// One executable: the host compositions, and where Thrust is (built with its CPP backend)
// the device compositions on the emulated device as well. The compositions are the matrix's
// (matrix.hpp, device_matrix.hpp).
#include "matrix.hpp"
#include "nvme_support.hpp"

#if defined(THRUST_DEVICE_SYSTEM)
#include "device_matrix.hpp"
#endif

#include <catch2/catch.hpp>

#include <cmath>
#include <fstream>
#include <functional>
#include <limits>
#include <string>
#include <vector>

using namespace tierstate;
using namespace tierstate::test;

namespace {

std::vector<std::size_t> const sizes = {1, 4097, 7, 6144, 2047, 3};

template <class Opt>
constexpr bool device_params_v = Opt::takes_device_params;

/// A tensor's memory: host, or device memory with a host copy.
template <class T>
struct tensor_memory {
  std::vector<T> host;
  T* device = nullptr;
  tensor_memory(std::vector<T> v, bool on_device) : host(std::move(v))
  {
    if (on_device) {
      device = static_cast<T*>(device::allocate_async(std::max<std::size_t>(host.size(), 1) * sizeof(T), {}));
      device::stream_view{}.synchronize();
      device::copy(device, host.data(), host.size() * sizeof(T));
    }
  }
  ~tensor_memory()
  {
    if (device != nullptr) { device::deallocate_async(device, {}); }
  }
  tensor_memory(tensor_memory const&)            = delete;
  tensor_memory& operator=(tensor_memory const&) = delete;
  T* data() { return device != nullptr ? device : host.data(); }
  [[nodiscard]] location where() const { return device != nullptr ? location::device : location::host; }
  std::vector<T> const& read()
  {
    if (device != nullptr) { device::copy(host.data(), device, host.size() * sizeof(T)); }
    return host;
  }
  void write(std::vector<T> const& v)
  {
    host = v;
    if (device != nullptr) { device::copy(device, host.data(), host.size() * sizeof(T)); }
  }
};

/// One optimizer, its params and its gradients, in the places its composition wants them.
template <class Opt>
struct subject {
  using P      = typename Opt::precision_type;
  using param  = typename P::param_type;
  using grad_t = typename P::grad_type;
  static constexpr bool on_device = device_params_v<Opt>;
  std::vector<std::unique_ptr<tensor_memory<param>>> params;
  std::vector<std::unique_ptr<tensor_memory<grad_t>>> grads;
  Opt opt;

  explicit subject(typename Opt::options const& o) : opt(schedule<Opt>(1), o)
  {
    test_model<P> m(sizes);
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      params.push_back(std::make_unique<tensor_memory<param>>(m.params[k], on_device));
      grads.push_back(std::make_unique<tensor_memory<grad_t>>(m.grads[k], on_device));
      opt.add_tensor(tensor_name(k), params[k]->data(), sizes[k], params[k]->where());
    }
    typename Opt::hyperparameters h;
    h.lr    = 3e-3;
    h.betas = {0.8, 0.99};
    opt.add_group(h, {"t1", "t4"});
  }
  /// One more tensor: allowed while the state is not made.
  void add_extra()
  {
    params.push_back(std::make_unique<tensor_memory<param>>(std::vector<param>(5, convert<param>(0.5f)), on_device));
    grads.push_back(std::make_unique<tensor_memory<grad_t>>(std::vector<grad_t>(5), on_device));
    opt.add_tensor("extra", params.back()->data(), 5, params.back()->where());
  }
  void fill(int t)
  {
    std::size_t base = 0;
    for (auto& g : grads) {
      std::vector<grad_t> v(g->host.size());
      for (std::size_t i = 0; i < v.size(); ++i) { v[i] = convert<grad_t>(grad_value(base + i, static_cast<std::uint64_t>(t))); }
      g->write(v);
      base += v.size();
    }
  }
  std::vector<grad_view<grad_t>> views()
  {
    std::vector<grad_view<grad_t>> v;
    for (auto& g : grads) { v.push_back({g->data(), g->host.size(), g->where()}); }
    return v;
  }
  step_result step(int t)
  {
    fill(t);
    opt.set_hyperparameters(0, schedule<Opt>(t));
    auto const v = views();
    return opt.step(v);
  }
  std::vector<std::vector<std::uint32_t>> param_bits()
  {
    std::vector<std::vector<std::uint32_t>> out;
    for (auto& p : params) {
      out.emplace_back();
      for (auto const& x : p->read()) { out.back().push_back(bits(x)); }
    }
    return out;
  }
  /// Every slot of every tensor (makes the state, if it is not made).
  std::vector<std::vector<float>> state()
  {
    std::vector<std::vector<float>> out;
    for (slot const s : opt.state_layout().slots()) {
      for (std::size_t k = 0; k < params.size(); ++k) {
        out.emplace_back(params[k]->host.size());
        opt.copy_state(k < sizes.size() ? tensor_name(k) : std::string("extra"), s, std::span<float>(out.back()));
      }
    }
    return out;
  }
};

bool same_bits(std::vector<std::vector<float>> const& a, std::vector<std::vector<float>> const& b)
{
  if (a.size() != b.size()) { return false; }
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i].size() != b[i].size()) { return false; }
    for (std::size_t j = 0; j < a[i].size(); ++j) {
      if (std::bit_cast<std::uint32_t>(a[i][j]) != std::bit_cast<std::uint32_t>(b[i][j])) { return false; }
    }
  }
  return true;
}

/// The twins are indistinguishable: now, after what a fresh optimizer may still do, and
/// after two more steps.
template <class Opt>
void check_twins(subject<Opt>& a, subject<Opt>& b, bool fresh, int next_step)
{
  CHECK(a.opt.step_count() == b.opt.step_count());
  CHECK(a.opt.state_lost() == b.opt.state_lost());
  CHECK(a.opt.group_count() == b.opt.group_count());
  CHECK(a.param_bits() == b.param_bits());
  if (fresh) {
    // The state is still not made: a tensor can still be added to both.
    CHECK_NOTHROW(a.add_extra());
    CHECK_NOTHROW(b.add_extra());
  } else {
    CHECK(same_bits(a.state(), b.state()));
  }
  for (int t = next_step; t < next_step + 2; ++t) {
    step_result const ra = a.step(t);
    step_result const rb = b.step(t);
    CHECK(ra.step == rb.step);
    CHECK(ra.skipped == rb.skipped);
    CHECK(ra.found_nonfinite == rb.found_nonfinite);
  }
  CHECK(a.param_bits() == b.param_bits());
  CHECK(same_bits(a.state(), b.state()));
}

/// A refusal: what is called, and the exception it must throw.
template <class Opt>
struct refusal {
  std::string what;
  std::function<void(subject<Opt>&)> call;
  std::function<bool(std::exception const&)> expected;
};

template <class E>
std::function<bool(std::exception const&)> is()
{
  return [](std::exception const& e) { return dynamic_cast<E const*>(&e) != nullptr; };
}

template <class Opt>
std::vector<refusal<Opt>> refusals(scratch_dir const& d)
{
  using S     = subject<Opt>;
  using H     = typename Opt::hyperparameters;
  using grad_t = typename S::grad_t;
  auto const dir = d.path;
  std::vector<refusal<Opt>> r;
  // Checkpoints.
  r.push_back({"load of a missing file", [dir](S& s) { s.opt.load(dir / "missing"); }, is<io_error>()});
  r.push_back({"load of 8 KiB that is no checkpoint", [dir](S& s) { s.opt.load(dir / "garbage"); }, is<checkpoint_error>()});
  r.push_back({"load of another model's checkpoint", [dir](S& s) { s.opt.load(dir / "other"); }, is<checkpoint_error>()});
  r.push_back({"load of a checkpoint with a flipped bit", [dir](S& s) { s.opt.load(dir / "flipped"); }, is<checkpoint_error>()});
  r.push_back({"load of a directory", [dir](S& s) { s.opt.load(dir); }, is<checkpoint_error>()});
  r.push_back({"load of a FIFO", [dir](S& s) { s.opt.load(dir / "fifo"); }, is<checkpoint_error>()});
  r.push_back({"save into a missing directory", [dir](S& s) { s.opt.save(dir / "no" / "c"); }, is<io_error>()});
  r.push_back({"save over a directory", [dir](S& s) { s.opt.save(dir / "sub"); }, is<logic_error>()});
  r.push_back({"save with a bad engine option", [dir](S& s) {
                 checkpoint_options o;
                 o.io.emplace();
                 o.io->queue_depth = 0;
                 s.opt.save(dir / "c2", o);
               }, is<invalid_option>()});
  // State access.
  r.push_back({"copy_state of an unknown tensor", [](S& s) {
                 std::vector<float> v(7);
                 s.opt.copy_state("nope", slot::exp_avg, v);
               }, is<logic_error>()});
  r.push_back({"copy_state into a span of the wrong size", [](S& s) {
                 std::vector<float> v(6);
                 s.opt.copy_state("t2", slot::exp_avg, v);
               }, is<logic_error>()});
  r.push_back({"copy_state of a slot the rule does not keep", [](S& s) {
                 std::vector<float> v(7);
                 s.opt.copy_state("t2", slot::max_exp_avg_sq, v);
               }, is<logic_error>()});
  r.push_back({"write_state from a span of the wrong size", [](S& s) {
                 std::vector<float> v(8, 1.0f);
                 s.opt.write_state("t2", slot::exp_avg, v);
               }, is<logic_error>()});
  r.push_back({"write_state of an unknown tensor", [](S& s) {
                 std::vector<float> v(7, 1.0f);
                 s.opt.write_state("nope", slot::exp_avg_sq, v);
               }, is<logic_error>()});
  // Steps.
  r.push_back({"step with a gradient missing", [](S& s) {
                 auto v = s.views();
                 v.pop_back();
                 s.opt.step(v);
               }, is<logic_error>()});
  r.push_back({"step with a gradient of the wrong size", [](S& s) {
                 auto v = s.views();
                 v[2].size -= 1;
                 s.opt.step(v);
               }, is<logic_error>()});
  r.push_back({"step with a null gradient of non-zero size", [](S& s) {
                 auto v = s.views();
                 v[3].data = nullptr;
                 s.opt.step(v);
               }, is<logic_error>()});
  r.push_back({"step with grad_scale 0", [](S& s) {
                 auto const v = s.views();
                 s.opt.step(v, 0.0);
               }, is<invalid_option>()});
  r.push_back({"step with grad_scale NaN", [](S& s) {
                 auto const v = s.views();
                 s.opt.step(v, std::numeric_limits<double>::quiet_NaN());
               }, is<invalid_option>()});
  // Registration and groups.
  r.push_back({"add_tensor with a name taken", [](S& s) {
                 s.opt.add_tensor("t3", s.params[3]->data(), sizes[3], s.params[3]->where());
               }, is<logic_error>()});
  r.push_back({"add_tensor of a null pointer", [](S& s) {
                 s.opt.add_tensor("null", nullptr, 3, S::on_device ? location::device : location::host);
               }, is<logic_error>()});
  r.push_back({"add_group naming no tensor", [](S& s) { s.opt.add_group(H{}, {}); }, is<logic_error>()});
  r.push_back({"add_group naming an unknown tensor", [](S& s) { s.opt.add_group(H{}, {"t0", "nope"}); }, is<logic_error>()});
  r.push_back({"add_group naming a tensor twice", [](S& s) { s.opt.add_group(H{}, {"t0", "t2", "t0"}); }, is<logic_error>()});
  r.push_back({"add_group of a tensor in a group", [](S& s) { s.opt.add_group(H{}, {"t0", "t4"}); }, is<logic_error>()});
  r.push_back({"add_group with a negative lr", [](S& s) {
                 H h;
                 h.lr = -1;
                 s.opt.add_group(h, {"t0"});
               }, is<invalid_option>()});
  r.push_back({"set_hyperparameters of no group", [](S& s) { s.opt.set_hyperparameters(7, H{}); }, is<logic_error>()});
  r.push_back({"set_hyperparameters with beta1 = 1", [](S& s) {
                 H h;
                 h.betas = {1.0, 0.999};
                 s.opt.set_hyperparameters(1, h);
               }, is<invalid_option>()});
  r.push_back({"set_step_count(-1)", [](S& s) { s.opt.set_step_count(-1); }, is<invalid_option>()});
  r.push_back({"set_step_count(t0, 2^53 + 1)", [](S& s) { s.opt.set_step_count("t0", (std::int64_t{1} << 53) + 1); },
               is<invalid_option>()});
  r.push_back({"set_step_count of no tensor", [](S& s) { s.opt.set_step_count("nope", 3); }, is<logic_error>()});
  // Streaming steps.
  r.push_back({"begin_step with micro_batches 0", [](S& s) { s.opt.begin_step(1.0, 0); }, is<invalid_option>()});
  r.push_back({"begin_step with grad_scale -1", [](S& s) { s.opt.begin_step(-1.0, 1); }, is<invalid_option>()});
  r.push_back({"finish_step without begin_step", [](S& s) { (void)s.opt.finish_step(); }, is<logic_error>()});
  r.push_back({"grad_ready without begin_step", [](S& s) {
                 auto const v = s.views();
                 s.opt.grad_ready(0, v[0]);
               }, is<logic_error>()});
  (void)sizeof(grad_t);
  return r;
}

/// Files the refusals need: garbage, another model's checkpoint, a flipped one, a FIFO, a
/// directory.
template <class Opt>
void make_files(scratch_dir const& d, typename Opt::options const& o)
{
  {
    std::ofstream f(d.path / "garbage", std::ios::binary);
    std::string junk(8192, 'x');
    f.write(junk.data(), static_cast<std::streamsize>(junk.size()));
  }
  {
    subject<Opt> other(o);
    other.add_extra();  // one tensor more: another model
    other.step(1);
    other.opt.save(d.path / "other");
  }
  {
    subject<Opt> same(o);
    same.step(1);
    same.opt.save(d.path / "flipped");
    std::fstream f(d.path / "flipped", std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(4096 + 100);
    char c = 0;
    f.get(c);
    f.seekp(4096 + 100);
    f.put(static_cast<char>(c ^ 0x10));
  }
  REQUIRE(::mkfifo((d.path / "fifo").c_str(), 0600) == 0);
  std::filesystem::create_directory(d.path / "sub");
}

template <class Opt>
void every_refusal_leaves_no_trace(typename Opt::options o, scratch_dir const& files)
{
  make_files<Opt>(files, o);
  auto const cases = refusals<Opt>(files);
  for (bool const fresh : {true, false}) {
    for (auto const& c : cases) {
      INFO((fresh ? "fresh optimizer: " : "mid-training: ") << c.what);
      subject<Opt> a(o), b(o);
      int next = 1;
      if (!fresh) {
        for (; next <= 3; ++next) {
          a.step(next);
          b.step(next);
        }
      }
      a.fill(next);  // the refused call sees the gradients the next step will use
      b.fill(next);
      bool refused = false;
      try {
        c.call(a);
      } catch (std::exception const& e) {
        refused = true;
        INFO("threw: " << e.what());
        CHECK(c.expected(e));
      }
      CHECK(refused);
      check_twins(a, b, fresh, next);
    }
  }
  // Refusals inside a streaming step: the step then goes on as if they had not happened.
  for (bool const fresh : {true, false}) {
    INFO((fresh ? "fresh optimizer" : "mid-training") << ", refusals inside a streaming step");
    subject<Opt> a(o), b(o);
    int next = 1;
    if (!fresh) {
      for (; next <= 2; ++next) {
        a.step(next);
        b.step(next);
      }
    }
    for (auto* s : {&a, &b}) {
      s->fill(next);
      s->opt.set_hyperparameters(0, schedule<Opt>(next));
      s->opt.begin_step();
    }
    auto const va = a.views();
    auto const vb = b.views();
    a.opt.grad_ready(1, va[1]);
    b.opt.grad_ready(1, vb[1]);
    auto bad = va[2];
    bad.size += 1;
    CHECK_THROWS_AS(a.opt.grad_ready(2, bad), logic_error);              // the wrong size
    CHECK_THROWS_AS(a.opt.grad_ready(sizes.size(), va[0]), logic_error);  // no such tensor
    CHECK_THROWS_AS(a.opt.grad_ready(1, va[1]), logic_error);            // handed over twice
    CHECK_THROWS_AS(a.opt.step(va), logic_error);
    CHECK_THROWS_AS(a.opt.save(files.path / "during"), logic_error);
    CHECK_THROWS_AS(a.opt.load(files.path / "flipped"), logic_error);
    CHECK_THROWS_AS(a.opt.set_hyperparameters(0, schedule<Opt>(1)), logic_error);
    CHECK_THROWS_AS(a.opt.begin_step(), logic_error);
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      if (t == 1) { continue; }
      a.opt.grad_ready(t, va[t]);
      b.opt.grad_ready(t, vb[t]);
    }
    step_result const ra = a.opt.finish_step();
    step_result const rb = b.opt.finish_step();
    CHECK(ra.step == rb.step);
    CHECK(ra.skipped == rb.skipped);
    CHECK(a.param_bits() == b.param_bits());
    CHECK(same_bits(a.state(), b.state()));
    CHECK_FALSE(std::filesystem::exists(files.path / "during"));
  }
}

template <class Opt>
typename Opt::options options_for(scratch_dir const& d)
{
  typename Opt::options o;
  o.chunk_elements = 2048;
  o.threads        = 2;
  if constexpr (std::is_same_v<typename Opt::tier_type, NvmeFile>) { o.tier = in(d); }
  return o;
}

}  // namespace

TEMPLATE_LIST_TEST_CASE("a refused call leaves the optimizer as its twin: host compositions", "[refusals]",
                        matrix::host_compositions)
{
  scratch_dir state, files;
  every_refusal_leaves_no_trace<TestType>(options_for<TestType>(state), files);
  CHECK(state.entries().empty());  // the scratch files are nameless
}

TEST_CASE("a refused call leaves the optimizer as its twin: the delayed update", "[refusals]")
{
  using Opt = OffloadedOptimizer<AdamW, Bf16Mixed, PinnedHost, Synchronous>;
  scratch_dir state, files;
  auto o           = options_for<Opt>(state);
  o.delayed_update = true;
  make_files<Opt>(files, options_for<Opt>(state));
  auto const cases = refusals<Opt>(files);
  for (auto const& c : cases) {
    if (c.what.find("begin_step") != std::string::npos || c.what.find("grad_ready") != std::string::npos ||
        c.what.find("finish_step") != std::string::npos) {
      continue;  // streaming steps are refused with delayed_update anyway
    }
    INFO("delayed update in flight: " << c.what);
    subject<Opt> a(o), b(o);
    for (int t = 1; t <= 3; ++t) {
      a.step(t);
      b.step(t);
    }
    a.fill(4);
    b.fill(4);
    try {
      c.call(a);
      FAIL("not refused");
    } catch (std::exception const& e) {
      INFO("threw: " << e.what());
      CHECK(c.expected(e));
    }
    // save, load, copy_state and write_state bring the model up to date before they check
    // anything (documented): the twin does the same.
    a.opt.flush();
    b.opt.flush();
    check_twins(a, b, false, 4);
  }
}

#if defined(THRUST_DEVICE_SYSTEM)
TEMPLATE_LIST_TEST_CASE("a refused call leaves the optimizer as its twin: device compositions", "[refusals][device]",
                        matrix::device_compositions)
{
  scratch_dir state, files;
  every_refusal_leaves_no_trace<TestType>(options_for<TestType>(state), files);
  CHECK(state.entries().empty());
}
#endif
