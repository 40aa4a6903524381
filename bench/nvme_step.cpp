// SPDX-License-Identifier: Apache-2.0
// nvme_step: OffloadedOptimizer<AdamW, Bf16Mixed, NvmeFile, Pipelined<Depth>>::step (and two compact precisions) against
// the best that fio (and DeepSpeed's ds_io, where installed) gets from the same path for the
// same bytes, and host memory against model size.
//
// A step reads the whole state once and writes it once, in pieces of at most the engine's
// block size, queue depth pieces in flight. Every bandwidth below is in the step's units:
// state bytes read plus written per second (GB = 1e9 bytes), so that each reference is the
// time some tool needs for the step's own bytes.
//
// With no arguments it makes a fresh directory under /tmp (or inside --path DIR), runs two
// model sizes, each in its own process (the larger with 4x the elements, and a state at
// least 16x the largest staging ring), and prints one JSON line per configuration:
//   seconds_per_step  median over --steps timed steps, after one warm-up step
//   io_gb_s           state bytes read plus written per step, per second
//   compute_seconds   median per step of the time the rule ran on the staging buffers
//   wait_seconds      median per step of the time the step waited for the tier's reads and
//                     writes (what the pipeline did not hide)
//   check_seconds     median per step of the gradients' inf/NaN check, before the pipeline:
//                     with compute and wait, the whole step (a fixed cost per element, which
//                     a compact row's fewer state bytes do not shrink)
//   io_seconds        the step's bytes at limit_gb_s: how long the I/O alone needs
//   compute_bound     compute_seconds > io_seconds: the disk waits for the compute, and the
//                     I/O references are not this row's bound (also a warning on stderr)
//   limit_gb_s        the best of the references below
//   limit_ratio       io_gb_s / limit_gb_s; above 1.03 a warning on stderr (something beat
//                     the limit by more than noise)
//   limit_source      the reference that gave limit_gb_s: its field's name without "_gb_s"
//   fio_<pattern>_gb_s
//                     fio on a state-sized file in the same directory (io_uring, O_DIRECT,
//                     --size=<state_bytes>) at the engine's block size (at most the state)
//                     and queue depth (the command is printed as fio_command), moving the
//                     state's bytes as
//                       mixed       one job, --rw=rw --rwmixread=50 (the bytes once, half
//                                   each way: its GB/s counts both directions)
//                       phases      a read-only job over the file, then a write-only one:
//                                   the step's read phase plus its write phase, times added
//                       concurrent  a read-only and a write-only job at once: both jobs'
//                                   bytes over the slower job's time
//                     A state under 64 MiB is looped over (--loops) to at least 64 MiB per
//                     job, since fio times in whole milliseconds. Its buffers are registered
//                     (--fixedbufs) where the locked-memory limit allows, as the engine's are.
//   fio_huge_pages    whether fio's buffers are in huge pages (--mem=mmaphuge), as the
//                     engine's staging is: only where enough hugetlb pages are free
//                     (vm.nr_hugepages; how many is said on stderr otherwise). Without them
//                     a disk that takes fewer segments per request than a block has 4 KiB
//                     pages (virtio: 254) cuts each of fio's blocks into more requests than
//                     the engine's, and the fio references may be no bound.
//   fio_<pattern>_best_gb_s
//                     the same at the pattern's best bs and iodepth of {256K, 1M, 4M} x
//                     {4, 32} (fio_<pattern>_best_bs, fio_<pattern>_best_iodepth), chosen
//                     by one pass over them
//                     The fio figures are medians of runs interleaved with the timed steps
//                     (one after every other step), so they see the same disk weather.
//   ds_io_gb_s        DeepSpeed's ds_io (pip package deepspeed), where it is on the PATH: its
//                     read of state_bytes, then its write of them, in a folder of the same
//                     directory at the engine's block size and queue depth (each its mean
//                     over --loops 3), times added; run once per size. Else null, and
//                     ds_io_skipped says why (--no-ds-io, not on the PATH, how it failed)
//   peak_rss_mb       the process's peak resident memory during the configuration
//   model_rss_mb      the params and grads the benchmark itself allocates
//   default           true on the row with the library's default settings
// Where fio is missing or fails the fio fields are null, except under CI=true, where it is
// an error. ds_io is optional everywhere.
//
// Last, one `nvme_step_compact` line per size compares the compact states with fp32 state
// (Bf16Mixed) at Pipelined<2>, interleaved: the four optimizers made side by side, then
// max(--steps, 5) rounds of one step each (the round's first rotating). Per compact state
// (prefix 8bit, 8bit_kahan, 8bit_sr): its median seconds_per_step, state_bytes, bytes_ratio
// (fp32 state's bytes over its own), speedup (the median over rounds of the round's fp32
// step time over its own; _min and _max beside it) and the target (null where none);
// a speedup under its target is also a warning on stderr. (The rows above run minutes
// apart: on a shared disk their ratios say as much about the disk's drift as the code.)
//
//   nvme_step [--path DIR] [--elements N] [--steps S] [--threads T] [--block-size B]
//             [--queue-depth Q] [--no-fio] [--no-ds-io]
//   (--elements N runs one size in this process)
#include <tierstate/tierstate.hpp>

