// SPDX-License-Identifier: Apache-2.0
// Parameter offload from a hand-written trainer: a deep residual MLP (an input layer, `depth`
// residual tanh layers, an output layer: softmax cross-entropy over 10 classes of a fixed
// random teacher) whose bf16 weights rest on NVMe with their optimizer state, and come into
// host memory a window of layers at a time, as a trainer like llm.c would use tierstate:
//
//   offloaded_params<bf16, NvmeFile> weights(...);   // the weights' tier and window
//   OffloadedOptimizer<AdamW, Bf16Mixed, NvmeFile, Pipelined<2>> opt(...);   // the state
//   opt.add_tensor(weights, id) for every tensor;   // the update writes new weights there
//   each step: opt.begin_step();
//     forward:  for l in 0..L-1: view = weights.acquire(l); ...; weights.release(l);
//     backward: for l in L-1..0: view = weights.acquire(l); ...; weights.release(l);
//               opt.grad_ready(t, grad) for the layer's tensors (updated at once: no checks;
//               the gradient is written beside the weights, and its buffer serves the next layer)
//     opt.finish_step(); weights.end_iteration();
//
// Host memory for the weights is (window + 1) buffers of one layer, and the biases (under
// the persistence threshold), whatever the depth; for their gradients, one layer's. --compare trains the same model a second
// time with its weights in plain host arrays (OffloadedOptimizer::add_tensor(name, ptr))
// and fails unless every loss and every final weight is the same, bit for bit.
//
//   build/examples/layered_mlp [--depth L] [--width D] [--steps N] [--batch B] [--window W]
//                              [--path DIR] [--compare]
#include <tierstate/tierstate.hpp>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <span>
#include <string>
#include <vector>

