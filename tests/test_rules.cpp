// SPDX-License-Identifier: Apache-2.0
// The rules: hyper-parameters validated as torch.optim.AdamW validates them, slots fixed at
// compile time, coefficients, and the scalar text equal to the SIMD text bit for bit.
#include "support.hpp"

#include <catch2/catch.hpp>

#include <array>
#include <limits>
#include <span>
#include <string>
#include <vector>

using namespace tierstate;
using namespace tierstate::test;

namespace {

template <class R>
void require_refused(typename R::hyperparameters const& h, std::string const& option,
                     std::string const& value)
{
  try {
    R::validate(h);
    FAIL("accepted " << option << " = " << value);
  } catch (invalid_option const& e) {
    CHECK(e.option() == option);
    CHECK(e.value() == value);
    CHECK(std::string(e.what()).find(option + " = " + value) != std::string::npos);
  }
}

}  // namespace

TEMPLATE_TEST_CASE("hyper-parameters are refused exactly where torch refuses them", "[rules]",
                   Adam, AdamW, AdamAmsgrad, AdamWAmsgrad)
{
  using R = TestType;
  std::string const n(R::name);
  double const nan = std::numeric_limits<double>::quiet_NaN();
  double const inf = std::numeric_limits<double>::infinity();

  typename R::hyperparameters h;
  SECTION("defaults are torch's")
  {
    CHECK(h.lr == 1e-3);
    CHECK(h.betas[0] == 0.9);
    CHECK(h.betas[1] == 0.999);
    CHECK(h.eps == 1e-8);
    CHECK(h.weight_decay == (R::decay_mode == weight_decay_mode::decoupled ? 1e-2 : 0.0));
    CHECK_FALSE(h.maximize);
    CHECK_NOTHROW(R::validate(h));
  }
  SECTION("lr")
  {
    h.lr = -1e-3;
    require_refused<R>(h, n + ".lr", "-0.001");
    h.lr = nan;
    require_refused<R>(h, n + ".lr", "nan");
    h.lr = 0.0;
    CHECK_NOTHROW(R::validate(h));
    h.lr = inf;  // 0 <= inf: torch accepts it
    CHECK_NOTHROW(R::validate(h));
  }
  SECTION("eps")
  {
    h.eps = -1e-8;
    require_refused<R>(h, n + ".eps", "-1e-08");
    h.eps = 0.0;
    CHECK_NOTHROW(R::validate(h));
  }
  SECTION("betas")
  {
    h.betas[0] = 1.0;
    require_refused<R>(h, n + ".betas[0]", "1");
    h.betas[0] = -0.1;
    require_refused<R>(h, n + ".betas[0]", "-0.1");
    h.betas[0] = 0.0;
    CHECK_NOTHROW(R::validate(h));
    h.betas[1] = 1.0;
    require_refused<R>(h, n + ".betas[1]", "1");
    h.betas[1] = nan;
    require_refused<R>(h, n + ".betas[1]", "nan");
  }
  SECTION("weight_decay")
  {
    h.weight_decay = -0.01;
    require_refused<R>(h, n + ".weight_decay", "-0.01");
    h.weight_decay = 0.0;
    CHECK_NOTHROW(R::validate(h));
  }
  SECTION("step and gradient scale")
  {
    CHECK_THROWS_AS(R::coefficients_for(h, 0), invalid_option);
    CHECK_THROWS_AS(R::coefficients_for(h, 1, 0.0), invalid_option);
    CHECK_THROWS_AS(R::coefficients_for(h, 1, -2.0), invalid_option);
    CHECK_THROWS_AS(R::coefficients_for(h, 1, nan), invalid_option);
    CHECK_THROWS_AS(R::coefficients_for(h, 1, inf), invalid_option);
    h.lr = -1.0;
    CHECK_THROWS_AS(R::coefficients_for(h, 1), invalid_option);
  }
}