#include <algorithm>
#include <array>
#include <bitset>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

#include <sys/resource.h>
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
  std::size_t chunk_elements = 0;  // 0: the optimizer's default (2^20)
  bool skip_fio          = false;
  bool skip_ds_io        = false;
  std::string directory;       // the fresh directory itself (set for children)
};

constexpr char const* usage_text =
  "usage: nvme_step [--path DIR] [--elements N >= 4096] [--steps S (1..1000)] [--threads T (0..4096)] "
  "[--block-size B] [--queue-depth Q] [--chunk-elements C (a multiple of 2048)] [--no-fio] [--no-ds-io] [--help]\n";

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
    } else if (a == "--chunk-elements") {
      o.chunk_elements = number(i, 0, std::size_t{1} << 40);
      if (o.chunk_elements % 2048 != 0) { usage_error("--chunk-elements " + std::to_string(o.chunk_elements) + ": not a multiple of 2048"); }
    } else if (a == "--no-fio") {
      o.skip_fio = true;
    } else if (a == "--no-ds-io") {
      o.skip_ds_io = true;
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
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {  // a tool's message may hold a tab
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(c));
      out += buf;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

std::string number_or_null(std::optional<double> v, char const* format = "%.4g")
{
  if (!v) { return "null"; }
  char buf[64];
  std::snprintf(buf, sizeof(buf), format, *v);
  return buf;
}

/// One JSON object on one line, field by field (values already in JSON).
class json_line {
 public:
  json_line& field(std::string const& key, std::string const& value)
  {
    text_ += (text_.empty() ? "{" : ",") + json_string(key) + ":" + value;
    return *this;
  }
  json_line& number(std::string const& key, std::optional<double> v, char const* format = "%.4g")
  {
    return field(key, number_or_null(v, format));
  }
  json_line& integer(std::string const& key, std::size_t v) { return field(key, std::to_string(v)); }
  json_line& boolean(std::string const& key, bool v) { return field(key, v ? "true" : "false"); }
  [[nodiscard]] std::string text() const { return text_ + "}"; }

 private:
  std::string text_;
};

struct command_output {
  int status = -1;  // pclose's, or -1 when the command could not start
  std::string text;
};

/// Runs `command` through the shell, its stdout and stderr together.
command_output run_command(std::string const& command)
{
  command_output r;
  FILE* p = ::popen((command + " 2>&1").c_str(), "r");
  if (p == nullptr) {
    r.text = std::strerror(errno);
    return r;
  }
  char buf[4096];
  while (std::fgets(buf, sizeof(buf), p) != nullptr) { r.text += buf; }
  r.status = ::pclose(p);
  return r;
}

/// The last line of a tool's output that is not blank: what a reason can quote of it.
std::string last_line(std::string const& text)
{
  std::istringstream lines(text);
  std::string last;
  for (std::string line; std::getline(lines, line);) {
    if (line.find_first_not_of(" \t\r") != std::string::npos) { last = line; }
  }
  return last;
}

// --- fio --------------------------------------------------------------------------------

/// The ways fio moves the state's bytes (see the header): each pattern's fio jobs and
/// whether they run at once (the time is the slower job's) or one after the other (the
/// times add up). Each pattern's first job waits for every job before it (--stonewall), so
/// no two patterns share the disk; job k of pattern P is named P_k.
struct pattern_info {
  char const* name;
  char const* jobs;
  int job_count;
  bool at_once;
};
constexpr std::array<pattern_info, 3> patterns = {{
  {"mixed", " --name=mixed_0 --stonewall --rw=rw --rwmixread=50", 1, false},
  {"phases", " --name=phases_0 --stonewall --rw=read --name=phases_1 --stonewall --rw=write", 2, false},
  {"concurrent", " --name=concurrent_0 --stonewall --rw=read --name=concurrent_1 --rw=write", 2, true},
}};
constexpr std::size_t pattern_count = patterns.size();
using pattern_set                   = std::bitset<pattern_count>;
/// GB/s of state per pattern; null where a run did not include the pattern.
using pattern_gb_s = std::array<std::optional<double>, pattern_count>;

struct fio_setting {
  std::size_t bs   = 0;
  unsigned iodepth = 0;
  bool operator==(fio_setting const&) const = default;
};
/// The settings searched for each pattern's best.
constexpr std::array<std::size_t, 3> searched_bs = {std::size_t{256} << 10, std::size_t{1} << 20, std::size_t{4} << 20};
constexpr std::array<unsigned, 2> searched_iodepths = {4, 32};

/// Where every fio run of a configuration goes: a file of the state's size in the same
/// directory, with the buffer options this machine allows (fio_buffer_options).
struct fio_target {
  std::string file;
  std::size_t size = 0;
  std::string buffers;
};

bool have_fio() { return std::system("fio --version >/dev/null 2>&1") == 0; }

/// fio's buffer options on this machine, for runs of at most `largest_bs` x `deepest` per job;
/// `huge` says whether they are in huge pages. The engine's staging is (PinnedHost, where the
/// kernel gives transparent huge pages), so each of its pieces is one contiguous segment, and
/// the block layer merges adjacent pieces into requests up to the disk's largest. fio's
/// buffers are 4 KiB pages by default, and a disk that takes fewer segments per request than
/// a block has pages (virtio's 254, against a 1 MiB block's 256) cuts each block into several
/// requests: on a disk bounded by requests per second fio then does a fraction of what the
/// same bytes allow. fio gets huge pages only from hugetlb (--mem=mmaphuge), which needs
/// pages reserved beforehand (vm.nr_hugepages): used where enough are free for the two jobs a
/// run has at once, each with iodepth x bs bytes in huge pages and two huge pages more (what
/// fio 3.33 takes: found by trying). --fixedbufs registers the buffers with io_uring, as the
/// engine registers its staging; the kernel counts them as locked memory, so only where
/// RLIMIT_MEMLOCK allows it (or as root).
std::string fio_buffer_options(std::size_t largest_bs, unsigned deepest, bool& huge)
{
  std::size_t const job_bytes = largest_bs * deepest;
  std::size_t total = 0, free = 0, page = 0;
  std::ifstream meminfo("/proc/meminfo");
  for (std::string line; std::getline(meminfo, line);) {
    auto const value = [&](char const* key, std::size_t& to) {
      if (line.rfind(key, 0) == 0) { to = std::strtoull(line.c_str() + std::strlen(key), nullptr, 10); }
    };
    value("HugePages_Total:", total);
    value("HugePages_Free:", free);
    value("Hugepagesize:", page);  // in kB
  }
  page *= 1024;
  std::size_t const needed = page == 0 ? 0 : 2 * ((job_bytes + page - 1) / page + 2);
  huge                     = page != 0 && free >= needed;
  std::string options      = huge ? " --mem=mmaphuge" : "";
  if (!huge) {
    std::fprintf(stderr,
                 "nvme_step: fio's buffers are in 4 KiB pages (%zu hugetlb pages free, %zu needed; as root: sysctl "
                 "vm.nr_hugepages=%zu): the engine's staging is in huge pages, so on a disk that splits requests "
                 "of many pages the fio references may be no bound\n",
                 free, needed, total - free + needed);
  }
  ::rlimit lock{};
  if (::geteuid() == 0 ||
      (::getrlimit(RLIMIT_MEMLOCK, &lock) == 0 && (lock.rlim_cur == RLIM_INFINITY || lock.rlim_cur >= 2 * job_bytes))) {
    options += " --fixedbufs";
  }
  return options;
}

/// After fio failed (said on stderr): an error under CI=true; elsewhere the fio fields are null.
void fio_failed()
{
  if (in_ci()) {
    std::fprintf(stderr, "nvme_step: fio failed under CI=true\n");
    std::exit(1);
  }
}

std::string fio_command(fio_target const& t, fio_setting s, pattern_set which)
{
  // fio reports whole milliseconds: a small state is gone over again, to at least 64 MiB per
  // job, so that a millisecond is at most a few percent of any job's time.
  std::size_t const min_bytes = std::size_t{64} << 20;
  std::ostringstream cmd;
  cmd << "fio --filename=" << t.file << " --ioengine=io_uring --registerfiles" << t.buffers << " --direct=1 --bs="
      << s.bs << " --iodepth=" << s.iodepth << " --size=" << t.size
      << " --loops=" << std::max<std::size_t>(1, (min_bytes + t.size - 1) / t.size);
  for (std::size_t p = 0; p < pattern_count; ++p) {
    if (which[p]) { cmd << patterns[p].jobs; }
  }
  return cmd.str();
}

/// Runs the patterns in `which` in one fio process; nullopt when fio fails.
std::optional<pattern_gb_s> run_fio(fio_target const& t, fio_setting s, pattern_set which)
{
  std::string const command = fio_command(t, s, which);
  command_output const out = run_command(command + " --output-format=terse --terse-version=3");
  if (out.status != 0) {
    std::fprintf(stderr, "nvme_step: fio failed: %s\n%s\n", command.c_str(), out.text.c_str());
    return std::nullopt;
  }
  // Terse v3, one line per job: field 3 is its name; 6 and 9 the KiB it read and the read's
  // runtime in ms; 47 and 50 the same for its writes.
  struct job {
    double bytes   = 0;
    double seconds = 0;
  };
  std::map<std::string, job> jobs;
  std::istringstream lines(out.text);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("3;", 0) != 0) { continue; }
    std::vector<std::string> f;
    std::stringstream ss(line);
    for (std::string x; std::getline(ss, x, ';');) { f.push_back(x); }
    if (f.size() < 50) { continue; }
    auto const at = [&](std::size_t field) { return std::strtod(f[field - 1].c_str(), nullptr); };
    jobs[f[2]] = {(at(6) + at(47)) * 1024.0, std::max(at(9), at(50)) / 1000.0};
  }
  pattern_gb_s r;
  for (std::size_t p = 0; p < pattern_count; ++p) {
    if (!which[p]) { continue; }
    double bytes = 0, seconds = 0;
    for (int k = 0; k < patterns[p].job_count; ++k) {
      auto const j = jobs.find(std::string(patterns[p].name) + "_" + std::to_string(k));
      if (j == jobs.end() || j->second.seconds <= 0) {
        std::fprintf(stderr, "nvme_step: cannot read fio's output:\n%s\n", out.text.c_str());
        return std::nullopt;
      }
      bytes += j->second.bytes;
      seconds = patterns[p].at_once ? std::max(seconds, j->second.seconds) : seconds + j->second.seconds;
    }
    r[p] = bytes / seconds / 1e9;
  }
  return r;
}

