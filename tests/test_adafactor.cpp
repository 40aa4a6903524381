// SPDX-License-Identifier: Apache-2.0
// Adafactor (rules/adafactor.hpp) through the optimizer: against torch's algorithm written
// out in double (over awkward shapes: 1 x 1, 7 x 4095, 4097 x 3, a batch of matrices, a vector
// added by count, a scalar, a matrix reduced in blocks; 120 steps of a changing learning rate, with weight decay), in fp32
// and with bf16 params over an fp32 master; and bit for bit the same on any chunks, threads,
// tier and kind of step (torch's own values: test_golden.cpp).
#include "nvme_support.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

using namespace tierstate;
using namespace tierstate::test;

namespace {

// 300 x 1000 is reduced in blocks of rows on several threads (tensor_phase::blocks_of).
std::vector<tensor_shape> const shapes = {tensor_shape::of({1, 1}),   tensor_shape::of({7, 4095}),
                                         tensor_shape::of({4097, 3}), tensor_shape::of({2, 3, 5}),
                                         tensor_shape::of_vector(1000), tensor_shape::of({}),
                                         tensor_shape::of({300, 1000})};

Adafactor::hyperparameters numbers(int t, int steps)
{
  Adafactor::hyperparameters h;
  h.lr           = lr_at(2e-2, t, steps);
  h.weight_decay = 0.05;
  h.d            = 1.25;
  return h;
}

/// grad_value scaled by row, so the row statistics differ (as a layer's do).
float grad_at(std::size_t t, std::size_t i, int step)
{
  auto const sh = shapes[t];
  float const row_scale = 1.0f + static_cast<float>((i / std::max<std::size_t>(sh.columns, 1)) % 5);
  return row_scale * grad_value(i + 100'003 * t, static_cast<std::uint64_t>(step));
}

/// torch's _single_tensor_adafactor, in double, over weights `w`; `rounded` is the param the
/// model computes with (its RMS scales the step).
struct double_reference {
  std::vector<std::vector<double>> w, row, column, variance;
  template <class P>
  void step(int t, Adafactor::hyperparameters const& h, std::vector<std::vector<float>> const& grads)
  {
    double const w2 = std::pow(static_cast<double>(t), h.beta2_decay);
    double const rho = std::min(h.lr, 1.0 / std::sqrt(static_cast<double>(t)));
    double const eps1 = h.eps[0];
    for (std::size_t k = 0; k < shapes.size(); ++k) {
      auto const sh = shapes[k];
      std::size_t const n = sh.elements(), C = sh.columns, R = sh.rows, B = sh.batches;
      std::vector<double> g(n), v(n);
      double param_squares = 0.0;
      for (std::size_t i = 0; i < n; ++i) {
        g[i] = convert<float>(convert<typename P::grad_type>(grads[k][i]));
        double const p = convert<float>(convert<typename P::param_type>(static_cast<float>(w[k][i])));
        param_squares += p * p;
      }
      double const alpha = std::max(h.eps[1], std::sqrt(param_squares / static_cast<double>(n))) * rho;
      if (sh.vector) {
        for (std::size_t i = 0; i < n; ++i) {
          variance[k][i] += w2 * (g[i] * g[i] - variance[k][i]);
          v[i] = variance[k][i];
        }
      } else {
        for (std::size_t b = 0; b < B; ++b) {
          double mean = 0.0;
          for (std::size_t r = 0; r < R; ++r) {
            double s = 0.0;
            for (std::size_t c = 0; c < C; ++c) { s += g[(b * R + r) * C + c] * g[(b * R + r) * C + c]; }
            row[k][b * R + r] += w2 * (s / static_cast<double>(C) - row[k][b * R + r]);
            mean += row[k][b * R + r];
          }
          mean = std::max(mean / static_cast<double>(R), eps1);
          for (std::size_t c = 0; c < C; ++c) {
            double s = 0.0;
            for (std::size_t r = 0; r < R; ++r) { s += g[(b * R + r) * C + c] * g[(b * R + r) * C + c]; }
            column[k][b * C + c] += w2 * (s / static_cast<double>(R) - column[k][b * C + c]);
          }
          for (std::size_t r = 0; r < R; ++r) {
            for (std::size_t c = 0; c < C; ++c) { v[(b * R + r) * C + c] = row[k][b * R + r] * column[k][b * C + c] / mean; }
          }
        }
      }
      double u_squares = 0.0;
      for (std::size_t i = 0; i < n; ++i) {
        g[i] /= std::sqrt(std::max(v[i], eps1 * eps1));
        u_squares += g[i] * g[i];
      }
      double const clip = std::max(1.0, std::sqrt(u_squares / static_cast<double>(n)) / h.d);
      for (std::size_t i = 0; i < n; ++i) { w[k][i] = w[k][i] * (1.0 - h.lr * h.weight_decay) - alpha / clip * g[i]; }
    }
  }
};

/// What a run leaves: each tensor's weights (the master, with one) and its state.
struct outcome {
  std::vector<std::vector<float>> weights, state;
  bool operator==(outcome const&) const = default;
};

enum class mode { plain, streaming, delayed };

template <class Opt>
outcome train_adafactor(int steps, typename Opt::options o, mode how = mode::plain)
{
  using P = typename Opt::precision_type;
  o.delayed_update = how == mode::delayed;
  Opt opt({}, o);
  std::vector<std::vector<typename P::param_type>> params;
  std::vector<std::vector<typename P::grad_type>> grads;
  std::size_t base = 0;
  for (std::size_t t = 0; t < shapes.size(); ++t) {
    params.emplace_back(shapes[t].elements());
    grads.emplace_back(shapes[t].elements());
    for (auto& x : params.back()) { x = convert<typename P::param_type>(init_value(base++)); }
    if (t == 4) {
      opt.add_tensor("t4", params.back().data(), params.back().size());  // by count: a vector
    } else {
      opt.add_tensor(tensor_name(t), params.back().data(), shapes[t]);
    }
  }
  for (int s = 1; s <= steps; ++s) {
    std::vector<grad_view<typename P::grad_type>> views;
    for (std::size_t t = 0; t < shapes.size(); ++t) {
      for (std::size_t i = 0; i < grads[t].size(); ++i) { grads[t][i] = convert<typename P::grad_type>(grad_at(t, i, s)); }
      views.push_back({grads[t].data(), grads[t].size()});
    }
    opt.set_hyperparameters(0, numbers(s, steps));
    if (how == mode::streaming) {
      opt.begin_step();
      for (std::size_t t = views.size(); t-- > 0;) { opt.grad_ready(t, views[t]); }
      (void)opt.finish_step();
    } else {
      (void)opt.step(views);
    }
  }
  opt.flush();
  outcome r;
  for (std::size_t t = 0; t < shapes.size(); ++t) {
    auto const name = tensor_name(t);
    r.weights.emplace_back(shapes[t].elements());
    if constexpr (P::has_master) {
      opt.copy_state(name, slot::master, r.weights.back());
    } else {
      for (std::size_t i = 0; i < params[t].size(); ++i) { r.weights.back()[i] = convert<float>(params[t][i]); }
    }
    r.state.emplace_back(opt.tensor_state_size(name));
    opt.copy_tensor_state(name, r.state.back());
  }
  return r;
}

template <class P>
using host_opt = OffloadedOptimizer<Adafactor, P, PinnedHost>;
template <class P>
using disk_opt = OffloadedOptimizer<Adafactor, P, NvmeFile>;

}  // namespace

TEMPLATE_TEST_CASE("Adafactor follows its algorithm in double over awkward shapes and 120 steps", "[adafactor]", Fp32,
                   Bf16Mixed)
{
  using P = TestType;
  int const steps = 120;
  double_reference ref;
  std::size_t base = 0;
  for (auto const sh : shapes) {
    ref.w.emplace_back();
    for (std::size_t i = 0; i < sh.elements(); ++i) { ref.w.back().push_back(convert<float>(convert<typename P::param_type>(init_value(base++)))); }
    ref.row.emplace_back(sh.total_rows(), 0.0);
    ref.column.emplace_back(sh.batches * sh.columns, 0.0);
    ref.variance.emplace_back(sh.vector ? sh.columns : 0, 0.0);
  }
  for (int s = 1; s <= steps; ++s) {
    std::vector<std::vector<float>> grads;
    for (std::size_t t = 0; t < shapes.size(); ++t) {
      grads.emplace_back(shapes[t].elements());
      for (std::size_t i = 0; i < grads.back().size(); ++i) { grads.back()[i] = grad_at(t, i, s); }
    }
    ref.step<P>(s, numbers(s, steps), grads);
  }
  auto const got = train_adafactor<host_opt<P>>(steps, chunked<host_opt<P>>(8192, 2));
  double worst_weight = 0.0, worst_statistic = 0.0;
  for (std::size_t t = 0; t < shapes.size(); ++t) {
    for (std::size_t i = 0; i < ref.w[t].size(); ++i) {
      worst_weight = std::max(worst_weight, std::abs(got.weights[t][i] - ref.w[t][i]) / (std::abs(ref.w[t][i]) + 2e-2));
    }
    auto const& stats = shapes[t].vector ? ref.variance[t] : ref.row[t];
    std::vector<double> all(stats);
    if (!shapes[t].vector) { all.insert(all.end(), ref.column[t].begin(), ref.column[t].end()); }
    for (std::size_t i = 0; i < all.size(); ++i) {
      worst_statistic = std::max(worst_statistic, std::abs(got.state[t][i] - all[i]) / (std::abs(all[i]) + 1e-12));
    }
  }
  std::printf("Adafactor, %s: weights within %.3g, statistics within %.3g of the double reference (relative)\n",
              P::name().data(), worst_weight, worst_statistic);
  CHECK(worst_weight <= 2e-5);
  CHECK(worst_statistic <= 2e-6);
  CHECK(got.weights[1][5] != ref.w[1][5] + 1.0);  // (a wrong result fails: see the bounds above)
}

TEMPLATE_TEST_CASE("Adafactor gives the same bits on any chunks, threads, tier and kind of step", "[adafactor][nvme]",
                   Fp32, Bf16Mixed)
{
  using P = TestType;
  int const steps = 9;
  auto const want = train_adafactor<host_opt<P>>(steps, chunked<host_opt<P>>(2048, 1));
  for (std::size_t const chunk : {4096u, 16384u}) {
    for (std::size_t const threads : {1u, 2u}) {
      INFO("chunk " << chunk << ", threads " << threads);
      CHECK(train_adafactor<host_opt<P>>(steps, chunked<host_opt<P>>(chunk, threads)) == want);
    }
  }
  CHECK(train_adafactor<host_opt<P>>(steps, chunked<host_opt<P>>(4096, 2), mode::streaming) == want);
  CHECK(train_adafactor<host_opt<P>>(steps, chunked<host_opt<P>>(4096, 2), mode::delayed) == want);
  scratch_dir d;
  auto o = chunked<disk_opt<P>>(2048, 2);
  o.tier.directory = d.path;
  CHECK(train_adafactor<disk_opt<P>>(steps, o) == want);
  CHECK(train_adafactor<disk_opt<P>>(steps, o, mode::streaming) == want);
  CHECK(train_adafactor<host_opt<P>>(steps - 1, chunked<host_opt<P>>(2048, 1)) != want);  // (a step moves the numbers)
}

TEST_CASE("Adafactor's shapes: a vector is not a 1 x n matrix, a batch is matrices, and a checkpoint keeps both",
          "[adafactor][checkpoint]")
{
  using Opt = host_opt<Fp32>;
  // The same numbers as a vector and as a 1 x n matrix: the state differs in size and kind.
  std::vector<float> a(40, 0.5f), b(40, 0.5f);
  Opt opt;
  opt.add_tensor("vector", a.data(), 40);
  opt.add_tensor("matrix", b.data(), tensor_shape{1, 40});
  CHECK(opt.tensor_state_size("vector") == 41);
  CHECK(opt.tensor_state_size("matrix") == 1 + 40 + 1 + 1);
  CHECK(tensor_shape::of({64, 3, 7, 7}) == tensor_shape{7, 7, 192, false});
  CHECK(tensor_shape::of({5}) == tensor_shape::of_vector(5));
  CHECK(tensor_shape::of({}) == tensor_shape::of_vector(1));
  CHECK(tensor_shape::of({0, 3, 5}) == tensor_shape::of_vector(0));  // (no elements: an empty vector)
  CHECK_THROWS_WITH(opt.add_tensor("none", a.data(), tensor_shape{3, 5, 0}), Catch::Contains("has no batches"));
  CHECK_THROWS_WITH(opt.add_tensor("bad", a.data(), tensor_shape{2, 20, 1, true}),
                    Catch::Contains("a vector's shape is one row of one batch, not 2 x 20"));

  // A batch of two 3 x 4 matrices steps as two matrices: each its own row mean.
  std::vector<float> w(24), gw(24);
  for (std::size_t i = 0; i < 24; ++i) {
    w[i]  = 0.1f * static_cast<float>(i % 7) - 0.3f;
    gw[i] = i < 12 ? 0.01f * static_cast<float>(i + 1) : 3.0f * static_cast<float>(i % 5 + 1);
  }
  auto one = w, two = w;
  Opt batched, first;
  batched.add_tensor("w", one.data(), tensor_shape{3, 4, 2});
  first.add_tensor("w", two.data(), tensor_shape{3, 4});
  (void)batched.step(std::vector<grad_view<float>>{{gw.data(), 24}});
  (void)first.step(std::vector<grad_view<float>>{{gw.data(), 12}});
  // (the two halves' RMS(param) and RMS(update) are the whole tensor's in torch: compare the statistics)
  std::vector<float> s_batched(batched.tensor_state_size("w")), s_first(first.tensor_state_size("w"));
  batched.copy_tensor_state("w", s_batched);
  first.copy_tensor_state("w", s_first);
  CHECK(s_batched.size() == 6 + 8 + 2 + 1);
  for (std::size_t r = 0; r < 3; ++r) { CHECK(s_batched[r] == s_first[r]); }          // rows of matrix 0
  for (std::size_t c = 0; c < 4; ++c) { CHECK(s_batched[6 + c] == s_first[3 + c]); }  // its columns
  CHECK(s_batched[6 + 8] == s_first[3 + 4]);                                           // its row mean
  CHECK(s_batched[6 + 8 + 1] != s_batched[6 + 8]);  // the second matrix's own mean
  using phase = detail::tensor_phase<Adafactor>;
  CHECK(phase::blocks_of(tensor_shape{300, 1000}) == 5);
  CHECK(phase::blocks_of(tensor_shape{4097, 3}) == 1);
  CHECK(phase::blocks_of(tensor_shape::of_vector(1 << 20)) == 1);
  CHECK(phase::blocks_of(tensor_shape{std::size_t{1} << 20, 2}) == 1);  // (64 sets of its statistics: 512 MiB)

  // A checkpoint records batches and vectors, and refuses another shape by name.
  scratch_dir d;
  auto const path = d.path / "a.ckpt";
  batched.save(path.string());
  Opt flat;
  auto three = w;
  flat.add_tensor("w", three.data(), tensor_shape{6, 4});
  CHECK_THROWS_WITH(flat.load(path.string()), Catch::Contains("2 x 3 x 4") && Catch::Contains("6 x 4"));
  Opt same;
  same.add_tensor("w", three.data(), tensor_shape{3, 4, 2});
  same.load(path.string());
  std::vector<float> s_loaded(same.tensor_state_size("w"));
  same.copy_tensor_state("w", s_loaded);
  CHECK(s_loaded == s_batched);
}
