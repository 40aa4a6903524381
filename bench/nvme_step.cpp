// SPDX-License-Identifier: Apache-2.0
// nvme_step: OffloadedOptimizer<AdamW, Bf16Mixed, NvmeFile, Pipelined<Depth>>::step against
// fio on the same path, and host memory against model size.
//
// With no arguments it makes a fresh directory under /tmp (or inside --path DIR), runs two
// model sizes, each in its own process (the larger with 4x the elements, and a state at
// least 16x the largest staging ring), and prints one JSON line per configuration:
//   seconds_per_step  median over --steps timed steps, after one warm-up step
//   io_gb_s           state bytes read plus written per step, per second
//   fio_gb_s          fio on the same path: --ioengine=io_uring --direct=1 --rw=rw
//                     --rwmixread=50 --bs=<chunk_bytes> --iodepth=<queue_depth>
//                     --size=<state_bytes> (the command is printed as fio_command)
//                     (median of runs interleaved with the timed steps, one after every
//                     other step)
//   fio_best_gb_s     fio's best over bs {256K, 1M, 4M} x iodepth {4, 32}: the best of one
//                     pass over them, then its median over runs interleaved with the steps
//   io_over_fio_best  io_gb_s / fio_best_gb_s
//   peak_rss_mb       the process's peak resident memory during the configuration
//   model_rss_mb      the params and grads the benchmark itself allocates
//   default           true on the row with the library's default settings
// Where fio is missing the fio fields are null, except under CI=true, where it is an error.
//
//   nvme_step [--path DIR] [--elements N] [--steps S] [--threads T] [--block-size B]
//             [--queue-depth Q] [--no-fio]
//   (--elements N runs one size in this process)
#include <tierstate/tierstate.hpp>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

