// SPDX-License-Identifier: Apache-2.0
// gpu_step: one optimizer step with bf16 params and gradients on the GPU, for each device
// composition, against the bound set by its slowest resource, measured in the same run.
//
// For every composition it prints one JSON line:
//   seconds_per_step   the median step (CudaOverlapped<2>, AdamW, bf16/bf16/fp32/fp32; the
//                      "+8bit" rows with m and v in 8-bit blocks, Bf16Mixed8bit)
//   h2d_gb_s, d2h_gb_s pinned cudaMemcpyAsync, both directions at once (as a step uses them)
//   host_seconds       the host kernel alone over the same elements (host::update, in memory)
//   device_seconds     the device kernel alone over the same elements (one launch)
//   nvme_seconds       where the state is on NVMe: writing and reading the state's bytes with
//                      dd and O_DIRECT on the same path (dd is on every Linux; fio may not be)
//   bound_seconds      max(h2d bytes / h2d_gb_s, d2h bytes / d2h_gb_s, and of host_seconds,
//                      device_seconds and nvme_seconds those the composition uses; the
//                      kernels alone are timed with fp32 state, so an 8-bit row's bound
//                      leaves them out: it is its transfers' and its disk's)
//   bound_ratio        seconds_per_step / bound_seconds: 1 is perfect overlap
//
// With no arguments on a GPU: 1e9 elements for the in-memory compositions, 2.5e8 for those on
// NVMe (in a fresh directory under /tmp, or --path). Built with a Thrust host backend it runs
// on the emulated device, small, as a smoke test of the code path (its numbers mean nothing).
//
//   gpu_step [--elements N] [--nvme-elements N] [--steps N] [--path DIR]
//            [--composition NAME]... [--chunk-elements N] [--threads N]
#include <tierstate/kernels/device/on_device.hpp>
#include <tierstate/tierstate.hpp>

#include <thrust/execution_policy.h>
#include <thrust/fill.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <unistd.h>

using namespace tierstate;