namespace {

using namespace tierstate;

constexpr int inputs  = 32;
constexpr int classes = 10;

struct options {
  int depth       = 8;
  int width       = 256;
  int steps       = 60;
  int batch       = 32;
  unsigned window = 2;
  std::string path;
  bool compare = false;
};

[[noreturn]] void usage(std::string const& why)
{
  std::fprintf(stderr,
               "layered_mlp: %s\nusage: layered_mlp [--depth L (1..1024)] [--width D (8..8192)] [--steps N (1..100000)] "
               "[--batch B (1..4096)] [--window W (1..64)] [--path DIR] [--compare]\n",
               why.c_str());
  std::exit(2);
}

int bounded(std::string const& a, char const* v, int lo, int hi)
{
  char* end    = nullptr;
  long const n = std::strtol(v, &end, 10);
  if (*v == '\0' || *end != '\0' || n < lo || n > hi) {
    usage(a + " " + v + ": not an integer in " + std::to_string(lo) + ".." + std::to_string(hi));
  }
  return static_cast<int>(n);
}

options parse(int argc, char** argv)
{
  options o;
  for (int i = 1; i < argc; ++i) {
    std::string const a = argv[i];
    if (a == "--compare") {
      o.compare = true;
      continue;
    }
    if (i + 1 >= argc) { usage("missing value after " + a); }
    char const* v = argv[++i];
    if (a == "--depth") {
      o.depth = bounded(a, v, 1, 1024);
    } else if (a == "--width") {
      o.width = bounded(a, v, 8, 8192);
    } else if (a == "--steps") {
      o.steps = bounded(a, v, 1, 100000);
    } else if (a == "--batch") {
      o.batch = bounded(a, v, 1, 4096);
    } else if (a == "--window") {
      o.window = static_cast<unsigned>(bounded(a, v, 1, 64));
    } else if (a == "--path" && *v != '\0') {
      o.path = v;
    } else {
      usage("bad argument " + a);
    }
  }
  return o;
}

/// One layer's shape: y = W x + b, then (hidden layers) x + tanh(y) or tanh(y).
struct layer_shape {
  int in, out;
  bool hidden, residual;
};

std::vector<layer_shape> shapes(options const& o)
{
  std::vector<layer_shape> s = {{inputs, o.width, true, false}};
  for (int l = 0; l < o.depth; ++l) { s.push_back({o.width, o.width, true, true}); }
  s.push_back({o.width, classes, false, false});
  return s;
}

void widen(std::span<bf16 const> from, std::vector<float>& to)
{
  to.resize(from.size());
  for (std::size_t i = 0; i < from.size(); ++i) { to[i] = static_cast<float>(from[i]); }
}

/// Where the weights are: a layer's W and b as floats, whichever way they are kept.
struct weights_source {
  virtual ~weights_source()                          = default;
  virtual void get(std::size_t l, std::vector<float>& w, std::vector<float>& b) = 0;
  virtual void put(std::size_t /*layer, or -1: the iteration ends*/) {}
};

/// Trains `o.steps` steps; the loss of each step goes to `losses`. `kept`: grad_ready hands
/// every gradient to the weights' source (offloaded_params' keep_grads), so one layer's
/// gradient buffer serves every layer; otherwise each layer's stays until finish_step.
template <class Opt>
void train(options const& o, Opt& opt, weights_source& src, std::vector<std::size_t> const& ids,
           std::vector<float>& losses, bool kept)
{
  auto const s = shapes(o);
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> teacher(classes * inputs);
  for (auto& t : teacher) { t = normal(rng); }
  std::vector<std::vector<float>> acts(s.size() + 1), pre(s.size());
  std::vector<std::vector<bf16>> grad_w(kept ? 1 : s.size()), grad_b(kept ? 1 : s.size());
  std::vector<float> w, b;
  for (int step = 0; step < o.steps; ++step) {
    // A batch and its labels: the teacher's argmax.
    std::size_t const B = static_cast<std::size_t>(o.batch);
    acts[0].resize(B * inputs);
    for (auto& x : acts[0]) { x = normal(rng); }
    std::vector<int> label(B);
    for (std::size_t n = 0; n < B; ++n) {
      float best = -1e30f;
      for (int c = 0; c < classes; ++c) {
        float z = 0;
        for (int i = 0; i < inputs; ++i) { z += teacher[c * inputs + i] * acts[0][n * inputs + i]; }
        if (z > best) { best = z, label[n] = c; }
      }
    }
    opt.begin_step();
    for (std::size_t l = 0; l < s.size(); ++l) {  // forward
      src.get(l, w, b);
      auto const [in, out, hidden, residual] = s[l];
      pre[l].assign(B * out, 0.0f);
      acts[l + 1].assign(B * out, 0.0f);
      for (std::size_t n = 0; n < B; ++n) {
        for (int j = 0; j < out; ++j) {
          float z = b[j];
          for (int i = 0; i < in; ++i) { z += w[j * in + i] * acts[l][n * in + i]; }
          pre[l][n * out + j]      = z;
          acts[l + 1][n * out + j] = hidden ? std::tanh(z) + (residual ? acts[l][n * in + j] : 0.0f) : z;
        }
      }
      src.put(l);
    }
    // Softmax cross-entropy; d holds dLoss/d(output of the layer being walked back).
    std::vector<float> d(B * classes);
    double loss = 0;
    for (std::size_t n = 0; n < B; ++n) {
      float const* z = &acts[s.size()][n * classes];
      float m        = z[0];
      for (int c = 1; c < classes; ++c) { m = std::max(m, z[c]); }
      float sum = 0;
      for (int c = 0; c < classes; ++c) { sum += std::exp(z[c] - m); }
      loss += std::log(sum) + m - z[label[n]];
      for (int c = 0; c < classes; ++c) {
        d[n * classes + c] = (std::exp(z[c] - m) / sum - (c == label[n] ? 1.0f : 0.0f)) / static_cast<float>(B);
      }
    }
    losses.push_back(static_cast<float>(loss / static_cast<double>(B)));
    for (std::size_t l = s.size(); l-- > 0;) {  // backward
      src.get(l, w, b);
      auto const [in, out, hidden, residual] = s[l];
      std::size_t const gl = kept ? 0 : l;  // (this layer's gradient buffer)
      grad_w[gl].resize(static_cast<std::size_t>(in) * out);
      grad_b[gl].resize(static_cast<std::size_t>(out));
      std::vector<float> dz(d.size()), dx(B * in, 0.0f), gw(grad_w[gl].size(), 0.0f), gb(out, 0.0f);
      for (std::size_t n = 0; n < B; ++n) {
        for (int j = 0; j < out; ++j) {
          float const t   = hidden ? std::tanh(pre[l][n * out + j]) : 0.0f;
          float const g   = d[n * out + j];
          dz[n * out + j] = hidden ? g * (1.0f - t * t) : g;
          if (residual) { dx[n * in + j] += g; }
        }
      }
      for (std::size_t n = 0; n < B; ++n) {
        for (int j = 0; j < out; ++j) {
          float const g = dz[n * out + j];
          gb[j] += g;
          for (int i = 0; i < in; ++i) {
            gw[j * in + i] += g * acts[l][n * in + i];
            dx[n * in + i] += g * w[j * in + i];
          }
        }
      }
      src.put(l);
      for (std::size_t i = 0; i < gw.size(); ++i) { grad_w[gl][i] = bf16(gw[i]); }
      for (int j = 0; j < out; ++j) { grad_b[gl][j] = bf16(gb[j]); }
      // Final now: the optimizer updates them (no checks, no clipping) while backward goes on;
      // offloaded, they are written beside the weights before grad_ready returns.
      opt.grad_ready(ids[2 * l], {grad_w[gl].data(), grad_w[gl].size()});
      opt.grad_ready(ids[2 * l + 1], {grad_b[gl].data(), grad_b[gl].size()});
      d = std::move(dx);
    }
    opt.finish_step();
    src.put(static_cast<std::size_t>(-1));  // the iteration's end
  }
}

std::string name_of(std::size_t layer, char const* suffix)
{
  return std::string("layer").append(std::to_string(layer)).append(suffix);
}

using state_opt = OffloadedOptimizer<AdamW, Bf16Mixed, NvmeFile, Pipelined<2>>;

state_opt::options state_options(options const& o)
{
  state_opt::options so;
  so.tier.directory = o.path;
  so.on_nonfinite   = nonfinite_policy::ignore;  // each layer is updated as its gradients arrive
  so.chunk_elements = 1 << 16;
  return so;
}

/// Residual branches start small (1/sqrt(depth) of a plain layer's scale), so that the
/// activations do not grow with depth.
void init_layer(layer_shape const& s, int depth, std::mt19937& rng, std::vector<bf16>& w, std::vector<bf16>& b)
{
  std::normal_distribution<float> normal(0.0f, 1.0f / std::sqrt(static_cast<float>(s.in)));
  float const scale = s.residual ? 1.0f / std::sqrt(static_cast<float>(depth)) : 1.0f;
  w.resize(static_cast<std::size_t>(s.in) * s.out);
  b.assign(static_cast<std::size_t>(s.out), bf16(0.0f));
  for (auto& x : w) { x = bf16(normal(rng) * scale); }
}

}  // namespace

