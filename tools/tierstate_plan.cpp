// SPDX-License-Identifier: Apache-2.0
// tierstate-plan: what fits where, and how fast, before a long job starts (issue 24, part 2),
// and the NVMe engine's settings for a disk (part 3).
//
//   tierstate-plan --params 7e9 [--param bf16|fp16|fp32] [--state fp32|bf16|int8]
//                  [--master fp32|kahan|none] [--rule adamw|adam|adam_amsgrad|sgd|sgd_momentum|lion]
//                  [--gpu-memory 24GiB] [--host-memory 128GiB] [--nvme PATH [--nvme-capacity 3.84TB]] [--layers L]
//                  [--chunk-elements N] [--no-probe] [--host-gb-s X] [--disk-gb-s X] [--pcie-gb-s X]
//                  [--json]
//   tierstate-plan --tune-nvme PATH [--scratch-bytes N] [--exhaustive]
//
// The plan counts the bytes of each composition (the optimizer's model states: params,
// gradients, master and moments; activations are the framework's), says which fit (90% of each
// memory at most), and predicts a step's time from bandwidths it measures itself with short
// probes: host memory (the step's traffic, no arithmetic), the disk under --nvme through
// tierstate's own I/O engine (reads and writes at once), and PCIe where a GPU is (through the CUDA
// runtime, loaded at run time where one is installed, or linked in a CUDA build; otherwise
// --pcie-gb-s, default 25, is assumed and said so). The model: plan/plan.hpp.
#include <tierstate/plan/plan.hpp>
#include <tierstate/tierstate.hpp>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include <dlfcn.h>
#include <fcntl.h>
#include <sys/statvfs.h>
#include <unistd.h>

