// SPDX-License-Identifier: Apache-2.0
// The demo: a character-level MLP language model (a window of previous characters, their
// embeddings, one tanh hidden layer, a softmax over the next character), with forward and
// backward written out by hand, trained on a text file from this repository. Its bf16
// weights live in the "model"; tierstate's optimizer keeps their fp32 master copy and Adam
// moments off to the side, as it would for a GPU:
//   --tier nvme (the default)  OffloadedOptimizer<AdamW, Bf16Mixed, NvmeFile, Pipelined<2>>,
//                              the state in a nameless scratch file (O_TMPFILE) in $TMPDIR
//                              or /tmp, or in --path DIR, streamed through a ring of 4
//                              chunks: nothing to clean up, even after a SIGKILL;
//   --tier pinned              OffloadedOptimizer<AdamW, Bf16Mixed, PinnedHost>, the state in
//                              host memory. Both give the same losses, bit for bit.
//
//   build/examples/char_mlp [--text FILE] [--steps N] [--batch B] [--threads T]
//                           [--tier nvme|pinned] [--path DIR] [--trace FILE] [--help]
//   (--trace writes the last step's timeline as Chrome trace-event JSON: core/trace.hpp)
//
// Built with TIERSTATE_EXAMPLE_MPI (build/examples/char_mlp_mpi), it is data-parallel with
// ZeRO-1 under MPI: every rank holds the model and computes the gradients of its part of each
// batch, and ranks::sharded keeps 1/N of the optimizer state on each rank, reduce-scatters the
// gradients and all-gathers the updated weights (ranks/sharded.hpp). Rank 0 prints.
//   mpirun -np 2 build/examples/char_mlp_mpi --threads 1 [the options above]
#include <tierstate/tierstate.hpp>
#ifdef TIERSTATE_EXAMPLE_MPI
#include <tierstate/ranks/mpi.hpp>
#include <tierstate/ranks/sharded.hpp>
#endif

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <system_error>
#include <vector>

#ifndef TIERSTATE_SOURCE_DIR
#define TIERSTATE_SOURCE_DIR "."
#endif