namespace {

using namespace tierstate;
using Clock = std::chrono::steady_clock;

struct options {
  std::string path;            // where the fresh directory goes
  std::size_t elements = 0;    // 0: both sizes, each in a child process
  int steps            = 5;
  std::size_t threads  = 0;
  std::size_t block_size = 0;   // 0: the engine's default
  unsigned queue_depth   = 0;   // 0: the engine's default
  bool skip_fio          = false;
  std::string directory;       // the fresh directory itself (set for children)
};

constexpr char const* usage_text =
  "usage: nvme_step [--path DIR] [--elements N >= 4096] [--steps S (1..1000)] [--threads T (0..4096)] "
  "[--block-size B] [--queue-depth Q] [--no-fio] [--help]\n";

[[noreturn]] void usage_error(std::string const& what)
{
  std::fprintf(stderr, "nvme_step: %s\n%s", what.c_str(), usage_text);
  std::exit(2);
}

options parse(int argc, char** argv)
{
  options o;
  auto value = [&](int& i) -> std::string {
    if (i + 1 >= argc) { usage_error(std::string(argv[i]) + " needs a value"); }
    return argv[++i];
  };
  // A decimal integer in [lo, hi]: digits only, nothing after them, no overflow.
  auto number = [&](int& i, unsigned long long lo, unsigned long long hi) -> unsigned long long {
    std::string const flag = argv[i];
    std::string const text = value(i);
    unsigned long long v   = 0;
    auto const [end, ec]   = std::from_chars(text.data(), text.data() + text.size(), v);
    if (text.empty() || (ec != std::errc{} && ec != std::errc::result_out_of_range) || end != text.data() + text.size()) {
      usage_error(flag + " " + (text.empty() ? "\"\"" : text) + ": not a non-negative integer");
    }
    if (ec == std::errc::result_out_of_range || v < lo || v > hi) {
      usage_error(flag + " " + text + ": out of range (" + std::to_string(lo) + ".." + std::to_string(hi) + ")");
    }
    return v;
  };
  for (int i = 1; i < argc; ++i) {
    std::string const a = argv[i];
    if (a == "--help" || a == "-h") {
      std::printf("%s", usage_text);
      std::exit(0);
    } else if (a == "--path") {
      o.path = value(i);
    } else if (a == "--directory") {  // internal: the parent's fresh directory
      o.directory = value(i);
    } else if (a == "--elements") {
      o.elements = number(i, 4096, std::size_t{1} << 40);
    } else if (a == "--steps") {
      o.steps = static_cast<int>(number(i, 1, 1000));
    } else if (a == "--threads") {
      o.threads = number(i, 0, 4096);
    } else if (a == "--block-size") {
      o.block_size = number(i, 0, std::size_t{1} << 40);
    } else if (a == "--queue-depth") {
      o.queue_depth = static_cast<unsigned>(number(i, 0, 1u << 20));
    } else if (a == "--no-fio") {
      o.skip_fio = true;
    } else {
      usage_error("unknown argument " + a);
    }
  }
  return o;
}

double median(std::vector<double> v)
{
  std::sort(v.begin(), v.end());
  return v.size() % 2 == 1 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

/// VmHWM (the peak resident set) in MiB, after `reset_peak_rss()` if it was called.
double peak_rss_mb()
{
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmHWM:", 0) == 0) { return std::strtod(line.c_str() + 6, nullptr) / 1024.0; }
  }
  return -1;
}
void reset_peak_rss() { std::ofstream("/proc/self/clear_refs") << "5"; }

bool in_ci()
{
  char const* ci = std::getenv("CI");
  return ci != nullptr && std::string(ci) == "true";
}

std::string json_string(std::string const& s)
{
  std::string out = "\"";
  for (char const c : s) {
    if (c == '"' || c == '\\') { out += '\\'; }
    out += c;
  }
  return out + "\"";
}

// --- fio --------------------------------------------------------------------------------

struct fio_result {
  double gb_s = 0;
  std::string command;
};

bool have_fio() { return std::system("fio --version >/dev/null 2>&1") == 0; }

/// Runs fio's mixed read/write on `file`; nullopt when fio fails.
std::optional<fio_result> run_fio(std::string const& file, std::size_t bs, unsigned iodepth, std::size_t size)
{
  std::ostringstream cmd;
  cmd << "fio --name=nvme_step --filename=" << file << " --ioengine=io_uring --direct=1 --rw=rw"
      << " --rwmixread=50 --bs=" << bs << " --iodepth=" << iodepth << " --size=" << size;
  fio_result r;
  r.command = cmd.str();
  std::string const full = r.command + " --output-format=terse --terse-version=3 2>&1";
  FILE* p = ::popen(full.c_str(), "r");
  if (p == nullptr) { return std::nullopt; }
  std::string out;
  char buf[4096];
  while (std::fgets(buf, sizeof(buf), p) != nullptr) { out += buf; }
  if (::pclose(p) != 0) {
    std::fprintf(stderr, "nvme_step: fio failed: %s\n%s\n", r.command.c_str(), out.c_str());
    return std::nullopt;
  }
  // Terse v3: field 7 is the read bandwidth, field 48 the write bandwidth, in KiB/s.
  std::string line = out.substr(out.rfind("3;", out.size() - 2) == std::string::npos ? 0 : out.rfind("\n3;") + 1);
  std::vector<std::string> f;
  std::stringstream ss(line);
  for (std::string x; std::getline(ss, x, ';');) { f.push_back(x); }
  if (f.size() < 50) {
    std::fprintf(stderr, "nvme_step: cannot read fio's output:\n%s\n", out.c_str());
    return std::nullopt;
  }
  r.gb_s = (std::strtod(f[6].c_str(), nullptr) + std::strtod(f[47].c_str(), nullptr)) * 1024.0 / 1e9;
  return r;
}

// --- one size ---------------------------------------------------------------------------

struct fio_refs {
  std::optional<fio_result> same;  // bs = chunk bytes, iodepth = queue depth
  double best = 0;
  std::size_t best_bs = 0;
  unsigned best_depth = 0;
};

std::string number_or_null(std::optional<double> v)
{
  if (!v) { return "null"; }
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.4g", *v);
  return buf;
}

/// The best fio configuration of bs {256K, 1M, 4M} x iodepth {4, 32}, on a state-sized file.
fio_refs best_fio(std::string const& file, std::size_t size)
{
  fio_refs ref;
  for (std::size_t const bs : {std::size_t{256} << 10, std::size_t{1} << 20, std::size_t{4} << 20}) {
    for (unsigned const d : {4u, 32u}) {
      if (bs > size) { continue; }  // fio refuses a file smaller than one block
      auto const r = run_fio(file, bs, d, size);
      if (r && r->gb_s > ref.best) {
        ref.best       = r->gb_s;
        ref.best_bs    = bs;
        ref.best_depth = d;
      }
    }
  }
  return ref;
}

template <unsigned Depth>
void run_config(options const& o, std::string const& dir, std::vector<bf16>& params, std::vector<bf16> const& grads,
                bool fio, bool is_default, fio_refs& best)
{
  using Opt = OffloadedOptimizer<AdamW, Bf16Mixed, NvmeFile, Pipelined<Depth>>;
  reset_peak_rss();
  typename Opt::options opt_options;
  opt_options.threads        = o.threads;
  opt_options.tier.directory = dir;
  if (o.block_size != 0) { opt_options.tier.io.block_size = o.block_size; }
  if (o.queue_depth != 0) { opt_options.tier.io.queue_depth = o.queue_depth; }
  is_default = is_default && o.block_size == 0 && o.queue_depth == 0;
  typename Opt::hyperparameters h;
  h.lr = 1e-4;
  Opt opt(h, opt_options);
  opt.add_tensor("w", params.data(), params.size());
  std::vector<grad_view<bf16>> const views = {{grads.data(), grads.size()}};
  opt.step(views);  // warm-up; also builds and reserves the state
  auto const& lay  = opt.state_layout();
  auto const t_start = Clock::now();
  if (fio && best.best == 0) {
    best = best_fio(dir + "/fio.scratch", lay.total_bytes());
    if (best.best == 0 && in_ci()) {
      std::fprintf(stderr, "nvme_step: fio failed under CI=true\n");
      std::exit(1);
    }
  }
  unsigned const qd = opt_options.tier.io.queue_depth;
  std::string const fio_file = dir + "/fio.scratch";

  // Steps and fio runs interleaved, so both see the same disk weather; medians of each.
  std::vector<double> seconds, compute, wait, fio_runs, best_runs;
  std::uint64_t bytes = 0;
  std::optional<fio_result> same;
  for (int s = 0; s < o.steps; ++s) {
    auto const t0 = Clock::now();
    auto const r  = opt.step(views);
    seconds.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    compute.push_back(r.stats.compute_seconds);
    wait.push_back(r.stats.wait_seconds);
    bytes = r.stats.tier_bytes_read + r.stats.tier_bytes_written;
    if (s % 2 == 1) { continue; }  // fio after steps 1, 3, 5, ...: a median of 3 for 5 steps
    if (fio && best.best > 0) {
      if (auto const b = run_fio(fio_file, best.best_bs, best.best_depth, lay.total_bytes())) {
        best_runs.push_back(b->gb_s);
      }
    }
    if (fio) {
      same = run_fio(fio_file, lay.chunk_bytes(), qd, lay.total_bytes());
      if (!same) {
        if (in_ci()) {
          std::fprintf(stderr, "nvme_step: fio failed under CI=true\n");
          std::exit(1);
        }
        fio = false;
      } else {
        fio_runs.push_back(same->gb_s);
      }
    }
  }
  double const peak     = peak_rss_mb();
  std::fprintf(stderr, "nvme_step: Pipelined<%u>, %zu elements: %.1f s\n", Depth, params.size(),
               std::chrono::duration<double>(Clock::now() - t_start).count());
  auto const& tier      = opt.state_tier();
  double const sps      = median(seconds);
  double const io_gb_s  = static_cast<double>(bytes) / sps / 1e9;
  double const model_mb = static_cast<double>((params.size() + grads.size()) * sizeof(bf16)) / (1 << 20);

  std::optional<double> fio_gb_s, fio_ratio, best_gb_s, best_ratio;
  if (!fio_runs.empty()) {
    fio_gb_s  = median(fio_runs);
    fio_ratio = io_gb_s / *fio_gb_s;
  }
  if (!best_runs.empty()) {
    best_gb_s  = median(best_runs);
    best_ratio = io_gb_s / *best_gb_s;
  }
  std::printf(
    "{\"bench\":\"nvme_step\",\"rule\":\"AdamW\",\"precision\":\"%s\",\"transfer\":\"Pipelined<%u>\","
    "\"depth\":%u,\"default\":%s,\"elements\":%zu,\"state_bytes\":%zu,\"staging_bytes\":%zu,"
    "\"chunk_bytes\":%zu,\"queue_depth\":%u,\"block_size\":%zu,\"io_backend\":\"%s\",\"direct\":%s,"
    "\"threads\":%zu,\"steps\":%d,\"seconds_per_step\":%.4f,\"compute_seconds\":%.4f,\"wait_seconds\":%.4f,"
    "\"io_gb_s\":%.4g,\"fio_gb_s\":%s,\"fio_ratio\":%s,\"fio_best_gb_s\":%s,\"io_over_fio_best\":%s,"
    "\"fio_best_bs\":%zu,\"fio_best_iodepth\":%u,\"peak_rss_mb\":%.1f,\"model_rss_mb\":%.1f,"
    "\"rss_over_model_mb\":%.1f,\"fio_command\":%s}\n",
    Bf16Mixed::name().c_str(), Depth, Depth, is_default ? "true" : "false", params.size(),
    lay.total_bytes(), opt.staging_bytes(), lay.chunk_bytes(), qd, opt_options.tier.io.block_size,
    std::string(io::backend_name(opt_options.tier.io.backend)).c_str(), tier.direct() ? "true" : "false",
    opt.pool().size(), o.steps, sps, median(compute), median(wait), io_gb_s, number_or_null(fio_gb_s).c_str(),
    number_or_null(fio_ratio).c_str(), number_or_null(best_gb_s).c_str(), number_or_null(best_ratio).c_str(),
    best.best_bs, best.best_depth, peak, model_mb, peak - model_mb,
    same ? json_string(same->command).c_str() : "null");
  std::fflush(stdout);
}

int run_size(options const& o, std::string const& dir)
{
  bool const fio = !o.skip_fio && have_fio();
  if (!fio) {
    if (in_ci()) {
      std::fprintf(stderr, "nvme_step: fio is not installed, and CI=true needs its reference (apt-get install fio)\n");
      return 1;
    }
    std::fprintf(stderr, "nvme_step: fio is not installed: the fio fields are null\n");
  }
  std::vector<bf16> params(o.elements), grads(o.elements);
  for (std::size_t i = 0; i < params.size(); ++i) {
    params[i] = bf16(static_cast<float>(i % 1000) * 1e-3f - 0.5f);
    grads[i]  = bf16(static_cast<float>(i % 777) * 1e-4f - 0.03f);
  }
  fio_refs best;  // searched once, by the first configuration, on the layout's real size
  // Ascending staging, so each row's peak belongs to its own configuration.
  run_config<1>(o, dir, params, grads, fio, false, best);
  run_config<2>(o, dir, params, grads, fio, true, best);  // Pipelined<> and every default option
  run_config<3>(o, dir, params, grads, fio, false, best);
  std::filesystem::remove(dir + "/fio.scratch");
  return 0;
}

}  // namespace