TEST_CASE("slots are fixed at compile time", "[rules]")
{
  STATIC_REQUIRE(rule<Adam>);
  STATIC_REQUIRE(AdamW::slot_count == 2);
  STATIC_REQUIRE(AdamWAmsgrad::slot_count == 3);
  STATIC_REQUIRE(AdamAmsgrad::slots[2] == slot::max_exp_avg_sq);
  STATIC_REQUIRE(slot_name(slot::exp_avg_sq) == "exp_avg_sq");
  STATIC_REQUIRE(Adam::name == "adam");
  STATIC_REQUIRE(AdamWAmsgrad::name == "adamw_amsgrad");
}

TEMPLATE_TEST_CASE("the hyper-parameter table: the checkpoint's values in v1's order, and back", "[rules]",
                   Adam, AdamW, AdamAmsgrad, AdamWAmsgrad)
{
  using R = TestType;
  std::string const n(R::name);
  STATIC_REQUIRE(R::hyperparameter_table.size() == 6);
  typename R::hyperparameters h;
  h.lr           = 0.25;
  h.betas        = {0.5, 0.75};
  h.eps          = 1e-6;
  h.weight_decay = 0.125;
  h.maximize     = true;
  // v1 checkpoints record lr, beta1, beta2, eps, weight_decay, maximize: the table's order.
  auto const v = hyperparameter_values<R>(h);
  CHECK(v == std::array<double, 6>{0.25, 0.5, 0.75, 1e-6, 0.125, 1.0});
  auto const back = hyperparameters_from_values<R>(v);
  CHECK(hyperparameter_values<R>(back) == v);
  CHECK(back.maximize);
  CHECK(back.betas[1] == 0.75);

  std::vector<std::string> names;
  for (auto const& row : R::hyperparameter_table) { names.emplace_back(row.name); }
  CHECK(names == std::vector<std::string>{"lr", "betas[0]", "betas[1]", "eps", "weight_decay", "maximize"});

  // Values a corrupt checkpoint may hold are refused with the row's name and reason.
  auto refused = [&](std::array<double, 6> bad, std::string const& option, std::string const& value) {
    try {
      (void)hyperparameters_from_values<R>(bad);
      FAIL("accepted " << option << " = " << value);
    } catch (invalid_option const& e) {
      CHECK(e.option() == option);
      CHECK(e.value() == value);
    }
  };
  auto bad = v;
  bad[5]   = 2.0;
  refused(bad, n + ".maximize", "2");
  bad    = v;
  bad[2] = 1.0;
  refused(bad, n + ".betas[1]", "1");
  bad    = v;
  bad[0] = std::numeric_limits<double>::quiet_NaN();
  refused(bad, n + ".lr", "nan");
  CHECK_THROWS_AS(hyperparameters_from_values<R>(std::span<double const>(v).first(5)), invalid_option);
}

TEST_CASE("coefficients are torch's scalars, computed in double", "[rules]")
{
  AdamW::hyperparameters h;
  h.lr           = 0.1;
  h.weight_decay = 0.5;
  auto const k   = AdamW::coefficients_for(h, 3, 8.0);
  CHECK(k.grad_mul == 0.125f);
  CHECK(k.decay == static_cast<float>(1.0 - 0.1 * 0.5));
  CHECK(k.neg_step_size == static_cast<float>(-(0.1 / (1.0 - 0.9 * 0.9 * 0.9))));
  CHECK(k.inv_bias_correction2_sqrt == static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(0.999, 3.0))));
  CHECK(k.lerp_from_start);
  h.maximize = true;
  CHECK(AdamW::coefficients_for(h, 1, 8.0).grad_mul == -0.125f);
  h.betas[0] = 0.25;
  CHECK_FALSE(AdamW::coefficients_for(h, 1).lerp_from_start);
}

TEST_CASE("one step from zero state moves each weight by lr against the gradient's sign", "[rules]")
{
  // With m = v = 0, step 1 gives m_hat = g and v_hat = g^2: the step is lr * g / (|g| + eps).
  Adam::hyperparameters h;
  h.lr = 0.01;
  auto const k = Adam::coefficients_for(h, 1);
  for (float const g : {0.5f, -3.0f, 1e-3f}) {
    float w        = 1.0f;
    float s[2]     = {0.0f, 0.0f};
    Adam::update(k, w, g, s);
    reference_element e{1.0, 0, 0, 0};
    reference_step_double(e, g, 0.01, 1, 1.0, reference_for<Adam>(h, false));
    CHECK(w == Approx(e.w).epsilon(1e-7));
    CHECK(w == Approx(1.0 - 0.01 * (g > 0 ? 1 : -1)).epsilon(1e-6));
  }
}