namespace {

using namespace tierstate;

#ifdef TIERSTATE_EXAMPLE_MPI
/// The ranks: MPI's world, its optimizer sharded over them (the gradients summed: each rank's
/// are its part of the batch's mean).
struct world_type : ranks::mpi {
  using ranks::mpi::mpi;
  double sum(double x) const
  {
    MPI_Allreduce(MPI_IN_PLACE, &x, 1, MPI_DOUBLE, MPI_SUM, handle());
    return x;
  }
};
template <class Opt>
using optimizer_for = ranks::sharded<Opt, ranks::mpi>;
template <class Opt>
std::unique_ptr<optimizer_for<Opt>> make_optimizer(world_type& w, typename Opt::hyperparameters const& h,
                                                   typename Opt::options const& o)
{
  return std::make_unique<optimizer_for<Opt>>(w, h, o, ranks::sharded_options{.average = false});
}
#else
/// One process.
struct world_type {
  [[nodiscard]] std::size_t rank() const noexcept { return 0; }
  [[nodiscard]] std::size_t size() const noexcept { return 1; }
  [[nodiscard]] double sum(double x) const noexcept { return x; }
};
template <class Opt>
using optimizer_for = Opt;
template <class Opt>
std::unique_ptr<Opt> make_optimizer(world_type&, typename Opt::hyperparameters const& h, typename Opt::options const& o)
{
  return std::make_unique<Opt>(h, o);
}
#endif

/// This rank's state: its bytes, chunks and staging, and its threads.
template <class Opt>
std::string state_summary(Opt& opt, std::string const& where)
{
  if constexpr (requires { opt.local(); }) {
    auto* const local = opt.local();  // (a rank that owns no element has none)
    return local == nullptr ? std::string("none") : state_summary(*local, where);
  } else {
    auto const& lay = opt.state_layout();
    return std::to_string(lay.total_bytes()) + " bytes (fp32 master, exp_avg, exp_avg_sq) in " + where + ", " +
           std::to_string(lay.chunk_count()) + " chunks of " + std::to_string(lay.chunk_elements()) + " elements, " +
           std::to_string(opt.staging_bytes()) + " bytes of staging; " + std::to_string(opt.pool().size()) +
           " threads";
  }
}

constexpr int context = 8;    // characters of context
constexpr int embed   = 16;   // embedding width
constexpr int hidden  = 512;  // hidden units

struct options {
  std::string text = std::string(TIERSTATE_SOURCE_DIR) + "/README.md";
  std::string tier = "nvme";
  std::string path;  // NvmeFile's directory; empty: the system's temporary directory
  std::string trace;  // where to write the last step's timeline (Chrome trace JSON); empty: none
  int steps        = 400;
  int batch        = 128;
  std::size_t threads = 0;
};

// The numeric arguments' ranges: the loop counts steps in an int, the batch sizes the
// activations (batch x 512 floats each), and thread_pool takes at most 4096 threads.
constexpr long long max_steps   = 1'000'000'000;
constexpr long long max_batch   = 1 << 20;
constexpr long long max_threads = 4096;

constexpr char const* usage_text =
  "usage: char_mlp [--text FILE] [--steps N (1..1000000000)] [--batch B (1..1048576)] "
  "[--threads T (0..4096, 0: the CPUs)] [--tier nvme|pinned] [--path DIR] [--trace FILE]\n"
  "  --trace FILE  write the last step's timeline to FILE as Chrome trace-event JSON\n"
  "                (open it in ui.perfetto.dev; bench/trace_png.py draws it)\n";

[[noreturn]] void usage(std::string const& why)
{
  std::fprintf(stderr, "char_mlp: %s\n%s", why.c_str(), usage_text);
  std::exit(2);
}

/// The decimal integer `v` of argument `a`, in [lo, hi]: all of it digits (an optional '-'
/// first), nothing after them, no overflow; otherwise a usage error naming both.
long long integer(std::string const& a, std::string const& v, long long lo, long long hi)
{
  long long n       = 0;
  char const* first = v.data();
  char const* last  = v.data() + v.size();
  auto const [end, ec] = std::from_chars(first, last, n);
  std::string const range = std::to_string(lo) + ".." + std::to_string(hi);
  std::string const shown = v.empty() ? std::string("\"\"") : v;
  if (ec == std::errc::result_out_of_range || (ec == std::errc{} && end == last && (n < lo || n > hi))) {
    usage(a + " " + shown + ": out of range (" + range + ")");
  }
  if (v.empty() || ec != std::errc{} || end != last) { usage(a + " " + shown + ": not an integer (" + range + ")"); }
  return n;
}

options parse(int argc, char** argv)
{
  options o;
  for (int i = 1; i < argc; ++i) {
    std::string const a = argv[i];
    if (a == "--help" || a == "-h") {
      std::printf("%s", usage_text);
      std::exit(0);
    }
    if (i + 1 >= argc) { usage("missing value after " + a); }
    std::string const v = argv[++i];
    if (a == "--text") {
      o.text = v;
    } else if (a == "--tier" && (v == "nvme" || v == "pinned")) {
      o.tier = v;
    } else if (a == "--path" && !v.empty()) {
      o.path = v;
    } else if (a == "--trace" && !v.empty()) {
      o.trace = v;
    } else if (a == "--steps") {
      o.steps = static_cast<int>(integer(a, v, 1, max_steps));
    } else if (a == "--batch") {
      o.batch = static_cast<int>(integer(a, v, 1, max_batch));
    } else if (a == "--threads") {
      o.threads = static_cast<std::size_t>(integer(a, v, 0, max_threads));
    } else {
      usage("bad argument " + a + " " + v);
    }
  }
  return o;
}

/// One parameter tensor of the model: bf16 weights and their bf16 gradient, plus an fp32
/// gradient accumulator for the backward pass.
struct param {
  std::string name;
  std::vector<bf16> w, g;
  std::vector<float> acc;
  param(std::string n, std::size_t size, float scale, std::mt19937& rng) : name(std::move(n)), w(size), g(size), acc(size)
  {
    std::normal_distribution<float> d(0.0f, scale);
    for (auto& x : w) { x = bf16(scale == 0.0f ? 0.0f : d(rng)); }
  }
  std::vector<float> weights() const
  {
    std::vector<float> f(w.size());
    for (std::size_t i = 0; i < w.size(); ++i) { f[i] = static_cast<float>(w[i]); }
    return f;
  }
};

/// The model's weights widened to float once per step, for the forward and backward passes.
struct weights {
  std::vector<float> embedding, w1, b1, w2, b2;
};

/// Forward for one window of `context` character ids: fills x (the concatenated
/// embeddings), h (the tanh hidden layer) and logits.
void forward(weights const& w, int const* window, int vocab, float* x, float* h, float* logits)
{
  int const in_width = context * embed;
  for (int c = 0; c < context; ++c) {
    std::copy_n(&w.embedding[static_cast<std::size_t>(window[c]) * embed], embed, x + c * embed);
  }
  std::copy(w.b1.begin(), w.b1.end(), h);
  for (int i = 0; i < in_width; ++i) {
    float const* wr = &w.w1[static_cast<std::size_t>(i) * hidden];
    for (int j = 0; j < hidden; ++j) { h[j] += x[i] * wr[j]; }
  }
  for (int j = 0; j < hidden; ++j) { h[j] = std::tanh(h[j]); }
  std::copy(w.b2.begin(), w.b2.end(), logits);
  for (int j = 0; j < hidden; ++j) {
    float const* wr = &w.w2[static_cast<std::size_t>(j) * vocab];
    for (int k = 0; k < vocab; ++k) { logits[k] += h[j] * wr[k]; }
  }
}

/// Builds the model, trains it with `Optimizer`, samples from it; returns the exit code.
template <class Optimizer>
int train(world_type& world, options const& o, std::string const& text, std::vector<int> const& ids,
          std::vector<unsigned char> const& chars, int vocab, typename Optimizer::options opt_options,
          std::string const& where)
{
  std::mt19937 rng(1234);
  int const in_width = context * embed;
  std::vector<param> params;
  params.emplace_back("embedding", static_cast<std::size_t>(vocab) * embed, 1.0f, rng);
  params.emplace_back("hidden.weight", static_cast<std::size_t>(in_width) * hidden, 1.0f / std::sqrt(float(in_width)), rng);
  params.emplace_back("hidden.bias", hidden, 0.0f, rng);
  params.emplace_back("out.weight", static_cast<std::size_t>(hidden) * vocab, 1.0f / std::sqrt(float(hidden)), rng);
  params.emplace_back("out.bias", vocab, 0.0f, rng);
  auto& E = params[0]; auto& W1 = params[1]; auto& b1 = params[2]; auto& W2 = params[3]; auto& b2 = params[4];

  opt_options.threads        = o.threads;
  opt_options.chunk_elements = 16384;  // several chunks, so the pipeline has something to overlap
  std::optional<tracer> timeline;     // --trace's (made before the optimizer, which points to it)
  auto const made      = make_optimizer<Optimizer>(world, {.lr = 3e-3, .weight_decay = 0.01}, opt_options);
  auto& opt            = *made;
  constexpr bool can_trace = requires { opt.trace(nullptr); };
  if (!can_trace && !o.trace.empty() && world.rank() == 0) {
    std::printf("--trace: not with ranks::sharded (each rank's optimizer traces alone): no trace written\n");
  }
  std::size_t n_params = 0;
  for (auto& p : params) {
    opt.add_tensor(p.name, p.w.data(), p.w.size());
    n_params += p.w.size();
  }
  opt.add_group({.lr = 3e-3, .weight_decay = 0.0}, {"hidden.bias", "out.bias", "embedding"});

  std::printf("char_mlp: %zu parameters (bf16, %zu bytes) over %zu characters of %s (vocabulary %d)\n",
              n_params, n_params * sizeof(bf16), text.size(), o.text.c_str(), vocab);
  if constexpr (requires { opt.prepare(); }) { opt.prepare(); }  // (every rank hears of a rank's failure)
  std::string const summary = state_summary(opt, where);
  if (world.size() == 1) {
    std::printf("optimizer state: %s\n", summary.c_str());
  } else {
    std::printf("optimizer state: %zu ranks, each with about 1/%zu of it; rank 0's: %s\n", world.size(), world.size(),
                summary.c_str());
  }

  int const B = o.batch;
  std::vector<float> x(static_cast<std::size_t>(B) * in_width), h(static_cast<std::size_t>(B) * hidden),
    logits(static_cast<std::size_t>(B) * vocab), dh(static_cast<std::size_t>(B) * hidden), dx(static_cast<std::size_t>(B) * in_width);
  std::vector<int> ctx(static_cast<std::size_t>(B) * context), target(B);
  std::uniform_int_distribution<std::size_t> pick(0, text.size() - context - 1);

  double first_loss = 0, running = 0, optimizer_seconds = 0, wait_seconds = 0;
  std::uint64_t io_bytes = 0;
  auto const t_start = std::chrono::steady_clock::now();
  for (int step = 1; step <= o.steps; ++step) {
    weights const wt{E.weights(), W1.weights(), b1.weights(), W2.weights(), b2.weights()};
    auto const& w1 = wt.w1;
    auto const& w2 = wt.w2;
    for (auto& p : params) { std::fill(p.acc.begin(), p.acc.end(), 0.0f); }
    double loss = 0;
    // Forward, of this rank's examples (every rank draws the whole batch: the same batches
    // whatever the rank count).
    auto const mine = [&world](int s) { return static_cast<std::size_t>(s) % world.size() == world.rank(); };
    for (int s = 0; s < B; ++s) {
      std::size_t const at = pick(rng);
      std::copy_n(&ids[at], context, &ctx[static_cast<std::size_t>(s) * context]);
      target[s] = ids[at + context];
      if (!mine(s)) { continue; }
      float* ls = &logits[static_cast<std::size_t>(s) * vocab];
      forward(wt, &ctx[static_cast<std::size_t>(s) * context], vocab, &x[static_cast<std::size_t>(s) * in_width],
              &h[static_cast<std::size_t>(s) * hidden], ls);
      float const mx = *std::max_element(ls, ls + vocab);
      double sum     = 0;
      for (int k = 0; k < vocab; ++k) { sum += std::exp(static_cast<double>(ls[k] - mx)); }
      loss += std::log(sum) - (ls[target[s]] - mx);
      // dlogits = (softmax - onehot) / B, in place.
      for (int k = 0; k < vocab; ++k) {
        ls[k] = static_cast<float>(std::exp(static_cast<double>(ls[k] - mx)) / sum) / static_cast<float>(B);
      }
      ls[target[s]] -= 1.0f / static_cast<float>(B);
    }
    loss = world.sum(loss) / B;
    // Backward.
    for (int s = 0; s < B; ++s) {
      if (!mine(s)) { continue; }
      float const* ls = &logits[static_cast<std::size_t>(s) * vocab];
      float const* hs = &h[static_cast<std::size_t>(s) * hidden];
      float* dhs      = &dh[static_cast<std::size_t>(s) * hidden];
      for (int k = 0; k < vocab; ++k) { b2.acc[k] += ls[k]; }
      for (int j = 0; j < hidden; ++j) {
        float* gw       = &W2.acc[static_cast<std::size_t>(j) * vocab];
        float const* wr = &w2[static_cast<std::size_t>(j) * vocab];
        float d         = 0;
        for (int k = 0; k < vocab; ++k) {
          gw[k] += hs[j] * ls[k];
          d += wr[k] * ls[k];
        }
        dhs[j] = d * (1.0f - hs[j] * hs[j]);
        b1.acc[j] += dhs[j];
      }
      float* dxs       = &dx[static_cast<std::size_t>(s) * in_width];
      float const* xs  = &x[static_cast<std::size_t>(s) * in_width];
      for (int i = 0; i < in_width; ++i) {
        float* gw       = &W1.acc[static_cast<std::size_t>(i) * hidden];
        float const* wr = &w1[static_cast<std::size_t>(i) * hidden];
        float d         = 0;
        for (int j = 0; j < hidden; ++j) {
          gw[j] += xs[i] * dhs[j];
          d += wr[j] * dhs[j];
        }
        dxs[i] = d;
      }
      for (int c = 0; c < context; ++c) {
        float* ge = &E.acc[static_cast<std::size_t>(ctx[s * context + c]) * embed];
        for (int e = 0; e < embed; ++e) { ge[e] += dxs[c * embed + e]; }
      }
    }
    // Hand the gradients over as bf16, as a mixed-precision backward would produce them.
    std::vector<grad_view<bf16>> grads;
    for (auto& p : params) {
      for (std::size_t i = 0; i < p.acc.size(); ++i) { p.g[i] = bf16(p.acc[i]); }
      grads.push_back({p.g.data(), p.g.size()});
    }
    // A cosine learning-rate schedule, set on both groups every step.
    double const lr = 3e-3 * (0.1 + 0.9 * 0.5 * (1.0 + std::cos(3.141592653589793 * (step - 1) / o.steps)));
    opt.set_hyperparameters(0, {.lr = lr, .weight_decay = 0.01});
    opt.set_hyperparameters(1, {.lr = lr, .weight_decay = 0.0});
    // The last step traced, with --trace (tierstate/core/trace.hpp).
    if constexpr (can_trace) {
      if (!o.trace.empty() && step == o.steps) { opt.trace(&timeline.emplace()); }
    }
    step_result const r = opt.step(grads);
    if constexpr (can_trace) {
      if (timeline) {
        opt.trace(nullptr);
        timeline->save(o.trace);
        std::printf("step %d's timeline: %zu events in %s (open it in ui.perfetto.dev)\n", step,
                    timeline->events().size(), o.trace.c_str());
      }
    }
    optimizer_seconds += r.stats.total_seconds;
    wait_seconds += r.stats.wait_seconds;
    io_bytes += r.stats.tier_bytes_read + r.stats.tier_bytes_written;

    if (step == 1) { first_loss = loss; running = loss; }
    running = 0.95 * running + 0.05 * loss;
    if (step == 1 || step % 50 == 0 || step == o.steps) {
      double const elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
      std::printf("step %5d  loss %.4f  (smoothed %.4f)  %8.0f chars/s  optimizer step %.3f ms%s\n", step, loss,
                  running, static_cast<double>(step) * B / elapsed, 1e3 * r.stats.total_seconds,
                  r.skipped ? "  [skipped: non-finite gradients]" : "");
    }
  }
  double const elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  std::printf("%d steps in %.2f s (optimizer %.1f%% of it); loss %.4f -> %.4f (uniform guess: %.4f)\n", o.steps,
              elapsed, 100.0 * optimizer_seconds / elapsed, first_loss, running, std::log(static_cast<double>(vocab)));
  if (io_bytes > 0) {
    std::printf("state I/O: %.1f MB read and written, %.3f s of it waited for\n", static_cast<double>(io_bytes) / 1e6,
                wait_seconds);
  }
  // What it learned: continue the text's first characters, sampling from the model.
  weights const wt{E.weights(), W1.weights(), b1.weights(), W2.weights(), b2.weights()};
  std::vector<int> window(ids.begin(), ids.begin() + context);
  std::vector<float> xv(static_cast<std::size_t>(in_width)), hv(hidden), lv(vocab);
  std::string sample;
  for (int n = 0; n < 160; ++n) {
    forward(wt, window.data(), vocab, xv.data(), hv.data(), lv.data());
    float const mx = *std::max_element(lv.begin(), lv.end());
    std::vector<double> p(vocab);
    for (int k = 0; k < vocab; ++k) { p[k] = std::exp(static_cast<double>(lv[k] - mx) * 1.5); }
    int const next = std::discrete_distribution<int>(p.begin(), p.end())(rng);
    sample += static_cast<char>(chars[next]);
    window.erase(window.begin());
    window.push_back(next);
  }
  std::printf("sample: %s%s\n", text.substr(0, context).c_str(), sample.c_str());
  if (!(running < first_loss - 0.5)) {
    std::fprintf(stderr, "char_mlp: the loss did not fall by 0.5 nats\n");
    return 1;
  }
  return 0;
}


int run(world_type& world, int argc, char** argv)
{
  options const o = parse(argc, argv);
  std::ifstream in(o.text, std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "char_mlp: cannot read the text file %s\n", o.text.c_str());
    return 1;
  }
  std::string const text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (text.size() < static_cast<std::size_t>(context) + 2) {
    std::fprintf(stderr, "char_mlp: %s has %zu bytes; need more than %d\n", o.text.c_str(), text.size(), context + 1);
    return 1;
  }
  // Vocabulary: the bytes that occur.
  std::vector<int> index(256, -1);
  std::vector<unsigned char> chars;
  for (unsigned char c : text) {
    if (index[c] < 0) {
      index[c] = static_cast<int>(chars.size());
      chars.push_back(c);
    }
  }
  int const vocab = static_cast<int>(chars.size());
  std::vector<int> ids(text.size());
  for (std::size_t i = 0; i < text.size(); ++i) { ids[i] = index[static_cast<unsigned char>(text[i])]; }