/// Each pattern's best setting of searched_bs x searched_iodepths: one pass, every pattern in
/// each run. nullopt when fio fails.
std::optional<std::array<fio_setting, pattern_count>> best_fio_settings(fio_target const& t)
{
  std::array<fio_setting, pattern_count> best{};
  std::array<double, pattern_count> best_gb_s{};
  for (std::size_t const bs : searched_bs) {
    for (unsigned const d : searched_iodepths) {
      if (bs > t.size) { continue; }  // fio refuses a file smaller than one block
      auto const r = run_fio(t, {bs, d}, pattern_set().set());
      if (!r) { return std::nullopt; }
      for (std::size_t p = 0; p < pattern_count; ++p) {
        if (*(*r)[p] > best_gb_s[p]) {
          best_gb_s[p] = *(*r)[p];
          best[p]      = {bs, d};
        }
      }
    }
  }
  return best;
}

// --- ds_io ------------------------------------------------------------------------------

struct ds_io_result {
  std::optional<double> gb_s;
  std::string skipped;  // why gb_s is null
};

/// DeepSpeed's ds_io reading `size` bytes, then writing them, in `folder` (made and removed
/// here), at block size `bs` and queue depth `depth`: GB/s of state, the two times added.
/// Its flags, as DeepSpeed's deepspeed/nvme/ds_aio_args.py defines them: --folder, --io_size
/// (bytes), --block_size, --queue_depth, --loops, and --read (else it writes); it prints
/// "Task Read Speed = X GB/sec" (X in GiB/s: bytes over the I/O's own time, all loops). Up
/// to DeepSpeed 0.16 its default path does not run (it reads arguments its parser no longer
/// has) and --handle picks the working one; later versions dropped --handle, that engine
/// being their default. So --handle goes in where `ds_io --help` lists it. ds_io exits 0
/// even when it refuses its arguments: the speed line is what says it ran.
ds_io_result run_ds_io(std::string const& folder, std::size_t size, std::size_t bs, unsigned depth)
{
  if (std::system("command -v ds_io >/dev/null 2>&1") != 0) {
    return {std::nullopt, "ds_io is not on the PATH (pip install deepspeed)"};
  }
  command_output const help = run_command("ds_io --help");
  if (help.status != 0 || help.text.find("--io_size") == std::string::npos) {
    return {std::nullopt, "ds_io --help lists no --io_size: " + last_line(help.text)};
  }
  std::error_code ec;
  std::filesystem::create_directory(folder, ec);
  std::ostringstream cmd;
  cmd << "ds_io --folder " << folder << " --io_size " << size << " --block_size " << bs << " --queue_depth " << depth
      << " --loops 3" << (help.text.find("[--handle]") != std::string::npos ? " --handle" : "");
  ds_io_result r;
  double seconds = 0;  // the read's and the write's, for `size` bytes each
  for (bool const read : {true, false}) {
    std::string const command = cmd.str() + (read ? " --read" : "");
    command_output const out  = run_command(command);
    std::string const key     = read ? "Task Read Speed = " : "Task Write Speed = ";
    std::size_t const at      = out.text.find(key);
    double const gib_s        = at == std::string::npos ? 0 : std::strtod(out.text.c_str() + at + key.size(), nullptr);
    if (out.status != 0 || !(gib_s > 0)) {
      r.skipped = command + " failed: " + last_line(out.text);
      std::fprintf(stderr, "nvme_step: %s\n%s\n", r.skipped.c_str(), out.text.c_str());
      break;
    }
    seconds += static_cast<double>(size) / (gib_s * 1024 * 1024 * 1024);
  }
  std::filesystem::remove_all(folder, ec);
  if (r.skipped.empty()) { r.gb_s = 2.0 * static_cast<double>(size) / seconds / 1e9; }
  return r;
}