namespace {

template <class R, class P>
void check_scalar_equals_simd()
{
  using param_t = typename P::param_type;
  using grad_t  = typename P::grad_type;
  using state_t = typename P::state_type;
  std::size_t const n = 1000;
  std::vector<param_t> param(n);
  std::vector<float> master(n), w(n);
  std::vector<grad_t> grad(n);
  std::vector<std::vector<state_t>> state(R::slot_count, std::vector<state_t>(n));
  std::vector<std::vector<float>> s(R::slot_count, std::vector<float>(n));
  for (std::size_t i = 0; i < n; ++i) {
    param[i]  = convert<param_t>(init_value(i));
    master[i] = static_cast<float>(param[i]);
    w[i]      = master[i];
  }
  update_arrays<P, R::slot_count> a;
  a.param  = param.data();
  a.grad   = grad.data();
  a.master = master.data();
  for (std::size_t j = 0; j < R::slot_count; ++j) { a.state[j] = state[j].data(); }
  typename R::hyperparameters h;
  h.weight_decay = 0.1;
  for (int t = 1; t <= 30; ++t) {
    for (std::size_t i = 0; i < n; ++i) { grad[i] = convert<grad_t>(grad_value(i, t) * 3.0f); }
    auto const k = R::coefficients_for(h, t, 4.0);
    host::update_range<R, P>(k, a, 0, n);
    for (std::size_t i = 0; i < n; ++i) {
      slot_values<float, R::slot_count> st{};
      if constexpr (R::slot_count > 0) {
        for (std::size_t j = 0; j < R::slot_count; ++j) { st[j] = s[j][i]; }
      }
      R::update(k, w[i], static_cast<float>(convert<float>(grad[i])), st);
      if constexpr (R::slot_count > 0) {
        for (std::size_t j = 0; j < R::slot_count; ++j) {
          s[j][i] = static_cast<float>(convert<state_t>(st[j]));  // stored as the state type
        }
      }
    }
  }
  std::size_t bad = 0;
  for (std::size_t i = 0; i < n; ++i) {
    float const got = P::has_master ? master[i] : static_cast<float>(convert<float>(param[i]));
    bad += bits(got) != bits(w[i]);
    bad += bits(param[i]) != bits(convert<param_t>(w[i]));
    for (std::size_t j = 0; j < R::slot_count; ++j) {
      bad += bits(state[j][i]) != bits(convert<state_t>(s[j][i]));
    }
  }
  INFO(R::name << " " << P::name() << " on " << host::arch_name());
  CHECK(bad == 0);
}

}  // namespace

TEST_CASE("the rule's text gives the same bits on float and on SIMD batches", "[rules][simd]")
{
  check_scalar_equals_simd<Adam, Fp32>();
  check_scalar_equals_simd<AdamW, Bf16Mixed>();
  check_scalar_equals_simd<AdamAmsgrad, Fp16Mixed>();
  check_scalar_equals_simd<AdamWAmsgrad, Bf16MixedBf16State>();
  check_scalar_equals_simd<SGD, Fp32>();
  check_scalar_equals_simd<SGD, Fp16Mixed>();
  check_scalar_equals_simd<SGDMomentum, Fp16Mixed>();
  check_scalar_equals_simd<SGDMomentum, Bf16MixedBf16State>();
  check_scalar_equals_simd<Lion, Fp32>();
  check_scalar_equals_simd<Lion, Bf16Mixed>();
}

