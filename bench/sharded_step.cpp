// SPDX-License-Identifier: Apache-2.0
// sharded_step: ranks::sharded over MPI (ZeRO-1 for a C++ trainer) at any rank count, run as
//   mpirun -np N build/bench/sharded_step [--elements E] [--steps S] [--tier nvme|pinned] [--path DIR]
// A model of E bf16 elements in 8 tensors of unequal sizes, AdamW with an fp32 master, one
// optimizer thread per rank; each rank's state on NVMe (NvmeFile, Pipelined<2>, in --path) or
// in host memory. Every step: this rank's gradients reduce-scattered, its share stepped, the
// params all-gathered. Rank 0 prints one JSON line:
//   step_seconds        median over the steps (after one warm-up) of the slowest rank's step
//   optimizer_seconds   the same, of the rank's own optimizer step (the rest is communication)
//   state_bytes_rank    the largest rank's state (1/N of the total, to within a chunk)
//   state_bytes_total   every rank's
//   tier_bytes_rank     the largest rank's tier bytes per step (read + written)
//   load                the 1-minute load average when it started (the machine is shared)
#include <tierstate/ranks/mpi.hpp>
#include <tierstate/ranks/sharded.hpp>
#include <tierstate/tierstate.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

using namespace tierstate;

struct options {
  std::size_t elements = std::size_t{1} << 23;
  int steps            = 5;
  std::string tier     = "nvme";
  std::string path     = "/tmp";
};

[[noreturn]] void usage(char const* why)
{
  std::fprintf(stderr, "sharded_step: %s\nusage: sharded_step [--elements E] [--steps S] [--tier nvme|pinned] [--path DIR]\n",
               why);
  std::exit(2);
}

options parse(int argc, char** argv)
{
  options o;
  for (int i = 1; i < argc; ++i) {
    std::string const a = argv[i];
    if (i + 1 >= argc) { usage(("missing value after " + a).c_str()); }
    std::string const v = argv[++i];
    char* end           = nullptr;
    if (a == "--elements") {
      o.elements = std::strtoull(v.c_str(), &end, 10);
    } else if (a == "--steps") {
      o.steps = static_cast<int>(std::strtol(v.c_str(), &end, 10));
    } else if (a == "--tier" && (v == "nvme" || v == "pinned")) {
      o.tier = v;
    } else if (a == "--path") {
      o.path = v;
    } else {
      usage(("bad argument " + a).c_str());
    }
    if (end != nullptr && (*end != '\0' || v.empty())) { usage(("not a number: " + a + " " + v).c_str()); }
  }
  if (o.elements < 8 || o.steps < 1) { usage("--elements needs at least 8, --steps at least 1"); }
  return o;
}

double median(std::vector<double> v)
{
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <class Opt>
int run(ranks::mpi& world, options const& o, typename Opt::options oo)
{
  oo.threads        = 1;
  oo.on_nonfinite   = nonfinite_policy::skip_step;
  oo.max_grad_norm  = 1.0;
  std::vector<std::vector<bf16>> params, grads;
  std::size_t left = o.elements;
  for (int t = 0; t < 8; ++t) {  // 1/4, 1/8, ... of the model, the last tensor what remains
    std::size_t const n = t == 7 ? left : std::max<std::size_t>(1, left / (t % 2 == 0 ? 4 : 3));
    left -= n;
    params.emplace_back(n, bf16(0.01f));
    grads.emplace_back(n);
    for (std::size_t i = 0; i < n; ++i) {
      grads.back()[i] = bf16(static_cast<float>((i * 31 + world.rank() * 7 + t) % 97) / 970.0f - 0.05f);
    }
  }
  ranks::sharded<Opt, ranks::mpi> opt(world, {.lr = 1e-3, .weight_decay = 0.01}, oo);
  for (std::size_t t = 0; t < params.size(); ++t) {  // ("t" appended to: GCC 12's -Wrestrict)
    opt.add_tensor(std::string("t").append(std::to_string(t)), params[t].data(), params[t].size());
  }
  std::vector<grad_view<bf16>> views;
  for (auto const& g : grads) { views.push_back({g.data(), g.size(), location::host}); }
  opt.prepare();
  double load = 0;
  if (std::FILE* f = std::fopen("/proc/loadavg", "r")) {
    if (std::fscanf(f, "%lf", &load) != 1) { load = -1; }
    std::fclose(f);
  }
  std::vector<double> step_s, opt_s;
  std::uint64_t tier_bytes = 0;
  for (int s = 0; s <= o.steps; ++s) {
    MPI_Barrier(world.handle());
    auto const t0 = std::chrono::steady_clock::now();
    auto const r  = opt.step(views);
    double times[2] = {std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
                       r.stats.total_seconds};
    MPI_Allreduce(MPI_IN_PLACE, times, 2, MPI_DOUBLE, MPI_MAX, world.handle());
    if (s == 0) { continue; }  // (the warm-up)
    step_s.push_back(times[0]);
    opt_s.push_back(times[1]);
    tier_bytes = std::max<std::uint64_t>(tier_bytes, r.stats.tier_bytes_read + r.stats.tier_bytes_written);
  }
  unsigned long long bytes[3] = {opt.state_bytes(), tier_bytes, 0};
  unsigned long long total    = bytes[0];
  MPI_Allreduce(MPI_IN_PLACE, bytes, 2, MPI_UNSIGNED_LONG_LONG, MPI_MAX, world.handle());
  MPI_Allreduce(MPI_IN_PLACE, &total, 1, MPI_UNSIGNED_LONG_LONG, MPI_SUM, world.handle());
  if (world.rank() == 0) {
    std::printf("{\"bench\": \"sharded_step\", \"ranks\": %zu, \"elements\": %zu, \"tier\": \"%s\", \"steps\": %d, "
                "\"step_seconds\": %.6f, \"optimizer_seconds\": %.6f, \"state_bytes_rank\": %llu, "
                "\"state_bytes_total\": %llu, \"tier_bytes_rank\": %llu, \"load\": %.2f}\n",
                world.size(), o.elements, o.tier.c_str(), o.steps, median(step_s), median(opt_s), bytes[0], total,
                bytes[1], load);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv)
{
  MPI_Init(&argc, &argv);
  options const o = parse(argc, argv);
  int rc          = 0;
  try {
    ranks::mpi world(MPI_COMM_WORLD);
    if (o.tier == "pinned") {
      rc = run<OffloadedOptimizer<AdamW, Bf16Mixed, PinnedHost>>(world, o, {});
    } else {
      OffloadedOptimizer<AdamW, Bf16Mixed, NvmeFile, Pipelined<2>>::options n;
      n.tier.directory = o.path;
      rc = run<OffloadedOptimizer<AdamW, Bf16Mixed, NvmeFile, Pipelined<2>>>(world, o, n);
    }
  } catch (std::exception const& e) {
    std::fprintf(stderr, "sharded_step: %s\n", e.what());
    rc = 1;
  }
  MPI_Finalize();
  return rc;
}