int main(int argc, char** argv)
{
  options o = parse(argc, argv);
  if (o.path.empty()) { o.path = std::filesystem::temp_directory_path().string(); }
  auto const s = shapes(o);
  AdamW::hyperparameters h;
  h.lr           = 1e-3;
  h.weight_decay = 0.01;
  try {
    // The weights on NVMe, a window of layers in host memory; biases stay resident.
    offloaded_params<bf16, NvmeFile>::options wo;
    wo.tier.directory          = o.path;
    wo.window                  = o.window;
    wo.persistence_threshold   = 8192;
    offloaded_params<bf16, NvmeFile> weights(wo);
    state_opt opt(h, state_options(o));
    std::vector<std::size_t> ids;
    std::mt19937 init(1);
    std::vector<std::vector<bf16>> first_w(s.size()), first_b(s.size());
    for (std::size_t l = 0; l < s.size(); ++l) {
      auto const layer = weights.add_layer(name_of(l, ""));
      ids.push_back(weights.add_tensor(layer, name_of(l, ".w"), static_cast<std::size_t>(s[l].in) * s[l].out));
      ids.push_back(weights.add_tensor(layer, name_of(l, ".b"), static_cast<std::size_t>(s[l].out)));
    }
    for (std::size_t l = 0; l < s.size(); ++l) {
      init_layer(s[l], o.depth, init, first_w[l], first_b[l]);
      weights.write(ids[2 * l], 0, first_w[l]);
      weights.write(ids[2 * l + 1], 0, first_b[l]);
      opt.add_tensor(weights, ids[2 * l]);
      opt.add_tensor(weights, ids[2 * l + 1]);
    }

    struct offloaded : weights_source {
      offloaded_params<bf16, NvmeFile>& p;
      explicit offloaded(offloaded_params<bf16, NvmeFile>& q) : p(q) {}
      void get(std::size_t l, std::vector<float>& w, std::vector<float>& b) override
      {
        auto const v = p.acquire(l);
        widen(v.tensor(0), w);
        widen(v.tensor(1), b);
      }
      void put(std::size_t l) override
      {
        if (l == static_cast<std::size_t>(-1)) {
          p.end_iteration();
        } else {
          p.release(l);
        }
      }
    } src(weights);
    std::vector<float> losses;
    train(o, opt, src, ids, losses, opt.keeps_gradient(ids[0]));
    auto const st = weights.stats();
    std::size_t model_bytes = 0;
    for (std::size_t t = 0; t < weights.tensor_count(); ++t) { model_bytes += weights.tensor_size(t) * sizeof(bf16); }
    std::printf("layered_mlp: %zu layers of width %d, %.2f MB of bf16 weights on NVMe (%s) with %.2f MB of state\n",
                s.size(), o.width, static_cast<double>(model_bytes) / 1e6, o.path.c_str(),
                static_cast<double>(opt.state_layout().total_bytes()) / 1e6);
    std::printf("  host memory for the weights: %zu buffers x %.3f MB + %.3f MB resident (biases)\n",
                weights.buffer_count(), static_cast<double>(weights.buffer_bytes()) / 1e6,
                static_cast<double>(weights.resident_bytes()) / 1e6);
    std::printf("  gradients kept beside the weights: %.2f MB written, %.2f MB read back by the updates\n",
                static_cast<double>(st.grad_bytes_written) / 1e6, static_cast<double>(st.grad_bytes_read) / 1e6);
    std::printf("  loss: step 1 %.4f, step %d %.4f; window %u: %llu acquires, %llu ready, %llu waited, %llu on demand, "
                "%llu out of order, %.3f s waiting\n",
                losses.front(), o.steps, losses.back(), o.window, static_cast<unsigned long long>(st.acquires),
                static_cast<unsigned long long>(st.ready), static_cast<unsigned long long>(st.waited),
                static_cast<unsigned long long>(st.on_demand), static_cast<unsigned long long>(st.out_of_order),
                st.wait_seconds);
    if (!(losses.back() < losses.front())) {
      std::fprintf(stderr, "layered_mlp: the loss did not go down\n");
      return 1;
    }
    if (!o.compare) { return 0; }

    // The same training with the weights in host arrays.
    state_opt plain_opt(h, state_options(o));
    for (std::size_t l = 0; l < s.size(); ++l) {
      plain_opt.add_tensor(name_of(l, ".w"), first_w[l].data(), first_w[l].size());
      plain_opt.add_tensor(name_of(l, ".b"), first_b[l].data(), first_b[l].size());
    }
    struct in_memory : weights_source {
      std::vector<std::vector<bf16>>& w_;
      std::vector<std::vector<bf16>>& b_;
      in_memory(std::vector<std::vector<bf16>>& w, std::vector<std::vector<bf16>>& b) : w_(w), b_(b) {}
      void get(std::size_t l, std::vector<float>& w, std::vector<float>& b) override
      {
        widen(w_[l], w);
        widen(b_[l], b);
      }
    } mem(first_w, first_b);
    std::vector<std::size_t> plain_ids(ids.size());
    for (std::size_t i = 0; i < ids.size(); ++i) { plain_ids[i] = i; }
    std::vector<float> plain_losses;
    train(o, plain_opt, mem, plain_ids, plain_losses, false);
    bool same = std::memcmp(losses.data(), plain_losses.data(), losses.size() * sizeof(float)) == 0;
    for (std::size_t l = 0; l < s.size() && same; ++l) {
      std::vector<bf16> back(first_w[l].size());
      weights.read(ids[2 * l], 0, back);
      same = std::memcmp(back.data(), first_w[l].data(), back.size() * sizeof(bf16)) == 0;
      back.resize(first_b[l].size());
      weights.read(ids[2 * l + 1], 0, back);
      same = same && std::memcmp(back.data(), first_b[l].data(), back.size() * sizeof(bf16)) == 0;
    }
    std::printf("  --compare: weights in host arrays give %s losses and final weights\n",
                same ? "the same (bit for bit)" : "DIFFERENT");
    return same ? 0 : 1;
  } catch (std::exception const& e) {
    std::fprintf(stderr, "layered_mlp: %s\n", e.what());
    return 1;
  }
}