TEST_CASE("SGD with momentum: torch.optim.SGD's defaults and refusals, and its one combination", "[rules][sgd]")
{
  double const nan = std::numeric_limits<double>::quiet_NaN();
  SGDMomentum::hyperparameters h;
  CHECK(h.lr == 1e-3);
  CHECK(h.momentum == 0.9);  // torch's default, 0, keeps no buffer
  CHECK(h.dampening == 0.0);
  CHECK(h.weight_decay == 0.0);
  CHECK_FALSE(h.nesterov);
  CHECK_FALSE(h.maximize);
  CHECK_NOTHROW(SGDMomentum::validate(h));
  STATIC_REQUIRE(SGDMomentum::slots[0].name() == "momentum_buffer");

  auto refused = [](SGDMomentum::hyperparameters const& x, std::string const& option, std::string const& value) {
    require_refused<SGDMomentum>(x, option, value);
  };
  auto x = h;
  x.lr   = -0.1;
  refused(x, "sgd_momentum.lr", "-0.1");
  x          = h;
  x.momentum = 0.0;
  refused(x, "sgd_momentum.momentum", "0");
  x.momentum = -0.5;
  refused(x, "sgd_momentum.momentum", "-0.5");
  x.momentum = 1.5;  // torch sets no upper bound
  CHECK_NOTHROW(SGDMomentum::validate(x));
  x              = h;
  x.weight_decay = -1e-4;
  refused(x, "sgd_momentum.weight_decay", "-1e-04");
  x           = h;
  x.dampening = nan;
  refused(x, "sgd_momentum.dampening", "nan");
  x.dampening = -2.0;  // torch accepts any dampening
  CHECK_NOTHROW(SGDMomentum::validate(x));
  x.nesterov = true;
  refused(x, "sgd_momentum.dampening", "-2");
  try {
    SGDMomentum::validate(x);
  } catch (invalid_option const& e) {
    CHECK(std::string(e.what()).find("Nesterov momentum requires a momentum and zero dampening") != std::string::npos);
  }
  x.dampening = 0.0;
  CHECK_NOTHROW(SGDMomentum::validate(x));

  // A checkpoint's values go through the same checks, the combination included.
  auto v = hyperparameter_values<SGDMomentum>(x);
  CHECK(v == std::array<double, 6>{1e-3, 0.9, 0.0, 0.0, 1.0, 0.0});
  v[2] = 0.5;
  CHECK_THROWS_AS(hyperparameters_from_values<SGDMomentum>(v), invalid_option);

  // The buffer starts as the gradient on the first step, whatever the dampening.
  x = h;
  x.dampening = 0.5;
  x.lr        = 0.5;
  float w = 1.0f, s[1] = {0.0f};
  SGDMomentum::update(SGDMomentum::coefficients_for(x, 1), w, 2.0f, s);
  CHECK(s[0] == 2.0f);
  CHECK(w == 0.0f);
  SGDMomentum::update(SGDMomentum::coefficients_for(x, 2), w, 2.0f, s);
  CHECK(s[0] == 0.9f * 2.0f + 1.0f);
  CHECK_THROWS_AS(SGDMomentum::coefficients_for(h, 0), invalid_option);
  CHECK_THROWS_AS(SGDMomentum::coefficients_for(h, 1, 0.0), invalid_option);
}

TEST_CASE("SGD without momentum: no slot, torch's defaults, and momentum refused by name", "[rules][sgd]")
{
  STATIC_REQUIRE(SGD::slots.size() == 0);
  STATIC_REQUIRE(rule<SGD>);
  SGD::hyperparameters h;  // torch.optim.SGD's defaults exactly
  CHECK(h.lr == 1e-3);
  CHECK(h.momentum == 0.0);
  CHECK(h.dampening == 0.0);
  CHECK_NOTHROW(SGD::validate(h));
  auto x     = h;
  x.momentum = 0.9;
  require_refused<SGD>(x, "sgd.momentum", "0.9");
  x          = h;
  x.nesterov = true;  // torch: Nesterov needs a momentum
  require_refused<SGD>(x, "sgd.nesterov", "1");
  x           = h;
  x.dampening = 0.5;  // accepted, and without momentum it changes nothing, as in torch
  CHECK_NOTHROW(SGD::validate(x));
  // The two SGD rules name their numbers alike, in the same order: a trainer picks one by
  // the value of momentum, and a checkpoint of either records the same six values.
  for (std::size_t i = 0; i < 6; ++i) {
    CHECK(SGD::hyperparameter_table[i].name == SGDMomentum::hyperparameter_table[i].name);
  }
  x.lr           = 0.5;
  x.weight_decay = 0.5;
  x.maximize     = true;
  float w        = 2.0f;
  no_slots none;
  SGD::update(SGD::coefficients_for(x, 7, 2.0), w, 3.0f, none);
  CHECK(w == 2.0f - 0.5f * (-1.5f + 0.5f * 2.0f));
}