namespace {

using P  = Bf16Mixed;
using P8 = Bf16Mixed8bit;  // the +8bit rows: m and v in 8-bit blocks (codecs/dynamic8.hpp)
using clock_type = std::chrono::steady_clock;

double since(clock_type::time_point t0) { return std::chrono::duration<double>(clock_type::now() - t0).count(); }

double median(std::vector<double> v)
{
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

template <class T>
struct device_array {
  T* data = nullptr;
  explicit device_array(std::size_t n)
  {
    data = static_cast<T*>(device::allocate_async(n * sizeof(T), {}));
    device::stream_view{}.synchronize();
  }
  ~device_array() { device::deallocate_async(data, {}); }
  device_array(device_array const&)            = delete;
  device_array& operator=(device_array const&) = delete;
};

template <class T>
void fill(T* p, std::size_t n, T value)
{
  thrust::fill(thrust::device, p, p + n, value);
}

struct settings {
  std::size_t elements      = 0;
  std::size_t nvme_elements = 0;
  int steps                 = 5;
  std::size_t chunk         = std::size_t{1} << 20;
  std::size_t threads       = 0;
  std::filesystem::path dir;
  std::vector<std::string> compositions;
};

/// Pinned host to device and back, both at once, on two streams: GB/s each way.
std::pair<double, double> pcie_bandwidth()
{
  std::size_t const bytes = device::is_emulated ? (std::size_t{64} << 20) : (std::size_t{512} << 20);
  PinnedHost up(bytes), down(bytes);
  device_array<std::byte> a(bytes), b(bytes);
  device::stream h2d, d2h;
  std::vector<double> up_rate, down_rate;
  for (int rep = 0; rep < 5; ++rep) {
    // Both directions at once, as a step runs them; each rate is its bytes over the time
    // until both have landed (full duplex: neither waits for the other).
    auto const t0 = clock_type::now();
    device::copy_async(a.data, up.data(), bytes, h2d);
    device::copy_async(down.data(), b.data, bytes, d2h);
    h2d.synchronize();
    d2h.synchronize();
    double const t_up = since(t0), t_down = t_up;
    up_rate.push_back(static_cast<double>(bytes) / t_up / 1e9);
    down_rate.push_back(static_cast<double>(bytes) / t_down / 1e9);
  }
  return {median(up_rate), median(down_rate)};
}

/// The host kernel alone over n elements in memory (median of 3).
double host_seconds(std::size_t n, thread_pool& pool)
{
  std::vector<bf16> param(n, bf16(0.5f)), grad(n, bf16(1e-3f));
  std::vector<float> master(n, 0.5f), m(n, 0.0f), v(n, 0.0f);
  update_arrays<P, 2> a;
  a.param  = param.data();
  a.grad   = grad.data();
  a.master = master.data();
  a.state  = {m.data(), v.data()};
  std::vector<double> t;
  for (int rep = 1; rep <= 4; ++rep) {
    auto const k  = AdamW::coefficients_for({}, rep);
    auto const t0 = clock_type::now();
    host::update<AdamW, P>(pool, k, a, n);
    if (rep > 1) { t.push_back(since(t0)); }  // the first touches the pages
  }
  return median(t);
}

/// The device kernel alone over n elements (one launch; median of 5).
double device_seconds(std::size_t n)
{
  device_array<bf16> param(n), grad(n);
  device_array<float> master(n), m(n), v(n);
  fill(param.data, n, bf16(0.5f));
  fill(grad.data, n, bf16(1e-3f));
  fill(master.data, n, 0.5f);
  fill(m.data, n, 0.0f);
  fill(v.data, n, 0.0f);
  update_arrays<P, 2> a;
  a.param  = param.data;
  a.grad   = grad.data;
  a.master = master.data;
  a.state  = {m.data, v.data};
  device::stream s;
  std::vector<double> t;
  for (int rep = 1; rep <= 6; ++rep) {
    auto const k  = AdamW::coefficients_for({}, rep);
    auto const t0 = clock_type::now();
    device::update_async<AdamW, P>(s, k, a, n);
    s.synchronize();
    if (rep > 1) { t.push_back(since(t0)); }
  }
  return median(t);
}

/// Writes then reads `bytes` with dd and O_DIRECT in `dir`: seconds for both.
double dd_seconds(std::filesystem::path const& dir, std::size_t bytes)
{
  std::size_t const block = std::size_t{4} << 20;
  std::size_t const count = (bytes + block - 1) / block;
  std::string const file  = (dir / "dd.scratch").string();
  std::string const write = "dd if=/dev/zero of='" + file + "' bs=4M count=" + std::to_string(count) +
                            " oflag=direct conv=fsync status=none";
  std::string const read = "dd if='" + file + "' of=/dev/null bs=4M iflag=direct status=none";
  auto const t0 = clock_type::now();
  int const w   = std::system(write.c_str());
  double const tw = since(t0);
  auto const t1 = clock_type::now();
  int const r   = std::system(read.c_str());
  double const tr = since(t1);
  std::filesystem::remove(file);
  if (w != 0 || r != 0) {
    std::fprintf(stderr, "gpu_step: dd failed in %s (write %d, read %d)\n", dir.c_str(), w, r);
    return -1.0;
  }
  return tw + tr;
}

struct measured {
  double seconds = 0;
  std::uint64_t h2d = 0, d2h = 0;
  std::size_t staging = 0, device_staging = 0;
};

/// `steps` timed steps (after one that makes the state and one warm-up) of composition Opt.
template <class Opt>
measured run(settings const& s, std::size_t n, typename Opt::options o)
{
  o.chunk_elements = s.chunk;
  o.threads        = s.threads;
  device_array<bf16> w(n), g(n);
  fill(w.data, n, bf16(0.5f));
  fill(g.data, n, bf16(1e-3f));
  Opt opt({.lr = 1e-4, .weight_decay = 0.01}, o);
  // Two tensors, so that chunks straddle a tensor boundary as in a model.
  std::size_t const n0 = n / 3;
  opt.add_tensor("a", w.data, n0, location::device);
  opt.add_tensor("b", w.data + n0, n - n0, location::device);
  std::vector<grad_view<bf16>> const grads = {{g.data, n0, location::device}, {g.data + n0, n - n0, location::device}};
  opt.step(grads);
  opt.step(grads);
  std::vector<double> t;
  measured m;
  for (int i = 0; i < s.steps; ++i) {
    auto const r = opt.step(grads);
    t.push_back(r.stats.total_seconds);
    m.h2d = r.stats.h2d_bytes;
    m.d2h = r.stats.d2h_bytes;
  }
  m.seconds        = median(t);
  m.staging        = opt.staging_bytes();
  m.device_staging = opt.device_staging_bytes();
  return m;
}

}  // namespace

int main(int argc, char** argv)
{
  settings s;
  for (int i = 1; i < argc; ++i) {
    std::string const a = argv[i];
    auto next = [&]() -> char const* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "gpu_step: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--elements") {
      s.elements = std::strtoull(next(), nullptr, 10);
    } else if (a == "--nvme-elements") {
      s.nvme_elements = std::strtoull(next(), nullptr, 10);
    } else if (a == "--steps") {
      s.steps = std::atoi(next());
    } else if (a == "--path") {
      s.dir = next();
    } else if (a == "--composition") {
      s.compositions.emplace_back(next());
    } else if (a == "--chunk-elements") {
      s.chunk = std::strtoull(next(), nullptr, 10);
    } else if (a == "--threads") {
      s.threads = std::strtoull(next(), nullptr, 10);
    } else {
      std::fprintf(stderr,
                   "usage: %s [--elements N] [--nvme-elements N] [--steps N] [--path DIR] "
                   "[--composition device|pinned_host+on_host|nvme+on_host|pinned_host+on_device|"
                   "nvme+on_device]... [--chunk-elements N] [--threads N]\n",
                   argv[0]);
      return 2;
    }
  }
  if (device::count() == 0) {
    std::printf("SKIP: %s\n", device::describe().c_str());
    return 77;
  }
  if (s.elements == 0) { s.elements = device::is_emulated ? (std::size_t{1} << 20) : 1'000'000'000; }
  if (s.nvme_elements == 0) { s.nvme_elements = device::is_emulated ? (std::size_t{1} << 18) : 250'000'000; }
  if (s.steps < 1 || s.elements < 3 || s.nvme_elements < 3) {
    std::fprintf(stderr, "gpu_step: --steps must be >= 1 and element counts >= 3\n");
    return 2;
  }
  // In-memory first: a run cut short by a timeout still reports those.
  std::vector<std::string> const all = {"device",       "pinned_host+on_host",      "pinned_host+on_device",
                                        "device+8bit",  "pinned_host+on_host+8bit", "nvme+on_host",
                                        "nvme+on_device", "nvme+on_host+8bit"};
  if (s.compositions.empty()) { s.compositions = all; }
  for (auto const& c : s.compositions) {
    if (std::find(all.begin(), all.end(), c) == all.end()) {
      std::fprintf(stderr, "gpu_step: unknown composition '%s'\n", c.c_str());
      return 2;
    }
  }
  bool const own_dir = s.dir.empty();
  if (own_dir) {
    std::string t = (std::filesystem::temp_directory_path() / "gpu_step-XXXXXX").string();
    if (::mkdtemp(t.data()) == nullptr) {
      std::perror("gpu_step: mkdtemp");
      return 1;
    }
    s.dir = t;
  }

  thread_pool pool(s.threads);
  auto const [h2d_gb_s, d2h_gb_s] = pcie_bandwidth();
  std::map<std::size_t, double> host_t, device_t, nvme_t;
  auto host_alone   = [&](std::size_t n) { return host_t.count(n) ? host_t[n] : (host_t[n] = host_seconds(n, pool)); };
  auto device_alone = [&](std::size_t n) { return device_t.count(n) ? device_t[n] : (device_t[n] = device_seconds(n)); };
  auto nvme_alone   = [&](std::size_t n, std::size_t per_element) {  // master and state bytes
    std::size_t const key = n * 16 + per_element;
    return nvme_t.count(key) ? nvme_t[key]
                             : (nvme_t[key] = dd_seconds(s.dir, per_element * ((n + s.chunk - 1) / s.chunk) * s.chunk));
  };

  for (auto const& c : s.compositions) {
    bool const nvme      = c.rfind("nvme", 0) == 0;
    bool const on_device = c == "device" || c.find("on_device") != std::string::npos;
    std::size_t const n  = nvme ? s.nvme_elements : s.elements;
    NvmeFile::options tier;
    tier.directory = s.dir;
    bool const eight     = c.size() > 5 && c.compare(c.size() - 5, 5, "+8bit") == 0;
    measured m;
    if (c == "device") {
      m = run<OffloadedOptimizer<AdamW, P, Device, CudaOverlapped<2>, OnDevice>>(s, n, {});
    } else if (c == "pinned_host+on_host") {
      m = run<OffloadedOptimizer<AdamW, P, PinnedHost, CudaOverlapped<2>, OnHost<>>>(s, n, {});
    } else if (c == "nvme+on_host") {
      m = run<OffloadedOptimizer<AdamW, P, NvmeFile, CudaOverlapped<2>, OnHost<>>>(s, n, {.tier = tier});
    } else if (c == "pinned_host+on_device") {
      m = run<OffloadedOptimizer<AdamW, P, PinnedHost, CudaOverlapped<2>, OnDevice>>(s, n, {});
    } else if (c == "nvme+on_device") {
      m = run<OffloadedOptimizer<AdamW, P, NvmeFile, CudaOverlapped<2>, OnDevice>>(s, n, {.tier = tier});
    } else if (c == "device+8bit") {
      m = run<OffloadedOptimizer<AdamW, P8, Device, CudaOverlapped<2>, OnDevice>>(s, n, {});
    } else if (c == "pinned_host+on_host+8bit") {
      m = run<OffloadedOptimizer<AdamW, P8, PinnedHost, CudaOverlapped<2>, OnHost<>>>(s, n, {});
    } else {
      m = run<OffloadedOptimizer<AdamW, P8, NvmeFile, CudaOverlapped<2>, OnHost<>>>(s, n, {.tier = tier});
    }
    // The kernels alone are timed with fp32 state: for an 8-bit row they are left out of its
    // bound (null), which is then the transfers' (and the disk's, for a smaller state).
    double const hs = on_device || eight ? 0.0 : host_alone(n);
    double const ds = on_device && !eight ? device_alone(n) : 0.0;
    double const ns = nvme ? nvme_alone(n, eight ? 6 : 12) : 0.0;
    double const bound = std::max({static_cast<double>(m.h2d) / (h2d_gb_s * 1e9),
                                   static_cast<double>(m.d2h) / (d2h_gb_s * 1e9), hs, ds, ns});
    std::printf("{\"bench\":\"gpu_step\",\"composition\":\"%s\",\"rule\":\"AdamW\",\"precision\":\"%s\","
                "\"transfer\":\"CudaOverlapped<2>\",\"elements\":%zu,\"chunk_elements\":%zu,\"steps\":%d,"
                "\"seconds_per_step\":%.4f,\"h2d_bytes\":%llu,\"d2h_bytes\":%llu,\"h2d_gb_s\":%.2f,"
                "\"d2h_gb_s\":%.2f,\"host_seconds\":%s,\"device_seconds\":%s,\"nvme_seconds\":%s,"
                "\"bound_seconds\":%.4f,\"bound_ratio\":%.3f,\"staging_bytes\":%zu,"
                "\"device_staging_bytes\":%zu,\"threads\":%zu,\"device\":\"%s\",\"emulated\":%s}\n",
                c.c_str(), eight ? P8::name().c_str() : P::name().c_str(), n, s.chunk, s.steps, m.seconds,
                static_cast<unsigned long long>(m.h2d), static_cast<unsigned long long>(m.d2h), h2d_gb_s,
                d2h_gb_s, on_device || eight ? "null" : std::to_string(hs).c_str(),
                on_device && !eight ? std::to_string(ds).c_str() : "null", nvme ? std::to_string(ns).c_str() : "null",
                bound, bound > 0 ? m.seconds / bound : 0.0, m.staging, m.device_staging, pool.size(),
                device::describe().c_str(), device::is_emulated ? "true" : "false");
    std::fflush(stdout);
  }
  if (own_dir) { std::filesystem::remove_all(s.dir); }
  return 0;
}