namespace {

using namespace tierstate;
using plan::probe_disk_gb_s;
using plan::probe_host_gb_s;
using clk = std::chrono::steady_clock;

[[noreturn]] void usage(std::string const& why)
{
  std::fprintf(stderr, "tierstate-plan: %s\n(tierstate-plan --help for the options)\n", why.c_str());
  std::exit(2);
}

/// "7e9", "70B", "1.5M", "24GiB", "128GB": a count or a size.
double quantity(std::string const& option, std::string const& text)
{
  char* end       = nullptr;
  double const v  = std::strtod(text.c_str(), &end);
  std::string const unit(end);
  double scale = 1;
  if (unit.empty()) {
  } else if (unit == "K" || unit == "k") {
    scale = 1e3;
  } else if (unit == "M") {
    scale = 1e6;
  } else if (unit == "B" || unit == "G") {
    scale = 1e9;
  } else if (unit == "T") {
    scale = 1e12;
  } else if (unit == "KiB") {
    scale = 1024.0;
  } else if (unit == "MiB") {
    scale = 1024.0 * 1024;
  } else if (unit == "GiB") {
    scale = 1024.0 * 1024 * 1024;
  } else if (unit == "TiB") {
    scale = 1024.0 * 1024 * 1024 * 1024;
  } else if (unit == "GB") {
    scale = 1e9;
  } else if (unit == "TB") {
    scale = 1e12;
  } else {
    usage(option + " " + text + ": unknown unit '" + unit + "'");
  }
  if (end == text.c_str() || !(v > 0) || !std::isfinite(v)) { usage(option + " " + text + ": not a positive number"); }
  return v * scale;
}

/// The median of `v`.
double median(std::vector<double> v)
{
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

#if !defined(TIERSTATE_ENABLE_CUDA)
/// PCIe measured through the CUDA runtime loaded at run time (libcudart, where one is
/// installed), as plan::probe_pcie_gb_s does in a CUDA build: the tool needs no CUDA to be
/// built or to run. Pinned host memory (cudaMallocHost) to the GPU and back, synchronously,
/// `bytes` each way; median of 5 after a warm-up. Nothing, with `why` said, where there is no
/// runtime, no GPU, or a call fails.
std::optional<double> probe_pcie_runtime(std::string& why, std::size_t bytes = std::size_t{256} << 20)
{
  void* lib = nullptr;
  for (char const* name : {"libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"}) {
    if ((lib = ::dlopen(name, RTLD_NOW | RTLD_LOCAL)) != nullptr) { break; }
  }
  if (lib == nullptr) {
    why = "assumed: no CUDA runtime (libcudart) to measure it with";
    return std::nullopt;
  }
  struct closer {
    void* lib;
    ~closer() { ::dlclose(lib); }
  } const close_it{lib};
  using count_fn = int (*)(int*);
  using alloc_fn = int (*)(void**, std::size_t);
  using free_fn  = int (*)(void*);
  using copy_fn  = int (*)(void*, void const*, std::size_t, int);
  auto const count     = reinterpret_cast<count_fn>(::dlsym(lib, "cudaGetDeviceCount"));
  auto const host_new  = reinterpret_cast<alloc_fn>(::dlsym(lib, "cudaMallocHost"));
  auto const dev_new   = reinterpret_cast<alloc_fn>(::dlsym(lib, "cudaMalloc"));
  auto const host_free = reinterpret_cast<free_fn>(::dlsym(lib, "cudaFreeHost"));
  auto const dev_free  = reinterpret_cast<free_fn>(::dlsym(lib, "cudaFree"));
  auto const copy      = reinterpret_cast<copy_fn>(::dlsym(lib, "cudaMemcpy"));
  if (!count || !host_new || !dev_new || !host_free || !dev_free || !copy) {
    why = "assumed: the CUDA runtime found lacks a function the probe calls";
    return std::nullopt;
  }
  int n = 0;
  if (count(&n) != 0 || n == 0) {
    why = "assumed: no GPU seen";
    return std::nullopt;
  }
  void *host = nullptr, *dev = nullptr;
  std::vector<double> t;
  bool ok = host_new(&host, bytes) == 0 && dev_new(&dev, bytes) == 0;
  if (ok) { std::memset(host, 1, bytes); }
  constexpr int to_device = 1, to_host = 2;  // cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost
  for (int r = 0; ok && r < 6; ++r) {
    auto const t0 = clk::now();
    ok = copy(dev, host, bytes, to_device) == 0 && copy(host, dev, bytes, to_host) == 0;
    if (r > 0) { t.push_back(std::chrono::duration<double>(clk::now() - t0).count()); }  // the first warms up
  }
  if (dev != nullptr) { (void)dev_free(dev); }
  if (host != nullptr) { (void)host_free(host); }
  if (!ok) {
    why = "assumed: a CUDA call of the PCIe probe failed";
    return std::nullopt;
  }
  return 2.0 * static_cast<double>(bytes) / median(t) / 1e9;
}
#endif


/// --check: the plan's predicted step time against the measured one, in the same run, for a
/// host_step-sized run (2^24 elements, fp32 AdamW, PinnedHost) and an nvme_step-sized one
/// (20,971,520 elements, bf16-mixed AdamW, NvmeFile + Pipelined<2> in `dir`): each round runs
/// the probes, then the step; medians over `rounds`. One JSON line each; exit status 0 whatever
/// the ratios (an error is 1).
int check(std::string const& dir, int rounds)
{
#if defined(TIERSTATE_ENABLE_CUDA)
  if (int count = 0; ::cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    (void)::cudaGetLastError();
    std::fprintf(stderr, "tierstate-plan --check: this build's PinnedHost page-locks with CUDA, and no GPU is seen: "
                         "run --check from a build without CUDA, or on a machine with a GPU\n");
    return 77;
  }
#endif
  thread_pool pool;
  auto run = [&]<class Optimizer>(std::type_identity<Optimizer>, char const* name, std::size_t n, plan::job f,
                                   typename Optimizer::options o, bool on_disk) {
    using param_t = typename Optimizer::param_type;
    using grad_t  = typename Optimizer::grad_type;
    std::vector<param_t> p(n, param_t(0.5f));
    std::vector<grad_t> g(n, grad_t(1e-3f));
    o.on_nonfinite = nonfinite_policy::ignore;
    Optimizer opt({.lr = 1e-4}, o);
    opt.add_tensor("w", p.data(), n);
    std::vector<grad_view<grad_t>> grads{{g.data(), n}};
    (void)opt.step(grads);
    std::vector<double> host, disk, steps;
    for (int r = 0; r < rounds; ++r) {
      host.push_back(probe_host_gb_s(pool, n));
      if (on_disk) { disk.push_back(probe_disk_gb_s(dir, std::size_t{256} << 20, {})); }
      steps.push_back(opt.step(grads).stats.total_seconds);
    }
    // The model's own prediction (plan::compositions), for host params: the update's memory
    // traffic, and on disk the state's reads and writes, whichever is longer (no PCIe).
    plan::machine m;
    m.host_gb_s = median(host);
    m.disk_gb_s = on_disk ? median(disk) : 0;
    f.params    = static_cast<double>(n);
    auto const rows        = plan::compositions(f, m);
    auto const& row        = rows[on_disk ? 2 : 1];
    double const predicted = on_disk ? std::max(row.compute_seconds, row.disk_seconds) : row.compute_seconds;
    double const measured  = median(steps);
    std::printf("{\"bench\":\"plan_check\",\"case\":\"%s\",\"elements\":%zu,\"rounds\":%d,\"host_gb_s\":%.4g,"
                "\"disk_gb_s\":%.4g,\"predicted_seconds\":%.4g,\"measured_seconds\":%.4g,\"ratio\":%.4f,"
                "\"within_25_percent\":%s}\n",
                name, n, rounds, m.host_gb_s, m.disk_gb_s, predicted, measured, predicted / measured,
                std::abs(predicted / measured - 1) <= 0.25 ? "true" : "false");
    std::fflush(stdout);
    return std::abs(predicted / measured - 1) <= 0.25;
  };
  plan::job fp32_params;
  fp32_params.param = "fp32";
  plan::job bf16_params;
  using Host = OffloadedOptimizer<AdamW, Fp32, PinnedHost>;
  using Disk = OffloadedOptimizer<AdamW, Bf16Mixed, NvmeFile, Pipelined<2>>;
  Disk::options dopt;
  dopt.tier.directory = dir;
  // (Speed decides no exit status: within_25_percent says it, for the record.)
  (void)run(std::type_identity<Host>{}, "host_step", std::size_t{1} << 24, fp32_params, Host::options{}, false);
  (void)run(std::type_identity<Disk>{}, "nvme_step", std::size_t{20} << 20, bf16_params, dopt, true);
  return 0;
}

int tune(std::string const& dir, std::size_t bytes, bool exhaustive)
{
  std::vector<std::size_t> const blocks = {std::size_t{256} << 10, std::size_t{1} << 20, std::size_t{4} << 20};
  std::vector<unsigned> const depths = {4, 8, 16, 32, 64};
  std::vector<unsigned> const rings  = {1, 2};
  struct point {
    std::size_t block;
    unsigned depth, rings;
    double gb_s;
  };
  auto measure = [&](std::size_t b, unsigned d, unsigned r) {
    io::engine_options eo;
    eo.block_size  = b;
    eo.queue_depth = d;
    eo.rings       = r;
    return point{b, d, r, probe_disk_gb_s(dir, bytes, eo)};
  };
  // The tuner: from the defaults, each setting in turn to its best with the others held; two
  // rounds, so that a setting chosen before another moved is looked at again.
  point best = measure(std::size_t{1} << 20, 32, 1);
  int tried  = 1;
  for (int step = 0; step < 6; ++step) {
    int const axis = step % 3;
    point const start = best;
    auto consider = [&](point p) {
      ++tried;
      if (p.gb_s > best.gb_s) { best = p; }
    };
    if (axis == 0) {
      for (unsigned d : depths) { if (d != start.depth) { consider(measure(start.block, d, start.rings)); } }
    } else if (axis == 1) {
      for (std::size_t b : blocks) { if (b != start.block) { consider(measure(b, start.depth, start.rings)); } }
    } else {
      for (unsigned r : rings) { if (r != start.rings) { consider(measure(start.block, start.depth, r)); } }
    }
  }
  std::printf("io::engine_options eo;  // tierstate-plan --tune-nvme %s\neo.block_size  = %zu;\neo.queue_depth = %u;\neo.rings       = %u;\n",
              dir.c_str(), best.block, best.depth, best.rings);
  double grid_best = NAN;
  std::string grid_point = "null";
  if (exhaustive) {
    point g{0, 0, 0, 0};
    for (auto b : blocks) {
      for (auto d : depths) {
        for (auto r : rings) {
          point const p = measure(b, d, r);
          if (p.gb_s > g.gb_s) { g = p; }
        }
      }
    }
    // The tuner's choice measured again beside the grid's best, alternately: the ratio of two
    // fresh medians, so that the disk's drift over the sweep does not decide it.
    std::vector<double> mine, theirs;
    for (int r = 0; r < 3; ++r) {
      mine.push_back(measure(best.block, best.depth, best.rings).gb_s);
      theirs.push_back(measure(g.block, g.depth, g.rings).gb_s);
    }
    best.gb_s  = median(mine);
    grid_best  = median(theirs);
    char t[96];
    std::snprintf(t, sizeof t, "{\"block_size\":%zu,\"queue_depth\":%u,\"rings\":%u}", g.block, g.depth, g.rings);
    grid_point = t;
  }
  std::printf("{\"bench\":\"tune_nvme\",\"path\":\"%s\",\"scratch_bytes\":%zu,\"points_tried\":%d,\"block_size\":%zu,"
              "\"queue_depth\":%u,\"rings\":%u,\"gb_s\":%.4g,\"grid_best\":%s,\"grid_best_gb_s\":%s,\"ratio\":%s}\n",
              dir.c_str(), bytes, tried, best.block, best.depth, best.rings, best.gb_s, grid_point.c_str(),
              plan::detail::plan_number(grid_best).c_str(),
              plan::detail::plan_number(exhaustive ? best.gb_s / grid_best : NAN).c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv)
{
  plan::job f;
  plan::machine m;
  bool probe = true, json = false, exhaustive = false;
  std::string tune_path, check_path;
  std::size_t scratch = std::size_t{256} << 20;
  for (int i = 1; i < argc; ++i) {
    std::string const a = argv[i];
    if (a == "--help" || a == "-h") {
      std::printf("usage: tierstate-plan --params N [--param bf16|fp16|fp32] [--state fp32|bf16|int8] [--master fp32|kahan|none]\n"
                  "         [--rule adamw|adam|adam_amsgrad|adamw_amsgrad|sgd|sgd_momentum|lion] [--gpu-memory 24GiB]\n"
                  "         [--host-memory 128GiB] [--nvme PATH [--nvme-capacity BYTES]] [--layers L] [--chunk-elements N]\n"
                  "         [--no-probe] [--host-gb-s X] [--disk-gb-s X] [--pcie-gb-s X] [--json]\n"
                  "       tierstate-plan --tune-nvme PATH [--scratch-bytes N] [--exhaustive]\n"
                  "       tierstate-plan --check PATH\n");
      return 0;
    }
    if (a == "--no-probe") { probe = false; continue; }
    if (a == "--json") { json = true; continue; }
    if (a == "--exhaustive") { exhaustive = true; continue; }
    if (i + 1 >= argc) { usage("missing value after " + a); }
    std::string const v = argv[++i];
    if (a == "--params") { f.params = quantity(a, v); }
    else if (a == "--param") { f.param = v; }
    else if (a == "--state") { f.state = v; }
    else if (a == "--master") { f.master = v; }
    else if (a == "--rule") { f.rule = v; }
    else if (a == "--gpu-memory") { m.gpu_bytes = quantity(a, v); }
    else if (a == "--host-memory") { m.host_bytes = quantity(a, v); }
    else if (a == "--nvme") { m.nvme = v; }
    else if (a == "--nvme-capacity") { m.nvme_free = quantity(a, v); }
    else if (a == "--layers") { f.layers = static_cast<int>(quantity(a, v)); }
    else if (a == "--chunk-elements") { f.chunk_elements = static_cast<std::size_t>(quantity(a, v)); }
    else if (a == "--host-gb-s") { m.host_gb_s = quantity(a, v); m.host_source = "given"; }
    else if (a == "--disk-gb-s") { m.disk_gb_s = quantity(a, v); m.disk_source = "given"; }
    else if (a == "--pcie-gb-s") { m.pcie_gb_s = quantity(a, v); m.pcie_source = "given"; }
    else if (a == "--tune-nvme") { tune_path = v; }
    else if (a == "--check") { check_path = v; }
    else if (a == "--scratch-bytes") { scratch = static_cast<std::size_t>(quantity(a, v)) / 4096 * 4096; }
    else { usage("unknown option " + a); }
  }
  try {
    if (!tune_path.empty()) { return tune(tune_path, std::max<std::size_t>(scratch, 4096), exhaustive); }
    if (!check_path.empty()) { return check(check_path, 5); }
    if (f.params <= 0) { usage("--params N is needed (e.g. 7e9, 70B)"); }
    f.validate();
#if !defined(TIERSTATE_ENABLE_CUDA)
    if (probe && m.pcie_gb_s == 0) {
      std::string why;
      if (auto const g = probe_pcie_runtime(why)) {
        m.pcie_gb_s = *g, m.pcie_source = "measured";
      } else {
        m.pcie_gb_s = 25, m.pcie_source = why;
      }
    }
#endif
    plan::measure(m, f, probe, scratch);
    auto const rows = plan::compositions(f, m);
    std::fputs((json ? plan::json_lines(f, m, rows) : plan::table(f, m, rows)).c_str(), stdout);
  } catch (invalid_option const& e) {
    usage(e.what());
  } catch (std::exception const& e) {
    std::fprintf(stderr, "tierstate-plan: %s\n", e.what());
    return 1;
  }
  return 0;
}