int main(int argc, char** argv)
{
  options o = parse(argc, argv);
  try {
    if (!o.directory.empty()) { return run_size(o, o.directory); }
    std::filesystem::path const parent = o.path.empty() ? std::filesystem::path("/tmp") : std::filesystem::path(o.path);
    std::string dir = (parent / "nvme_step-XXXXXX").string();
    if (::mkdtemp(dir.data()) == nullptr) {
      std::fprintf(stderr, "nvme_step: cannot make a directory in %s: %s\n", parent.c_str(), std::strerror(errno));
      return 1;
    }
    int result = 0;
    // Default: 20M and 80M elements (240 and 960 MiB of state: 16x the largest staging ring,
    // Pipelined<3>'s 5 chunks of 12 MiB).
    std::vector<std::size_t> const sizes =
      o.elements != 0 ? std::vector<std::size_t>{o.elements} : std::vector<std::size_t>{20u << 20, 80u << 20};
    for (std::size_t const n : sizes) {
      // Each size in its own process, so the peak resident memory is its own.
      std::fflush(stdout);
      pid_t const child = ::fork();
      if (child == 0) {
        std::vector<std::string> args = {"/proc/self/exe", "--directory", dir, "--elements", std::to_string(n),
                                         "--steps", std::to_string(o.steps), "--threads", std::to_string(o.threads),
                                         "--block-size", std::to_string(o.block_size),
                                         "--queue-depth", std::to_string(o.queue_depth)};
        if (o.skip_fio) { args.push_back("--no-fio"); }
        std::vector<char*> argv_child;
        for (auto& a : args) { argv_child.push_back(a.data()); }
        argv_child.push_back(nullptr);
        ::execv("/proc/self/exe", argv_child.data());
        std::perror("nvme_step: exec");
        std::_Exit(127);
      }
      int status = 0;
      ::waitpid(child, &status, 0);
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) { result = 1; }
    }
    std::filesystem::remove_all(dir);
    return result;
  } catch (std::exception const& e) {
    std::fprintf(stderr, "nvme_step: %s\n", e.what());
    return 1;
  }
}