  try {
    if (o.tier == "pinned") {
      using Optimizer = OffloadedOptimizer<AdamW, Bf16Mixed, PinnedHost>;
      return train<Optimizer>(world, o, text, ids, chars, vocab, {}, "PinnedHost (host memory)");
    }
    // NvmeFile: its scratch file is nameless (O_TMPFILE; where the filesystem lacks it,
    // created and unlinked at once), so it can go straight into the temporary directory
    // ($TMPDIR, else /tmp) unless --path names one: nothing is left there, even by SIGKILL.
    std::string const dir = o.path.empty() ? std::filesystem::temp_directory_path().string() : o.path;
    using Optimizer = OffloadedOptimizer<AdamW, Bf16Mixed, NvmeFile, Pipelined<2>>;
    Optimizer::options opt_options;
    opt_options.tier.directory = dir;
    return train<Optimizer>(world, o, text, ids, chars, vocab, opt_options,
                            "NvmeFile (a nameless scratch file in " + dir + ")");
  } catch (std::exception const& e) {
    std::fprintf(stderr, "char_mlp: %s\n", e.what());
    return 1;
  }
}

}  // namespace

int main(int argc, char** argv)
{
#ifdef TIERSTATE_EXAMPLE_MPI
  MPI_Init(&argc, &argv);
  int rc = 0;
  {
    world_type world(MPI_COMM_WORLD);
    if (world.rank() != 0 && std::freopen("/dev/null", "w", stdout) == nullptr) { return 1; }  // rank 0 prints
    rc = run(world, argc, argv);
  }
  MPI_Finalize();
  return rc;
#else
  world_type world;
  return run(world, argc, argv);
#endif
}