// --- one size ---------------------------------------------------------------------------

/// What the first configuration of a size measures once, for all of them.
struct references {
  bool fio = false;            // fio is installed, wanted and has not failed
  std::string fio_buffers;     // fio_buffer_options()
  bool fio_huge_pages = false;
  bool searched       = false;  // best and ds_io are set
  std::array<fio_setting, pattern_count> best{};
  ds_io_result ds_io;
};

/// The optimizer's options from the command line's, its state in `dir`.
template <class Opt>
typename Opt::options options_for(options const& o, std::string const& dir)
{
  typename Opt::options opt_options;
  opt_options.threads        = o.threads;
  opt_options.tier.directory = dir;
  if (o.block_size != 0) { opt_options.tier.io.block_size = o.block_size; }
  if (o.queue_depth != 0) { opt_options.tier.io.queue_depth = o.queue_depth; }
  opt_options.chunk_elements = o.chunk_elements;
  return opt_options;
}

template <unsigned Depth, class P = Bf16Mixed>
void run_config(options const& o, std::string const& dir, std::vector<bf16>& params, std::vector<bf16> const& grads,
                bool is_default, references& refs)
{
  using Opt = OffloadedOptimizer<AdamW, P, NvmeFile, Pipelined<Depth>>;
  reset_peak_rss();
  auto const opt_options = options_for<Opt>(o, dir);
  is_default = is_default && o.block_size == 0 && o.queue_depth == 0 && o.chunk_elements == 0;
  typename Opt::hyperparameters h;
  h.lr = 1e-4;
  Opt opt(h, opt_options);
  opt.add_tensor("w", params.data(), params.size());
  std::vector<grad_view<bf16>> const views = {{grads.data(), grads.size()}};
  opt.step(views);  // warm-up; also builds and reserves the state
  auto const& lay      = opt.state_layout();
  auto const t_start   = Clock::now();
  std::size_t const bs = opt_options.tier.io.block_size;
  unsigned const qd    = opt_options.tier.io.queue_depth;
  // The engine's setting for the references: its pieces are never larger than the state.
  fio_setting const engine{std::min(bs, lay.total_bytes()), qd};
  fio_target const target{dir + "/fio.scratch", lay.total_bytes(), refs.fio_buffers};
  if (!refs.searched) {
    refs.searched = true;
    if (refs.fio) {
      if (auto const best = best_fio_settings(target)) {
        refs.best = *best;
      } else {
        fio_failed();
        refs.fio = false;
      }
    }
    refs.ds_io = o.skip_ds_io ? ds_io_result{std::nullopt, "--no-ds-io"}
                              : run_ds_io(dir + "/ds_io", lay.total_bytes(), engine.bs, engine.iodepth);
  }

  // One fio run at the engine's setting with every pattern, and one at each other best
  // setting with the patterns it is best for.
  // A pattern's best is null where the state is smaller than every bs searched, or than its
  // best bs, searched on a larger state (the first row searches; a compact row's state is
  // smaller): fio refuses a file smaller than one block.
  auto const best_fits = [&](std::size_t p) { return refs.best[p].bs != 0 && refs.best[p].bs <= target.size; };
  std::vector<std::pair<fio_setting, pattern_set>> runs = {{engine, pattern_set().set()}};
  for (std::size_t p = 0; refs.fio && p < pattern_count; ++p) {
    if (!best_fits(p)) { continue; }
    auto const same = std::find_if(runs.begin(), runs.end(), [&](auto const& r) { return r.first == refs.best[p]; });
    if (same == runs.end()) {
      runs.push_back({refs.best[p], pattern_set().set(p)});
    } else {
      same->second.set(p);
    }
  }
  std::string const fio_engine_command = fio_command(target, engine, runs.front().second);

  // Steps and fio runs interleaved, so both see the same disk weather; medians of each.
  std::vector<double> seconds, compute, wait, check;
  std::array<std::vector<double>, pattern_count> at_engine, at_best;
  std::uint64_t bytes = 0;
  for (int s = 0; s < o.steps; ++s) {
    auto const t0 = Clock::now();
    auto const r  = opt.step(views);
    seconds.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    compute.push_back(r.stats.compute_seconds);
    wait.push_back(r.stats.wait_seconds);
    check.push_back(r.stats.check_seconds);
    bytes = r.stats.tier_bytes_read + r.stats.tier_bytes_written;
    if (s % 2 == 1) { continue; }  // fio after steps 1, 3, 5, ...: a median of 3 for 5 steps
    for (auto const& [setting, which] : runs) {
      if (!refs.fio) { break; }
      auto const gb_s = run_fio(target, setting, which);
      if (!gb_s) {
        fio_failed();
        refs.fio = false;
        break;
      }
      for (std::size_t p = 0; p < pattern_count; ++p) {
        if (!which[p]) { continue; }
        if (setting == engine) { at_engine[p].push_back(*(*gb_s)[p]); }
        if (setting == refs.best[p]) { at_best[p].push_back(*(*gb_s)[p]); }
      }
    }
  }
  double const peak     = peak_rss_mb();
  std::fprintf(stderr, "nvme_step: %s, Pipelined<%u>, %zu elements: %.1f s\n", P::name().c_str(), Depth, params.size(),
               std::chrono::duration<double>(Clock::now() - t_start).count());
  auto const& tier       = opt.state_tier();
  double const sps       = median(seconds);
  double const io_gb_s   = static_cast<double>(bytes) / sps / 1e9;
  double const compute_s = median(compute);
  double const model_mb  = static_cast<double>((params.size() + grads.size()) * sizeof(bf16)) / (1 << 20);

  // Every reference, by its field's name without "_gb_s"; the limit is the best of them.
  auto const med = [](std::vector<double> const& v) { return v.empty() ? std::nullopt : std::optional(median(v)); };
  std::vector<std::pair<std::string, std::optional<double>>> figures;
  for (std::size_t p = 0; p < pattern_count; ++p) {
    figures.push_back({std::string("fio_") + patterns[p].name, med(at_engine[p])});
    figures.push_back({std::string("fio_") + patterns[p].name + "_best", med(at_best[p])});
  }
  figures.push_back({"ds_io", refs.ds_io.gb_s});
  std::optional<double> limit, limit_ratio, io_seconds;
  std::string limit_source;
  for (auto const& [name, gb_s] : figures) {
    if (gb_s && (!limit || *gb_s > *limit)) {
      limit        = gb_s;
      limit_source = name;
    }
  }
  std::optional<bool> compute_bound;
  if (limit) {
    limit_ratio   = io_gb_s / *limit;
    io_seconds    = static_cast<double>(bytes) / (*limit * 1e9);
    compute_bound = compute_s > *io_seconds;
    if (*limit_ratio > 1.03) {
      std::fprintf(stderr,
                   "nvme_step: warning: Pipelined<%u>, %zu elements: the step's %.3g GB/s beat the limit, %s's %.3g "
                   "GB/s, by %.1f%%: the references are no bound here\n",
                   Depth, params.size(), io_gb_s, limit_source.c_str(), *limit, (*limit_ratio - 1) * 100);
    }
    if (*compute_bound) {
      std::fprintf(stderr,
                   "nvme_step: warning: Pipelined<%u>, %zu elements: compute %.4f s per step > I/O %.4f s (the "
                   "step's bytes at the limit): the I/O waits for the compute\n",
                   Depth, params.size(), compute_s, *io_seconds);
    }
  }

  json_line row;
  row.field("bench", json_string("nvme_step"))
    .field("rule", json_string("AdamW"))
    .field("precision", json_string(P::name()))
    .field("transfer", json_string("Pipelined<" + std::to_string(Depth) + ">"))
    .integer("depth", Depth)
    .boolean("default", is_default)
    .integer("elements", params.size())
    .integer("state_bytes", lay.total_bytes())
    .integer("staging_bytes", opt.staging_bytes())
    .integer("chunk_bytes", lay.chunk_bytes())
    .integer("queue_depth", qd)
    .integer("block_size", bs)
    .field("io_backend", json_string(std::string(io::backend_name(opt_options.tier.io.backend))))
    .boolean("direct", tier.direct())
    .integer("threads", opt.pool().size())
    .integer("steps", static_cast<std::size_t>(o.steps))
    .number("seconds_per_step", sps, "%.4f")
    .number("io_gb_s", io_gb_s)
    .number("compute_seconds", compute_s, "%.4f")
    .number("wait_seconds", median(wait), "%.4f")
    .number("check_seconds", median(check), "%.4f")
    .number("io_seconds", io_seconds, "%.4f")
    .field("compute_bound", compute_bound ? (*compute_bound ? "true" : "false") : "null")
    .number("limit_gb_s", limit)
    .number("limit_ratio", limit_ratio)
    .field("limit_source", limit ? json_string(limit_source) : "null");
  for (auto const& [name, gb_s] : figures) { row.number(name + "_gb_s", gb_s); }
  for (std::size_t p = 0; p < pattern_count; ++p) {
    std::string const prefix = std::string("fio_") + patterns[p].name + "_best_";
    bool const found         = refs.fio && best_fits(p);
    row.field(prefix + "bs", found ? std::to_string(refs.best[p].bs) : "null")
      .field(prefix + "iodepth", found ? std::to_string(refs.best[p].iodepth) : "null");
  }
  row.field("fio_huge_pages", refs.fio ? (refs.fio_huge_pages ? "true" : "false") : "null")
    .field("ds_io_skipped", refs.ds_io.gb_s ? "null" : json_string(refs.ds_io.skipped))
    .number("peak_rss_mb", peak, "%.1f")
    .number("model_rss_mb", model_mb, "%.1f")
    .number("rss_over_model_mb", peak - model_mb, "%.1f")
    .field("fio_command", refs.fio ? json_string(fio_engine_command) : "null");
  std::printf("%s\n", row.text().c_str());
  std::fflush(stdout);
}

