// SPDX-License-Identifier: Apache-2.0
// param_offload: what resting the weights in a tier costs a training step, against keeping
// them in host memory, in the same run.
//
// A model of --layers layers of --layer-elements bf16 weights each; AdamW with an fp32
// master, its state on NVMe (OffloadedOptimizer<AdamW, Bf16Mixed, NvmeFile, Pipelined<2>>,
// no checks), in the directory of --path (default /tmp). Three ways to keep the weights:
//   memory      host arrays (add_tensor(name, pointer))
//   NvmeFile    offloaded_params<bf16, NvmeFile> in the same directory
//   NvmeFile, no write-behind   the same, each write of the step done before it returns
//               (write_behind_bytes = 0)
//   PinnedHost  offloaded_params<bf16, PinnedHost>
// One iteration: a forward walk (acquire and release every layer in order), a backward walk
// (in reverse), then the step; for `memory` the walks touch nothing. --reps iterations of
// each way, interleaved (memory, NvmeFile, ..., memory, ...), after one warm-up each.
// One JSON line per way:
//   step_seconds      median of the step
//   walk_seconds      median of the two walks (the weights' reads that were not hidden)
//   step_ratio        step_seconds / memory's (above 1: the offload's cost)
//   read_gb_s         the weights' bytes read by the window per iteration / walk_seconds
//   bytes_written     the weights' bytes the step wrote to their tier
//   window_bytes      host memory of the window: (window + 1) buffers of the largest layer
//   weights_bytes     the model's weights (what `memory` keeps in RAM, and the others do not)
//   state_bytes       the optimizer's state (on NVMe in every row)
//   on_demand, out_of_order   acquires the read-ahead did not foresee (0 in the steady state)
#include <tierstate/tierstate.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace {

using namespace tierstate;
using Clock = std::chrono::steady_clock;
using Opt   = OffloadedOptimizer<AdamW, Bf16Mixed, NvmeFile, Pipelined<2>>;

struct options {
  std::size_t layers = 16, layer_elements = std::size_t{1} << 20;
  int reps           = 5;
  unsigned window    = 2;
  std::string path   = "/tmp";
};

[[noreturn]] void usage(char const* why)
{
  std::fprintf(stderr,
               "param_offload: %s\nusage: param_offload [--layers N] [--layer-elements N] [--reps N] [--window W] "
               "[--path DIR]\n",
               why);
  std::exit(2);
}

options parse(int argc, char** argv)
{
  options o;
  for (int i = 1; i < argc; ++i) {
    std::string const a = argv[i];
    if (i + 1 >= argc) { usage("missing value"); }
    char const* v = argv[++i];
    char* end     = nullptr;
    long long const n = std::strtoll(v, &end, 10);
    bool const number = *v != '\0' && *end == '\0' && n > 0;
    if (a == "--path") {
      o.path = v;
    } else if (!number) {
      usage("a count must be a positive integer");
    } else if (a == "--layers") {
      o.layers = static_cast<std::size_t>(n);
    } else if (a == "--layer-elements") {
      o.layer_elements = static_cast<std::size_t>(n);
    } else if (a == "--reps") {
      o.reps = static_cast<int>(std::min<long long>(n, 1000));
    } else if (a == "--window") {
      o.window = static_cast<unsigned>(std::min<long long>(n, 64));
    } else {
      usage("unknown argument");
    }
  }
  return o;
}

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

std::string gb_s(double bytes_per_second)
{
  char text[32];
  std::snprintf(text, sizeof text, "%.3f", bytes_per_second / 1e9);
  return text;
}

double median(std::vector<double> v)
{
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

/// One way of keeping the weights, and its optimizer.
struct way {
  std::string name;
  Opt opt;
  std::vector<std::vector<bf16>> arrays;  // memory
  std::unique_ptr<param_source<bf16>> window;
  std::function<void(bool)> walk;  // forward (true) or backward
  std::function<offload_stats()> stats;
  std::function<void()> end = [] {};  // the iteration's end
  std::size_t window_bytes = 0;
  std::vector<double> step, walked;
  way(std::string n, Opt::options const& so) : name(std::move(n)), opt({}, so) {}
};

template <class Tier>
void offload(way& w, options const& o, typename Tier::options const& tier, std::vector<bf16> const& init,
             bool behind = true)
{
  typename offloaded_params<bf16, Tier>::options wo;
  wo.tier   = tier;
  wo.window = o.window;
  if (!behind) { wo.write_behind_bytes = 0; }
  auto p    = std::make_unique<offloaded_params<bf16, Tier>>(wo);
  for (std::size_t l = 0; l < o.layers; ++l) {
    auto const layer = p->add_layer(std::string("layer").append(std::to_string(l)));
    p->add_tensor(layer, std::string("w").append(std::to_string(l)), o.layer_elements);
  }
  for (std::size_t l = 0; l < o.layers; ++l) {
    p->write(l, 0, init);
    w.opt.add_tensor(*p, l);
  }
  auto* raw = p.get();
  w.walk    = [raw, n = o.layers](bool forward) {
    for (std::size_t i = 0; i < n; ++i) {
      std::size_t const l = forward ? i : n - 1 - i;
      (void)raw->acquire(l);
      raw->release(l);
    }
  };
  w.stats        = [raw] { return raw->stats(); };
  w.end          = [raw] { raw->end_iteration(); };
  w.window_bytes = raw->buffer_count() * raw->buffer_bytes() + raw->resident_bytes();
  w.window       = std::move(p);
}

}  // namespace

