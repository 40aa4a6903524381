// SPDX-License-Identifier: Apache-2.0
// host_step: the host kernel's speed against its memory roofline, measured in one process.
//
// For each rule x precision it times, interleaved and on the same arrays and threads:
//   step     tierstate::host::update (xsimd);
//   plain    the straightforward scalar loop of the same rule and precision over
//            __restrict pointers, as a user would write it;
//   pattern  the step's exact memory traffic (same arrays, same reads, same in-place
//            writes) with no arithmetic beyond an add: the roofline.
// It prints one JSON line per rule x precision with the medians; roofline_ratio is
// step / pattern. A last line per precision ("variant":"optimizer") times the whole
// OffloadedOptimizer<AdamW>::step() over a model-like set of tensors the same way. Usage: host_step [--elements N] [--reps R] [--threads T]
//                                  [--rule NAME] [--precision p/g/m/s]
#include <tierstate/tierstate.hpp>

#include <algorithm>
#include <atomic>
#include <array>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

namespace {

using namespace tierstate;
using clock_type = std::chrono::steady_clock;

struct options {
  std::size_t elements = std::size_t{1} << 25;
  int reps             = 9;
  std::size_t threads  = 0;
  std::string rule;
  std::string precision;
};

constexpr char const* usage_text =
  "usage: host_step [--elements N >= 1] [--reps R (1..10000)] [--threads T (0..4096)] "
  "[--rule adam|adamw|adam_amsgrad|adamw_amsgrad] [--precision PARAM/GRAD/MASTER/STATE] [--help]\n";

[[noreturn]] void usage_error(std::string const& what)
{
  std::fprintf(stderr, "host_step: %s\n%s", what.c_str(), usage_text);
  std::exit(2);
}

options parse(int argc, char** argv)
{
  options o;
  // A decimal integer in [lo, hi]: digits only, nothing after them, no overflow.
  auto number = [&](int& i, char const* flag, unsigned long long lo, unsigned long long hi) -> unsigned long long {
    if (i + 1 >= argc) { usage_error(std::string(flag) + " needs a value"); }
    std::string const text = argv[++i];
    unsigned long long v   = 0;
    auto const [end, ec]   = std::from_chars(text.data(), text.data() + text.size(), v);
    std::string const range = std::to_string(lo) + ".." + std::to_string(hi);
    if (text.empty() || (ec != std::errc{} && ec != std::errc::result_out_of_range) || end != text.data() + text.size()) {
      usage_error(std::string(flag) + " " + (text.empty() ? "\"\"" : text) + ": not a non-negative integer");
    }
    if (ec == std::errc::result_out_of_range || v < lo || v > hi) {
      usage_error(std::string(flag) + " " + text + ": out of range (" + range + ")");
    }
    return v;
  };
  for (int i = 1; i < argc; ++i) {
    std::string const a = argv[i];
    if (a == "--help" || a == "-h") {
      std::printf("%s", usage_text);
      std::exit(0);
    } else if (a == "--elements") {
      o.elements = number(i, "--elements", 1, std::size_t{1} << 40);
    } else if (a == "--reps") {
      o.reps = static_cast<int>(number(i, "--reps", 1, 10000));
    } else if (a == "--threads") {
      o.threads = number(i, "--threads", 0, 4096);
    } else if (a == "--rule" && i + 1 < argc) {
      o.rule = argv[++i];
    } else if (a == "--precision" && i + 1 < argc) {
      o.precision = argv[++i];
    } else {
      usage_error("unknown or incomplete argument " + a);
    }
  }
  return o;
}

template <class T>
struct buffer {
  std::unique_ptr<T[]> data;
  explicit buffer(std::size_t n) : data(new T[n]) {}
  T* get() const { return data.get(); }
};

double seconds_since(clock_type::time_point t0)
{
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

double median(std::vector<double> v)
{
  std::sort(v.begin(), v.end());
  std::size_t const m = v.size() / 2;
  return v.size() % 2 ? v[m] : (v[m - 1] + v[m]) / 2;
}

/// Runs each of three loops once to warm up, then `reps` times interleaved, rotating the
/// order every repetition; returns the median seconds of each.
template <class A, class B, class C>
std::array<double, 3> interleaved_medians(int reps, A&& a, B&& b, C&& c)
{
  a();
  b();
  c();
  std::array<std::vector<double>, 3> t;
  for (int r = 0; r < reps; ++r) {
    for (int k = 0; k < 3; ++k) {
      int const which = (r + k) % 3;
      auto const t0   = clock_type::now();
      if (which == 0) {
        a();
      } else if (which == 1) {
        b();
      } else {
        c();
      }
      t[which].push_back(seconds_since(t0));
    }
  }
  return {median(t[0]), median(t[1]), median(t[2])};
}

/// The storage type as raw bits for the pattern loop: 16-bit types are added as integers.
template <class T>
using raw_t = std::conditional_t<std::is_same_v<T, float>, float, std::uint16_t>;

/// The arrays of one precision, sized for the rule with the most slots.
template <class P>
struct arrays {
  using param_t = typename P::param_type;
  using grad_t  = typename P::grad_type;
  using state_t = typename P::state_type;
  static constexpr std::size_t max_slots = 3;

  std::size_t n;
  buffer<param_t> param;
  buffer<grad_t> grad;
  buffer<float> master;
  std::vector<buffer<state_t>> state;

  explicit arrays(std::size_t size, thread_pool& pool)
    : n(size), param(size), grad(size), master(P::has_master ? size : 1)
  {
    for (std::size_t j = 0; j < max_slots; ++j) { state.emplace_back(size); }
    // First touch from the threads that will use each part.
    pool.parallel_for(n, 4096, [&](std::size_t b, std::size_t e) {
      for (std::size_t i = b; i < e; ++i) {
        float const w = 0.5f + static_cast<float>(i % 1000) * 1e-4f;
        param.get()[i] = convert<param_t>(w);
        grad.get()[i] = convert<grad_t>(static_cast<float>(static_cast<int>(i % 201) - 100) * 1e-4f);
        if constexpr (P::has_master) { master.get()[i] = w; }
        for (auto& s : state) { s.get()[i] = convert<state_t>(i % 2 ? 1e-4f : 2e-4f); }
      }
    });
  }

  template <class R>
  update_arrays<P, R::slot_count> view()
  {
    update_arrays<P, R::slot_count> a;
    a.param  = param.get();
    a.grad   = grad.get();
    a.master = P::has_master ? master.get() : nullptr;
    for (std::size_t j = 0; j < R::slot_count; ++j) { a.state[j] = state[j].get(); }
    return a;
  }
};

/// The straightforward scalar loop: torch's formula, one element at a time, in float.
template <class R, class P>
void plain_step(typename P::param_type* __restrict param, typename P::grad_type const* __restrict grad,
                float* __restrict master, typename P::state_type* __restrict m,
                typename P::state_type* __restrict v, typename P::state_type* __restrict vmax,
                std::size_t b, std::size_t e, float inv_scale, float lr, float wd, float beta1,
                float beta2, float eps, float step_size, float bc2_sqrt)
{
  using state_t = typename P::state_type;
  for (std::size_t i = b; i < e; ++i) {
    float w = P::has_master ? master[i] : convert<float>(param[i]);
    float g = convert<float>(grad[i]) * inv_scale;
    if constexpr (R::decay_mode == weight_decay_mode::l2) {
      g += wd * w;
    } else {
      w *= 1.0f - lr * wd;
    }
    float mi = convert<float>(m[i]);
    float vi = convert<float>(v[i]);
    mi += (1.0f - beta1) * (g - mi);
    vi = beta2 * vi + (1.0f - beta2) * g * g;
    float second = vi;
    if constexpr (R::amsgrad) {
      float const mx = std::max(convert<float>(vmax[i]), vi);
      vmax[i]        = convert<state_t>(mx);
      second         = mx;
    }
    w -= step_size * mi / (std::sqrt(second) / bc2_sqrt + eps);
    m[i] = convert<state_t>(mi);
    v[i] = convert<state_t>(vi);
    if constexpr (P::has_master) { master[i] = w; }
    param[i] = convert<typename P::param_type>(w);
  }
}

/// The roofline: every array the step reads is read, every array it writes is written in
/// place, and the only arithmetic is an add per array.
template <class R, class P>
void pattern_step(raw_t<typename P::param_type>* __restrict param,
                  raw_t<typename P::grad_type> const* __restrict grad, float* __restrict master,
                  raw_t<typename P::state_type>* __restrict s0, raw_t<typename P::state_type>* __restrict s1,
                  raw_t<typename P::state_type>* __restrict s2, std::size_t b, std::size_t e)
{
  using param_raw = raw_t<typename P::param_type>;
  using state_raw = raw_t<typename P::state_type>;
  for (std::size_t i = b; i < e; ++i) {
    if constexpr (P::has_master) {
      master[i] += 1.0f;
      param[i] = static_cast<param_raw>(grad[i] + 1);
    } else {
      param[i] = static_cast<param_raw>(param[i] + grad[i]);
    }
    s0[i] = static_cast<state_raw>(s0[i] + 1);
    s1[i] = static_cast<state_raw>(s1[i] + 1);
    if constexpr (R::amsgrad) { s2[i] = static_cast<state_raw>(s2[i] + 1); }
  }
}

template <class P>
constexpr std::size_t bytes_per_element(std::size_t slots)
{
  std::size_t b = sizeof(typename P::grad_type);
  if constexpr (P::has_master) {
    b += 2 * sizeof(float) + sizeof(typename P::param_type);
  } else {
    b += 2 * sizeof(typename P::param_type);
  }
  return b + 2 * slots * sizeof(typename P::state_type);
}

double triad_gb_s(thread_pool& pool, std::size_t n, int reps)
{
  buffer<double> a(n), b(n), c(n);
  pool.parallel_for(n, 4096, [&](std::size_t lo, std::size_t hi) {
    for (std::size_t i = lo; i < hi; ++i) {
      a.get()[i] = 0.0;
      b.get()[i] = 1.0;
      c.get()[i] = 2.0;
    }
  });
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    auto const t0 = clock_type::now();
    pool.parallel_for(n, 4096, [&](std::size_t lo, std::size_t hi) {
      double* __restrict x       = a.get();
      double const* __restrict y = b.get();
      double const* __restrict z = c.get();
      for (std::size_t i = lo; i < hi; ++i) { x[i] = y[i] + 3.0 * z[i]; }
    });
    t.push_back(seconds_since(t0));
  }
  return 3.0 * sizeof(double) * static_cast<double>(n) / median(t) / 1e9;
}

template <class R, class P>
void run(options const& o, thread_pool& pool, arrays<P>& arr, double triad)
{
  if (!o.rule.empty() && o.rule != R::name) { return; }
  if (!o.precision.empty() && o.precision != P::name()) { return; }

  std::size_t const n     = arr.n;
  std::size_t const grain = 64 * host::batch_size<>;
  auto const a            = arr.template view<R>();
  typename R::hyperparameters h;
  h.lr = 1e-4;

  using param_raw = raw_t<typename P::param_type>;
  using grad_raw  = raw_t<typename P::grad_type>;
  using state_raw = raw_t<typename P::state_type>;
  auto* s2        = R::amsgrad ? arr.state[2].get() : arr.state[1].get();

  std::int64_t step = 0;
  auto lib = [&] { host::update<R, P>(pool, R::coefficients_for(h, ++step), a, n); };
  auto plain = [&] {
    ++step;
    double const bc1 = 1.0 - std::pow(h.betas[0], static_cast<double>(step));
    double const bc2 = 1.0 - std::pow(h.betas[1], static_cast<double>(step));
    pool.parallel_for(n, grain, [&](std::size_t b, std::size_t e) {
      plain_step<R, P>(arr.param.get(), arr.grad.get(), arr.master.get(), arr.state[0].get(),
                       arr.state[1].get(), s2, b, e, 1.0f, static_cast<float>(h.lr),
                       static_cast<float>(h.weight_decay), static_cast<float>(h.betas[0]),
                       static_cast<float>(h.betas[1]), static_cast<float>(h.eps),
                       static_cast<float>(h.lr / bc1), static_cast<float>(std::sqrt(bc2)));
    });
  };
  auto pattern = [&] {
    pool.parallel_for(n, grain, [&](std::size_t b, std::size_t e) {
      pattern_step<R, P>(reinterpret_cast<param_raw*>(arr.param.get()),
                         reinterpret_cast<grad_raw const*>(arr.grad.get()), arr.master.get(),
                         reinterpret_cast<state_raw*>(arr.state[0].get()),
                         reinterpret_cast<state_raw*>(arr.state[1].get()),
                         reinterpret_cast<state_raw*>(s2), b, e);
    });
  };

  auto const [s, plain_s, pattern_s] = interleaved_medians(o.reps, lib, plain, pattern);
  double const gelem   = static_cast<double>(n) / s / 1e9;
  double const plain_g = static_cast<double>(n) / plain_s / 1e9;
  double const patt_g  = static_cast<double>(n) / pattern_s / 1e9;
  std::size_t const bpe = bytes_per_element<P>(R::slot_count);
  std::printf(
    "{\"bench\":\"host_step\",\"rule\":\"%s\",\"precision\":\"%s\",\"arch\":\"%s\","
    "\"elements\":%zu,\"threads\":%zu,\"reps\":%d,\"seconds_per_step\":%.6g,"
    "\"gelem_per_s\":%.4g,\"bytes_per_elem\":%zu,\"gb_per_s\":%.4g,"
    "\"plain_gelem_per_s\":%.4g,\"pattern_gelem_per_s\":%.4g,\"roofline_ratio\":%.4f,"
    "\"plain_ratio\":%.4f,\"triad_gb_s\":%.4g}\n",
    std::string(R::name).c_str(), P::name().c_str(), host::arch_name(), n, pool.size(), o.reps,
    s, gelem, bpe, gelem * static_cast<double>(bpe), plain_g, patt_g, gelem / patt_g,
    gelem / plain_g, triad);
  std::fflush(stdout);
}

/// The full OffloadedOptimizer::step() over a model-like set of tensors (state in
/// PinnedHost), against the bare kernel and the pattern over the same element count,
/// interleaved: with the non-finite check (the default) and without. With the check, the
/// step's traffic includes one more read of the gradients: bytes_per_elem counts it and the
/// pattern makes it too (a read-and-or pass), so roofline_ratio stays "step / the same
/// traffic"; kernel_ratio compares with the bare kernel, which does not check.
template <class R, class P>
void run_optimizer(options const& o, thread_pool& pool, arrays<P>& arr, double triad, bool check)
{
  if (!o.rule.empty() && o.rule != R::name) { return; }
  std::size_t const n = arr.n;
  // A transformer-like mix: large matrices, small biases and norms.
  std::vector<std::size_t> sizes;
  std::size_t const pattern_sizes[] = {std::size_t{1} << 22, 4096, 1024, 1024, std::size_t{1} << 22, 1024};
  for (std::size_t total = 0, i = 0; total < n; ++i) {
    std::size_t const s = std::min(pattern_sizes[i % 6], n - total);
    sizes.push_back(s);
    total += s;
  }
  buffer<typename P::param_type> param(n);
  buffer<typename P::grad_type> grad(n);
  pool.parallel_for(n, 4096, [&](std::size_t b, std::size_t e) {
    for (std::size_t i = b; i < e; ++i) {
      param.get()[i] = convert<typename P::param_type>(0.5f + static_cast<float>(i % 1000) * 1e-4f);
      grad.get()[i]  = arr.grad.get()[i];
    }
  });
  typename OffloadedOptimizer<R, P>::options opts;
  opts.threads      = pool.size();
  opts.on_nonfinite = check ? nonfinite_policy::skip_step : nonfinite_policy::ignore;
  OffloadedOptimizer<R, P> opt({}, opts);
  std::vector<grad_view<typename P::grad_type>> views;
  for (std::size_t t = 0, off = 0; t < sizes.size(); off += sizes[t], ++t) {
    std::string name = "t";  // (not "t" + ...: GCC 12 -Wrestrict false positive, bug 105329)
    name += std::to_string(t);
    opt.add_tensor(std::move(name), param.get() + off, sizes[t]);
    views.push_back({grad.get() + off, sizes[t], location::host});
  }

  std::size_t const grain = 64 * host::batch_size<>;
  auto const a            = arr.template view<R>();
  typename R::hyperparameters h;
  h.lr = 1e-4;
  std::int64_t step = 0;
  using param_raw = raw_t<typename P::param_type>;
  using grad_raw  = raw_t<typename P::grad_type>;
  using state_raw = raw_t<typename P::state_type>;
  auto optimizer = [&] { opt.step(views); };
  auto kernel    = [&] { host::update<R, P>(pool, R::coefficients_for(h, ++step), a, n); };
  std::atomic<unsigned> sink{0};
  auto pattern   = [&] {
    if (check) {
      // The check's traffic too: one more read of the gradients, an or per element.
      pool.parallel_for(n, grain, [&](std::size_t b, std::size_t e) {
        using grad_bits   = std::conditional_t<sizeof(grad_raw) == 4, std::uint32_t, std::uint16_t>;
        auto const* g     = reinterpret_cast<unsigned char const*>(arr.grad.get());
        grad_bits acc     = 0;
        for (std::size_t i = b; i < e; ++i) {
          grad_bits bits;
          std::memcpy(&bits, g + i * sizeof(grad_bits), sizeof(grad_bits));
          acc = static_cast<grad_bits>(acc | bits);
        }
        sink.fetch_or(acc, std::memory_order_relaxed);
      });
    }
    pool.parallel_for(n, grain, [&](std::size_t b, std::size_t e) {
      pattern_step<R, P>(reinterpret_cast<param_raw*>(arr.param.get()),
                         reinterpret_cast<grad_raw const*>(arr.grad.get()), arr.master.get(),
                         reinterpret_cast<state_raw*>(arr.state[0].get()),
                         reinterpret_cast<state_raw*>(arr.state[1].get()),
                         reinterpret_cast<state_raw*>(arr.state[1].get()), b, e);
    });
  };
  auto const [s, kernel_s, pattern_s] = interleaved_medians(o.reps, optimizer, kernel, pattern);
  double const gelem    = static_cast<double>(n) / s / 1e9;
  double const kernel_g = static_cast<double>(n) / kernel_s / 1e9;
  double const patt_g   = static_cast<double>(n) / pattern_s / 1e9;
  std::size_t const bpe = bytes_per_element<P>(R::slot_count) + (check ? sizeof(typename P::grad_type) : 0);
  std::printf(
    "{\"bench\":\"host_step\",\"variant\":\"optimizer\",\"rule\":\"%s\",\"precision\":\"%s\","
    "\"arch\":\"%s\",\"elements\":%zu,\"tensors\":%zu,\"chunk_elements\":%zu,\"threads\":%zu,"
    "\"reps\":%d,\"nonfinite_check\":%s,\"pattern_reads_grads_twice\":%s,\"seconds_per_step\":%.6g,\"gelem_per_s\":%.4g,"
    "\"bytes_per_elem\":%zu,\"gb_per_s\":%.4g,\"kernel_gelem_per_s\":%.4g,"
    "\"pattern_gelem_per_s\":%.4g,\"roofline_ratio\":%.4f,\"kernel_ratio\":%.4f,"
    "\"triad_gb_s\":%.4g}\n",
    std::string(R::name).c_str(), P::name().c_str(), host::arch_name(), n, sizes.size(),
    opts.chunk_elements, pool.size(), o.reps, check ? "true" : "false", check ? "true" : "false", s, gelem, bpe, gelem * static_cast<double>(bpe),
    kernel_g, patt_g, gelem / patt_g, gelem / kernel_g, triad);
  std::fflush(stdout);
}

template <class P>
void run_precision(options const& o, thread_pool& pool, double triad)
{
  if (!o.precision.empty() && o.precision != P::name()) { return; }
  arrays<P> arr(o.elements, pool);
  run<Adam, P>(o, pool, arr, triad);
  run<AdamW, P>(o, pool, arr, triad);
  run<AdamAmsgrad, P>(o, pool, arr, triad);
  run<AdamWAmsgrad, P>(o, pool, arr, triad);
  run_optimizer<AdamW, P>(o, pool, arr, triad, true);
  run_optimizer<AdamW, P>(o, pool, arr, triad, false);
}

}  // namespace

int main(int argc, char** argv)
{
  options const o = parse(argc, argv);
  try {
    thread_pool pool(o.threads);
    double const triad = triad_gb_s(pool, o.elements, std::max(3, o.reps));
    run_precision<Fp32>(o, pool, triad);
    run_precision<Bf16Mixed>(o, pool, triad);
    run_precision<Fp16Mixed>(o, pool, triad);
    run_precision<Bf16MixedBf16State>(o, pool, triad);
  } catch (std::exception const& e) {
    std::fprintf(stderr, "host_step: %s\n", e.what());
    return 1;
  }
  return 0;
}