/// One optimizer of the interleaved comparison: its name, its own params, and one timed step.
struct contender {
  std::string name;
  std::size_t state_bytes = 0;
  std::function<double()> step;  // seconds
  std::vector<double> seconds;
};

template <class P>
contender make_contender(options const& o, std::string const& dir, std::vector<bf16> const& init,
                         std::vector<bf16> const& grads, std::vector<std::shared_ptr<void>>& keep)
{
  using Opt = OffloadedOptimizer<AdamW, P, NvmeFile, Pipelined<2>>;
  typename Opt::hyperparameters h;
  h.lr        = 1e-4;
  auto params = std::make_shared<std::vector<bf16>>(init);
  auto opt    = std::make_shared<Opt>(h, options_for<Opt>(o, dir));
  opt->add_tensor("w", params->data(), params->size());
  std::vector<grad_view<bf16>> const views = {{grads.data(), grads.size()}};
  opt->step(views);  // warm-up; also builds and reserves the state
  keep.push_back(params);
  keep.push_back(opt);
  return {P::name(), opt->state_layout().total_bytes(), [opt = opt.get(), views] {
            auto const t0 = Clock::now();
            (void)opt->step(views);
            return std::chrono::duration<double>(Clock::now() - t0).count();
          },
          {}};
}

/// The compact states' speed-up over fp32 state, measured as the issue asks it: the four
/// optimizers side by side, one step each per round (the round's first one rotating), so
/// that every ratio compares steps seconds apart, under the same disk weather; the ratio
/// of each round's pair, then the median over rounds (the configurations above run minutes
/// apart, and on a shared disk their rate drifted by 1.7x between them).
void run_interleaved(options const& o, std::string const& dir, std::vector<bf16> const& init,
                     std::vector<bf16> const& grads)
{
  std::vector<std::shared_ptr<void>> keep;
  std::vector<contender> c;
  c.push_back(make_contender<Bf16Mixed>(o, dir, init, grads, keep));
  c.push_back(make_contender<Bf16Mixed8bit>(o, dir, init, grads, keep));
  c.push_back(make_contender<Precision<bf16, bf16, Compensated, Bf16Mixed8bit::state_type>>(o, dir, init, grads, keep));
  c.push_back(make_contender<Precision<bf16, bf16, StochasticRounding, Bf16Mixed8bit::state_type>>(o, dir, init, grads, keep));
  int const rounds = std::max(o.steps, 5);
  for (int r = 0; r < rounds; ++r) {
    for (std::size_t i = 0; i < c.size(); ++i) {
      auto& x = c[(i + static_cast<std::size_t>(r)) % c.size()];
      x.seconds.push_back(x.step());
    }
  }
  json_line row;
  row.field("bench", json_string("nvme_step_compact"))
    .field("rule", json_string("AdamW"))
    .field("transfer", json_string("Pipelined<2>"))
    .integer("elements", init.size())
    .integer("rounds", static_cast<std::size_t>(rounds))
    .field("baseline", json_string(c[0].name))
    .number("baseline_seconds_per_step", median(c[0].seconds), "%.4f")
    .integer("baseline_state_bytes", c[0].state_bytes);
  char const* const keys[] = {"", "8bit", "8bit_kahan", "8bit_sr"};
  double const targets[]   = {0, 1.9, 2.8, 0};  // (the issue's: none set for stochastic rounding on NVMe)
  for (std::size_t k = 1; k < c.size(); ++k) {
    std::vector<double> ratio;
    for (int r = 0; r < rounds; ++r) { ratio.push_back(c[0].seconds[r] / c[k].seconds[r]); }
    std::string const p = keys[k];
    row.field(p + "_precision", json_string(c[k].name))
      .number(p + "_seconds_per_step", median(c[k].seconds), "%.4f")
      .integer(p + "_state_bytes", c[k].state_bytes)
      .number(p + "_bytes_ratio", static_cast<double>(c[0].state_bytes) / static_cast<double>(c[k].state_bytes), "%.3f")
      .number(p + "_speedup", median(ratio), "%.3f")
      .number(p + "_speedup_min", *std::min_element(ratio.begin(), ratio.end()), "%.3f")
      .number(p + "_speedup_max", *std::max_element(ratio.begin(), ratio.end()), "%.3f")
      .number(p + "_target", targets[k] > 0 ? std::optional<double>(targets[k]) : std::nullopt, "%.2f");
    if (targets[k] > 0 && median(ratio) < targets[k]) {
      std::fprintf(stderr, "nvme_step: warning: %s, %zu elements: %.3fx faster than fp32 state, under the %.2fx target\n",
                   c[k].name.c_str(), init.size(), median(ratio), targets[k]);
    }
  }
  std::printf("%s\n", row.text().c_str());
  std::fflush(stdout);
}

