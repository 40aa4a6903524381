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
// tierstate's own I/O engine (reads and writes at once), and PCIe where a GPU is (not in a build
// without CUDA: --pcie-gb-s, default 25, is then assumed and said so).
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

#include <fcntl.h>
#include <sys/statvfs.h>
#include <unistd.h>

namespace {

using namespace tierstate;
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

struct format {
  std::string param = "bf16", state = "fp32", master = "fp32", rule = "adamw";

  [[nodiscard]] double param_bytes() const { return param == "fp32" ? 4 : 2; }
  [[nodiscard]] double master_bytes() const
  {
    if (param == "fp32" || master == "none") { return 0; }
    return master == "kahan" ? 2 : 4;
  }
  [[nodiscard]] int slots() const
  {
    if (rule == "adam" || rule == "adamw") { return 2; }
    if (rule == "adam_amsgrad" || rule == "adamw_amsgrad") { return 3; }
    if (rule == "sgd_momentum" || rule == "lion") { return 1; }
    return 0;  // sgd
  }
  /// A slot element: fp32, bf16, or 8 bits with an fp32 scale per block of 256 (codecs/dynamic8.hpp).
  [[nodiscard]] double slot_bytes() const { return state == "fp32" ? 4 : state == "bf16" ? 2 : 1 + 4.0 / 256; }
  /// The optimizer state per element: master and slots.
  [[nodiscard]] double state_bytes() const { return master_bytes() + slots() * slot_bytes(); }
  /// What the host update reads and writes per element: the state twice, the gradient, the param.
  [[nodiscard]] double host_traffic() const { return 2 * state_bytes() + 2 * param_bytes() + (param == "fp32" ? 4 : 0); }
};

struct machine {
  double gpu = 24.0 * (1ull << 30), host = 128.0 * (1ull << 30);
  std::string nvme;
  std::optional<double> nvme_free;
  double host_gb_s = 0, disk_gb_s = 0, pcie_gb_s = 25;
  std::string host_source = "assumed", disk_source = "assumed", pcie_source = "assumed (no GPU in this build)";
};

/// Host memory bandwidth over the step's traffic (28 bytes an element of fp32 AdamW: four
/// arrays read, three written), on every CPU, over `n` elements (a model's, up to 2^26: 1 GiB,
/// beyond any cache); median of 5.
double probe_host_gb_s(thread_pool& pool, std::size_t n)
{
  // Four arrays, as the state tier's memory is (huge pages where the kernel gives them).
  PinnedHost mem(4 * n * sizeof(float));
  float* const pp = reinterpret_cast<float*>(mem.data());
  pool.parallel_for(n, 4096, [&](std::size_t b, std::size_t e) {  // first touch by the threads that use them
    for (std::size_t i = b; i < e; ++i) {
      pp[i] = 1.0f, pp[n + i] = 1e-3f, pp[2 * n + i] = 0.0f, pp[3 * n + i] = 0.0f;
    }
  });
  auto pass = [&] {
    pool.parallel_for(n, 4096, [&](std::size_t b, std::size_t e) {
      float* __restrict p       = pp;
      float const* __restrict g = pp + n;
      float* __restrict m       = pp + 2 * n;
      float* __restrict v       = pp + 3 * n;
      for (std::size_t i = b; i < e; ++i) {
        float const gi = g[i];
        float const mi = std::fma(0.9f, m[i], 0.1f * gi);
        m[i]           = mi;
        v[i]           = std::fma(0.999f, v[i], 0.001f * gi * gi);
        p[i]           = std::fma(-1e-6f, mi, p[i]);
      }
    });
  };
  pass();
  std::vector<double> t;
  for (int r = 0; r < 5; ++r) {
    auto const t0 = clk::now();
    pass();
    t.push_back(std::chrono::duration<double>(clk::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return 28.0 * static_cast<double>(n) / t[t.size() / 2] / 1e9;
}

/// The disk under `dir` through tierstate's engine: `bytes` read and `bytes` written at once,
/// in pieces of `piece`, with options `eo`, on a nameless O_DIRECT scratch file; median of `reps`.
double probe_disk_gb_s(std::string const& dir, std::size_t bytes, io::engine_options const& eo, std::size_t piece = 4u << 20,
                       int reps = 3)
{
  int fd = ::open(dir.c_str(), O_TMPFILE | O_RDWR | O_DIRECT | O_CLOEXEC, 0600);
  if (fd < 0) { throw io_error(errno, dir, "open(O_TMPFILE | O_DIRECT)", 0, 0, "the planner's scratch file"); }
  if (::posix_fallocate(fd, 0, static_cast<off_t>(2 * bytes)) != 0) {
    ::close(fd);
    throw io_error(ENOSPC, dir, "fallocate", 0, 2 * bytes, "the planner's scratch file");
  }
  PinnedHost buf(2 * bytes);
  std::memset(buf.data(), 1, buf.size());
  io::engine engine(eo);
  std::vector<io::request> writes, mixed;
  for (std::size_t at = 0; at < 2 * bytes; at += piece) {  // the file written once, so reads read data
    writes.push_back({fd, at, buf.data() + at, std::min(piece, 2 * bytes - at), true, &dir});
  }
  engine.submit(writes);
  for (std::size_t at = 0; at < bytes; at += piece) {  // then the first half read while the second is written
    std::size_t const len = std::min(piece, bytes - at);
    mixed.push_back({fd, at, buf.data() + at, len, false, &dir});
    mixed.push_back({fd, bytes + at, buf.data() + bytes + at, len, true, &dir});
  }
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    auto const t0 = clk::now();
    engine.submit(mixed);
    t.push_back(std::chrono::duration<double>(clk::now() - t0).count());
  }
  ::close(fd);
  std::sort(t.begin(), t.end());
  return 2.0 * static_cast<double>(bytes) / t[t.size() / 2] / 1e9;
}

struct row {
  std::string name{}, fits_text{};
  bool fits = false;
  double gpu = 0, host = 0, nvme = 0, memlock = 0;
  double compute_s = 0, disk_s = 0, pcie_s = 0, step_s = 0;
  std::string bound{};
};

std::string gib(double b)
{
  char t[32];
  if (b > 0 && b < (1ull << 30)) {
    std::snprintf(t, sizeof t, "%.0f MiB", b / (1ull << 20));
  } else {
    std::snprintf(t, sizeof t, "%.1f GiB", b / (1ull << 30));
  }
  return t;
}

std::vector<row> plan(double n, format const& f, machine const& m, std::size_t chunk, unsigned depth, int layers)
{
  double const p = f.param_bytes(), s = f.state_bytes();
  double const staging = (depth + 2.0) * static_cast<double>(chunk) * s;   // NvmeFile's ring
  double const pcie_rings = (depth + 2.0) * static_cast<double>(chunk) * 2 * p;  // CudaOverlapped's gradients and params
  double const compute = n * f.host_traffic() / (m.host_gb_s * 1e9);
  double const pcie    = n * 2 * p / (m.pcie_gb_s * 1e9);
  double const disk    = m.disk_gb_s > 0 ? n * 2 * s / (m.disk_gb_s * 1e9) : NAN;
  std::vector<row> rows;
  auto fill = [&](row r) {
    std::string why;
    if (r.gpu > 0.9 * m.gpu) { why += "GPU "; }
    if (r.host > 0.9 * m.host) { why += "host "; }
    if (r.nvme > 0 && (m.nvme.empty() || (m.nvme_free && r.nvme > 0.9 * *m.nvme_free))) { why += "NVMe "; }
    r.fits      = why.empty();
    r.fits_text = r.fits ? "yes" : "no (" + why.substr(0, why.size() - 1) + ")";
    r.step_s    = std::max({r.compute_s, r.disk_s, r.pcie_s});
    r.bound     = r.step_s == r.disk_s ? "disk" : r.step_s == r.pcie_s ? "PCIe" : "host memory";
    rows.push_back(r);
  };
  fill({.name = "all on the GPU (no offload)", .gpu = n * (2 * p + s), .compute_s = 0, .bound = "GPU"});
  rows.back().bound = "GPU (not predicted)";
  fill({.name = "state in PinnedHost (ZeRO-Offload)", .gpu = n * 2 * p, .host = n * s + pcie_rings,
        .memlock = 0, .compute_s = compute, .pcie_s = pcie});
  fill({.name = "state in NvmeFile (ZeRO-Infinity)", .gpu = n * 2 * p, .host = staging + pcie_rings,
        .nvme = n * s, .memlock = staging, .compute_s = compute, .disk_s = disk, .pcie_s = pcie});
  double const window = 2.0 * n / layers * 2 * p;  // two layers' params and gradients
  fill({.name = "state and weights in NvmeFile (offload_parameters)", .gpu = window, .host = staging + pcie_rings + window,
        .nvme = n * (s + p), .memlock = staging, .compute_s = compute, .disk_s = m.disk_gb_s > 0 ? n * (2 * s + 2 * p) / (m.disk_gb_s * 1e9) : NAN,
        .pcie_s = pcie});
  return rows;
}

/// `v` as a JSON number, or null where it is not finite.
std::string num(double v)
{
  if (!std::isfinite(v)) { return "null"; }
  char t[32];
  std::snprintf(t, sizeof t, "%.4g", v);
  return t;
}

/// The median of `v`.
double median(std::vector<double> v)
{
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

/// --check: the plan's predicted step time against the measured one, in the same run, for a
/// host_step-sized run (2^24 elements, fp32 AdamW, PinnedHost) and an nvme_step-sized one
/// (20,971,520 elements, bf16-mixed AdamW, NvmeFile + Pipelined<2> in `dir`): each round runs
/// the probes, then the step; medians over `rounds`. One JSON line each; exit status 0 whatever
/// the ratios (an error is 1).
int check(std::string const& dir, int rounds)
{
  thread_pool pool;
  auto run = [&]<class Optimizer>(std::type_identity<Optimizer>, char const* name, std::size_t n, format const& f,
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
    machine m;
    m.host_gb_s = median(host);
    m.disk_gb_s = on_disk ? median(disk) : 0;
    double const d         = static_cast<double>(n);
    double const compute   = d * f.host_traffic() / (m.host_gb_s * 1e9);
    double const io        = on_disk ? d * 2 * f.state_bytes() / (m.disk_gb_s * 1e9) : 0;
    double const predicted = std::max(compute, io);
    double const measured  = median(steps);
    std::printf("{\"bench\":\"plan_check\",\"case\":\"%s\",\"elements\":%zu,\"rounds\":%d,\"host_gb_s\":%.4g,"
                "\"disk_gb_s\":%.4g,\"predicted_seconds\":%.4g,\"measured_seconds\":%.4g,\"ratio\":%.4f,"
                "\"within_25_percent\":%s}\n",
                name, n, rounds, m.host_gb_s, m.disk_gb_s, predicted, measured, predicted / measured,
                std::abs(predicted / measured - 1) <= 0.25 ? "true" : "false");
    std::fflush(stdout);
    return std::abs(predicted / measured - 1) <= 0.25;
  };
  format fp32_params;
  fp32_params.param = "fp32";
  format bf16_params;
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
              num(grid_best).c_str(), num(exhaustive ? best.gb_s / grid_best : NAN).c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv)
{
  double n = 0;
  format f;
  machine m;
  std::size_t chunk = layout::default_chunk_elements;
  int layers        = 32;
  bool probe = true, json = false, exhaustive = false;
  std::string tune_path, check_path;
  std::size_t scratch = std::size_t{256} << 20;
  for (int i = 1; i < argc; ++i) {
    std::string const a = argv[i];
    if (a == "--help" || a == "-h") {
      std::printf("usage: tierstate-plan --params N [--param bf16|fp16|fp32] [--state fp32|bf16|int8] [--master fp32|kahan|none]\n"
                  "         [--rule adamw|adam|adam_amsgrad|sgd|sgd_momentum|lion] [--gpu-memory 24GiB] [--host-memory 128GiB]\n"
                  "         [--nvme PATH [--nvme-capacity BYTES]] [--layers L] [--chunk-elements N] [--no-probe]\n"
                  "         [--host-gb-s X] [--disk-gb-s X]\n"
                  "         [--pcie-gb-s X] [--json]\n"
                  "       tierstate-plan --tune-nvme PATH [--scratch-bytes N] [--exhaustive]\n");
      return 0;
    }
    if (a == "--no-probe") { probe = false; continue; }
    if (a == "--json") { json = true; continue; }
    if (a == "--exhaustive") { exhaustive = true; continue; }
    if (i + 1 >= argc) { usage("missing value after " + a); }
    std::string const v = argv[++i];
    if (a == "--params") { n = quantity(a, v); }
    else if (a == "--param" && (v == "bf16" || v == "fp16" || v == "fp32")) { f.param = v; }
    else if (a == "--state" && (v == "fp32" || v == "bf16" || v == "int8")) { f.state = v; }
    else if (a == "--master" && (v == "fp32" || v == "kahan" || v == "none")) { f.master = v; }
    else if (a == "--rule" && (v == "adamw" || v == "adam" || v == "adam_amsgrad" || v == "adamw_amsgrad" || v == "sgd" ||
                               v == "sgd_momentum" || v == "lion")) { f.rule = v; }
    else if (a == "--gpu-memory") { m.gpu = quantity(a, v); }
    else if (a == "--host-memory") { m.host = quantity(a, v); }
    else if (a == "--nvme") { m.nvme = v; }
    else if (a == "--nvme-capacity") { m.nvme_free = quantity(a, v); }
    else if (a == "--layers") { layers = static_cast<int>(quantity(a, v)); }
    else if (a == "--chunk-elements") { chunk = static_cast<std::size_t>(quantity(a, v)); }
    else if (a == "--host-gb-s") { m.host_gb_s = quantity(a, v); m.host_source = "given"; }
    else if (a == "--disk-gb-s") { m.disk_gb_s = quantity(a, v); m.disk_source = "given"; }
    else if (a == "--pcie-gb-s") { m.pcie_gb_s = quantity(a, v); m.pcie_source = "given"; }
    else if (a == "--tune-nvme") { tune_path = v; }
    else if (a == "--check") { check_path = v; }
    else if (a == "--scratch-bytes") { scratch = static_cast<std::size_t>(quantity(a, v)) / 4096 * 4096; }
    else { usage("bad argument " + a + " " + v); }
  }
  try {
    if (!tune_path.empty()) { return tune(tune_path, scratch, exhaustive); }
    if (!check_path.empty()) { return check(check_path, 5); }
    if (n <= 0) { usage("--params N is needed (e.g. 7e9, 70B)"); }
    if (!m.nvme.empty() && !m.nvme_free) {
      struct statvfs st{};
      if (::statvfs(m.nvme.c_str(), &st) != 0) { throw io_error(errno, m.nvme, "statvfs", 0, 0, "--nvme"); }
      m.nvme_free = static_cast<double>(st.f_bavail) * static_cast<double>(st.f_frsize);
    }
    if (probe) {
      thread_pool pool;
      if (m.host_gb_s == 0) {
        m.host_gb_s   = probe_host_gb_s(pool, static_cast<std::size_t>(std::min(n, std::ldexp(1.0, 26))));
        m.host_source = "measured";
      }
      if (m.disk_gb_s == 0 && !m.nvme.empty()) { m.disk_gb_s = probe_disk_gb_s(m.nvme, scratch, {}); m.disk_source = "measured"; }
    }
    if (m.host_gb_s == 0) { m.host_gb_s = 20; }
    auto const rows = plan(n, f, m, chunk, 2, layers);
    if (json) {
      for (auto const& r : rows) {
        std::printf("{\"plan\":\"%s\",\"params\":%.0f,\"fits\":%s,\"gpu_bytes\":%.0f,\"host_bytes\":%.0f,\"nvme_bytes\":%.0f,"
                    "\"memlock_bytes\":%.0f,\"step_seconds\":%s,\"bound\":\"%s\",\"host_gb_s\":%.3g,\"disk_gb_s\":%s,"
                    "\"pcie_gb_s\":%.3g}\n",
                    r.name.c_str(), n, r.fits ? "true" : "false", r.gpu, r.host, r.nvme, r.memlock,
                    num(r.step_s == 0 ? NAN : r.step_s).c_str(), r.bound.c_str(), m.host_gb_s,
                    num(m.disk_gb_s > 0 ? m.disk_gb_s : NAN).c_str(), m.pcie_gb_s);
      }
      return 0;
    }
    std::printf("%.3g parameters, %s params, %s state, %s master, %s; GPU %s, host %s%s\n", n, f.param.c_str(), f.state.c_str(),
                f.master.c_str(), f.rule.c_str(), gib(m.gpu).c_str(), gib(m.host).c_str(),
                m.nvme.empty() ? "" : (", NVMe " + m.nvme + " (" + gib(m.nvme_free.value_or(0)) + " free)").c_str());
    std::printf("bandwidths: host memory %.1f GB/s (%s), disk %.2f GB/s (%s), PCIe %.0f GB/s (%s)\n\n", m.host_gb_s,
                m.host_source.c_str(), m.disk_gb_s, m.disk_source.c_str(), m.pcie_gb_s, m.pcie_source.c_str());
    std::printf("%-52s %-14s %11s %11s %11s %11s %10s  %s\n", "composition", "fits", "GPU", "host", "NVMe", "memlock",
                "step", "bound by");
    for (auto const& r : rows) {
      char step[32];
      if (std::isnan(r.step_s) || r.step_s == 0) {
        std::snprintf(step, sizeof step, "-");
      } else {
        std::snprintf(step, sizeof step, "%.2f s", r.step_s);
      }
      std::printf("%-52s %-14s %11s %11s %11s %11s %10s  %s\n", r.name.c_str(), r.fits_text.c_str(), gib(r.gpu).c_str(),
                  gib(r.host).c_str(), gib(r.nvme).c_str(), gib(r.memlock).c_str(), step, r.bound.c_str());
    }
  } catch (std::exception const& e) {
    std::fprintf(stderr, "tierstate-plan: %s\n", e.what());
    return 1;
  }
  return 0;
}