TEST_CASE("Lion: lion-pytorch's defaults and refusals, and its sign step", "[rules][lion]")
{
  Lion::hyperparameters h;
  CHECK(h.lr == 1e-4);
  CHECK(h.betas == std::array<double, 2>{0.9, 0.99});
  CHECK(h.weight_decay == 0.0);
  CHECK_NOTHROW(Lion::validate(h));
  auto x = h;
  x.lr   = -1.0;
  require_refused<Lion>(x, "lion.lr", "-1");
  x          = h;
  x.betas[0] = 1.5;
  require_refused<Lion>(x, "lion.betas[0]", "1.5");
  x.betas[0] = 1.0;  // the reference admits [0, 1]
  CHECK_NOTHROW(Lion::validate(x));
  x.betas[1] = -0.1;
  require_refused<Lion>(x, "lion.betas[1]", "-0.1");
  x              = h;
  x.weight_decay = -0.1;
  require_refused<Lion>(x, "lion.weight_decay", "-0.1");

  // Every weight moves by exactly lr (after the decay), whatever the gradient's size; a
  // zero interpolation (and a NaN, as torch.sign) moves nothing.
  x.weight_decay = 0.5;
  x.lr           = 0.25;
  auto const k   = Lion::coefficients_for(x, 1);
  for (float const g : {1e-6f, -300.0f, 0.0f}) {
    float w = 2.0f, s[1] = {0.0f};
    Lion::update(k, w, g, s);
    CHECK(w == 2.0f * (1.0f - 0.125f) - (g > 0 ? 0.25f : (g < 0 ? -0.25f : 0.0f)));
    CHECK(s[0] == static_cast<float>(0.01 * g));
  }
  CHECK(math::sign(std::numeric_limits<float>::quiet_NaN()) == 0.0f);
  CHECK(math::sign(-0.0f) == 0.0f);

  // The same on SIMD batches, at every lane: zeros of both signs, NaN, infinities, gradients
  // whose interpolation is subnormal, in a run long enough for whole batches and a tail.
  float const specials[] = {0.0f, -0.0f, std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(), 1e-38f, -1e-38f, 1.0f, -3.0f};
  std::size_t const n = 1000;
  std::vector<float> grad(n), w(n, 1.0f), m(n, 0.0f), w_ref(n, 1.0f), m_ref(n, 0.0f);
  for (std::size_t i = 0; i < n; ++i) { grad[i] = specials[(i * 7) % std::size(specials)]; }
  update_arrays<Fp32, 1> a;
  a.param    = w.data();
  a.grad     = grad.data();
  a.state[0] = m.data();
  Lion::hyperparameters hs;
  hs.lr            = 0.5;
  auto const ks    = Lion::coefficients_for(hs, 1);
  host::update_range<Lion, Fp32>(ks, a, 0, n);
  std::size_t bad = 0;
  for (std::size_t i = 0; i < n; ++i) {
    float st[1] = {m_ref[i]};
    Lion::update(ks, w_ref[i], grad[i], st);
    bad += bits(w[i]) != bits(w_ref[i]) || bits(m[i]) != bits(st[0]);
  }
  CHECK(bad == 0);
  auto const at = [&](std::size_t k) { return std::size_t{(k * 4) % 9}; };  // grad[at(k)] is specials[k] (7 * 4 = 1 mod 9)
  CHECK(w[at(0)] == 1.0f);  // sign(0): no step
  CHECK(w[at(1)] == 1.0f);  // sign(-0): no step
  CHECK(w[at(2)] == 1.0f);  // sign(NaN): no step, as torch.sign; the momentum takes the NaN
  CHECK(m[at(2)] != m[at(2)]);
  CHECK(w[at(5)] == 0.5f);  // a subnormal interpolation (0.1 * 1e-38) still has a sign
  CHECK(w[at(6)] == 1.5f);
}