int run_size(options const& o, std::string const& dir)
{
  references refs;
  refs.fio = !o.skip_fio && have_fio();
  if (!o.skip_fio && !refs.fio) {
    if (in_ci()) {
      std::fprintf(stderr, "nvme_step: fio is not installed, and CI=true needs its reference (apt-get install fio)\n");
      return 1;
    }
    std::fprintf(stderr, "nvme_step: fio is not installed: the fio fields are null\n");
  }
  if (refs.fio) {
    io::engine_options const defaults;
    std::size_t const bs = o.block_size != 0 ? o.block_size : defaults.block_size;
    unsigned const qd    = o.queue_depth != 0 ? o.queue_depth : defaults.queue_depth;
    refs.fio_buffers     = fio_buffer_options(std::max(bs, searched_bs.back()), std::max(qd, searched_iodepths.back()),
                                              refs.fio_huge_pages);
  }
  std::vector<bf16> params(o.elements), grads(o.elements);
  for (std::size_t i = 0; i < params.size(); ++i) {
    params[i] = bf16(static_cast<float>(i % 1000) * 1e-3f - 0.5f);
    grads[i]  = bf16(static_cast<float>(i % 777) * 1e-4f - 0.03f);
  }
  // The references are searched once, by the first configuration, on the layout's real size.
  // Ascending staging, so each row's peak belongs to its own configuration.
  run_config<1>(o, dir, params, grads, false, refs);
  run_config<2>(o, dir, params, grads, true, refs);  // Pipelined<> and every default option
  run_config<3>(o, dir, params, grads, false, refs);
  // Compact state at the default depth: 8-bit m and v (codecs/dynamic8.hpp) beside an fp32
  // master (6.03 state bytes per element against Bf16Mixed's 12), beside a bf16 Kahan
  // compensation slot in its place (4.03), and with stochastic rounding in its place (2.03):
  // where the disk is the bound, the step's time should shrink with its bytes.
  run_config<2, Bf16Mixed8bit>(o, dir, params, grads, false, refs);
  run_config<2, Precision<bf16, bf16, Compensated, Bf16Mixed8bit::state_type>>(o, dir, params, grads, false, refs);
  run_config<2, Precision<bf16, bf16, StochasticRounding, Bf16Mixed8bit::state_type>>(o, dir, params, grads, false, refs);
  std::filesystem::remove(dir + "/fio.scratch");
  run_interleaved(o, dir, params, grads);
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
                                         "--queue-depth", std::to_string(o.queue_depth),
                                         "--chunk-elements", std::to_string(o.chunk_elements)};
        if (o.skip_fio) { args.push_back("--no-fio"); }
        if (o.skip_ds_io) { args.push_back("--no-ds-io"); }
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