int main(int argc, char** argv)
{
  options const o = parse(argc, argv);
  try {
    Opt::options so;
    so.tier.directory = o.path;
    so.on_nonfinite   = nonfinite_policy::ignore;
    std::vector<bf16> init(o.layer_elements), grad(o.layer_elements);
    for (std::size_t i = 0; i < init.size(); ++i) {
      init[i] = bf16(static_cast<float>(i % 1000) * 1e-3f - 0.5f);
      grad[i] = bf16(static_cast<float>(i % 777) * 1e-4f - 0.03f);
    }
    std::vector<grad_view<bf16>> const grads(o.layers, grad_view<bf16>{grad.data(), grad.size()});

    std::vector<std::unique_ptr<way>> ways;
    ways.push_back(std::make_unique<way>("memory", so));
    auto& mem = *ways.back();
    mem.arrays.assign(o.layers, init);
    for (std::size_t l = 0; l < o.layers; ++l) {
      mem.opt.add_tensor(std::string("w").append(std::to_string(l)), mem.arrays[l].data(), o.layer_elements);
    }
    mem.walk  = [](bool) {};
    mem.stats = [] { return offload_stats{}; };
    ways.push_back(std::make_unique<way>("NvmeFile", so));
    NvmeFile::options nvme;
    nvme.directory = o.path;
    offload<NvmeFile>(*ways.back(), o, nvme, init);
    ways.push_back(std::make_unique<way>("NvmeFile, no write-behind", so));
    offload<NvmeFile>(*ways.back(), o, nvme, init, false);
    ways.push_back(std::make_unique<way>("PinnedHost", so));
    offload<PinnedHost>(*ways.back(), o, {}, init);

    std::vector<offload_stats> before(ways.size());
    for (int r = -1; r < o.reps; ++r) {  // (r = -1: the warm-up, which makes the state)
      for (std::size_t i = 0; i < ways.size(); ++i) {
        auto& w = *ways[i];
        if (r == 0) { before[i] = w.stats(); }
        auto t0 = Clock::now();
        w.walk(true);
        w.walk(false);
        double const walked = seconds_since(t0);
        t0                  = Clock::now();
        w.opt.step(grads);
        double const stepped = seconds_since(t0);
        w.end();
        if (r >= 0) {
          w.walked.push_back(walked);
          w.step.push_back(stepped);
        }
      }
    }
    double const base = median(ways[0]->step);
    std::size_t const weights = o.layers * o.layer_elements * sizeof(bf16);
    for (std::size_t i = 0; i < ways.size(); ++i) {
      auto& w        = *ways[i];
      auto const now = w.stats();
      double const reps    = static_cast<double>(o.reps);
      double const read    = static_cast<double>(now.bytes_read - before[i].bytes_read) / reps;
      double const walk_s  = median(w.walked);
      double const written_per_step = static_cast<double>(now.bytes_written - before[i].bytes_written) / reps;
      std::string const rate        = i == 0 || walk_s <= 0 ? std::string("null") : gb_s(read / walk_s);
      std::printf("{\"bench\":\"param_offload\",\"weights\":\"%s\",\"layers\":%zu,\"layer_elements\":%zu,\"window\":%u,"
                  "\"reps\":%d,\"step_seconds\":%.4f,\"walk_seconds\":%.4f,\"step_ratio\":%.3f,\"read_gb_s\":%s,"
                  "\"bytes_written\":%.0f,\"window_bytes\":%zu,\"weights_bytes\":%zu,\"state_bytes\":%zu,"
                  "\"on_demand\":%llu,\"out_of_order\":%llu}\n",
                  w.name.c_str(), o.layers, o.layer_elements, o.window, o.reps, median(w.step), walk_s,
                  median(w.step) / base, rate.c_str(),
                  written_per_step, w.window_bytes, weights, w.opt.state_layout().total_bytes(),
                  static_cast<unsigned long long>(now.on_demand), static_cast<unsigned long long>(now.out_of_order));
    }
    return 0;
  } catch (std::exception const& e) {
    std::fprintf(stderr, "param_offload: %s\n", e.what());
    return 1;
  }
}
