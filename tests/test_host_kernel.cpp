// SPDX-License-Identifier: Apache-2.0
// The host kernels against a plain double-precision reference of torch.optim's update:
// every rule and precision, 120 steps with a changing learning rate, awkward sizes, several
// thread counts and split points, which must all give the same bits.
#include "matrix.hpp"
#include "rule_references.hpp"
#include "support.hpp"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <utility>

#include <sys/mman.h>

using namespace tierstate;
using namespace tierstate::test;

namespace {

constexpr int steps = 120;

/// One optimizer's arrays for n elements, initialised as a trainer would: the master from
/// the param as stored.
template <class R, class P>
struct arrays_for {
  using param_t = typename P::param_type;
  using state_t = typename P::state_type;

  std::size_t n;
  std::vector<param_t> param;
  std::vector<float> master;
  std::vector<std::vector<state_t>> state;

  explicit arrays_for(std::size_t size)
    : n(size), param(size), master(P::has_master ? size : 0), state(R::slot_count)
  {
    for (std::size_t i = 0; i < n; ++i) {
      param[i] = convert<param_t>(init_value(i));
      if constexpr (P::has_master) { master[i] = static_cast<float>(param[i]); }
    }
    for (auto& s : state) { s.assign(n, convert<state_t>(0.0f)); }
  }

  [[nodiscard]] float weight(std::size_t i) const
  {
    if constexpr (P::has_master) {
      return master[i];
    } else {
      return param[i];
    }
  }

  update_arrays<P, R::slot_count> view(typename P::grad_type const* grad)
  {
    update_arrays<P, R::slot_count> a;
    a.param  = param.data();
    a.grad   = grad;
    a.master = P::has_master ? master.data() : nullptr;
    for (std::size_t j = 0; j < R::slot_count; ++j) { a.state[j] = state[j].data(); }
    return a;
  }

  /// Index of the first element whose bits differ from `o`'s, or n.
  [[nodiscard]] std::size_t first_difference(arrays_for const& o) const
  {
    for (std::size_t i = 0; i < n; ++i) {
      bool same = bits(param[i]) == bits(o.param[i]);
      if constexpr (P::has_master) { same = same && bits(master[i]) == bits(o.master[i]); }
      for (std::size_t j = 0; j < R::slot_count; ++j) {
        same = same && bits(state[j][i]) == bits(o.state[j][i]);
      }
      if (!same) { return i; }
    }
    return n;
  }
};

/// The ways a run may split its work; all must give the same bits.
enum class split { one_thread, two_threads, three_threads, five_threads, ragged_ranges };

template <class R, class P>
void check_against_reference(std::size_t n, typename R::hyperparameters const& h, double lr_max,
                             double grad_scale)
{
  using grad_t = typename P::grad_type;
  bool const bf16_state = std::is_same_v<typename P::state_type, bf16>;
  double const tol      = bf16_state ? 1e-3 : 1e-5;

  std::vector<split> const splits = {split::one_thread, split::two_threads, split::three_threads,
                                     split::five_threads, split::ragged_ranges};
  std::vector<arrays_for<R, P>> runs;
  for (std::size_t k = 0; k < splits.size(); ++k) { runs.emplace_back(n); }
  thread_pool pool2(2), pool3(3), pool5(5);

  std::vector<grad_t> grad(n);
  for (int t = 1; t <= steps; ++t) {
    for (std::size_t i = 0; i < n; ++i) {
      grad[i] = convert<grad_t>(static_cast<float>(grad_value(i, t) * grad_scale));
    }
    auto hp = h;
    hp.lr   = lr_at(lr_max, t, steps);
    auto const k = R::coefficients_for(hp, t, grad_scale);
    for (std::size_t r = 0; r < splits.size(); ++r) {
      auto const a = runs[r].view(grad.data());
      switch (splits[r]) {
        case split::one_thread: host::update_range<R, P>(k, a, 0, n); break;
        case split::two_threads: host::update<R, P>(pool2, k, a, n); break;
        case split::three_threads: host::update<R, P>(pool3, k, a, n); break;
        case split::five_threads: host::update<R, P>(pool5, k, a, n); break;
        case split::ragged_ranges: {
          // Unaligned boundaries that move every step, as chunks spanning tensors would.
          std::size_t b = 0;
          std::size_t len = 1 + static_cast<std::size_t>(t) % 13;
          while (b < n) {
            std::size_t const e = std::min(n, b + len);
            host::update_range<R, P>(k, a, b, e);
            b   = e;
            len = len * 3 + 5;
          }
          break;
        }
      }
    }
  }

  for (std::size_t r = 1; r < runs.size(); ++r) {
    INFO("split " << r << " differs from one thread at element " << runs[r].first_difference(runs[0]));
    REQUIRE(runs[r].first_difference(runs[0]) == n);
  }

  // Every element of small arrays; of large ones the first and last 2048 (all tails and
  // batch boundaries) and every 257th.
  std::vector<std::size_t> checked;
  for (std::size_t i = 0; i < n; ++i) {
    if (n <= 8192 || i < 2048 || i + 2048 >= n || i % 257 == 0) { checked.push_back(i); }
  }
  reference_model<R> const ref(h, bf16_state);
  auto const& got = runs[0];
  std::size_t failures = 0;
  std::size_t first_bad = n;
  double worst_ref = 0, worst_got = 0;
  for (std::size_t const i : checked) {
    reference_element e;
    e.w = static_cast<float>(convert<typename P::param_type>(init_value(i)));  // as stored
    double path = 0.0;
    for (int t = 1; t <= steps; ++t) {
      float const g = static_cast<float>(convert<grad_t>(static_cast<float>(grad_value(i, t) * grad_scale)));
      double const before = e.w;
      ref.step(e, g, lr_at(lr_max, t, steps), t, grad_scale);
      path += std::abs(e.w - before);
    }
    // Rounding errors accumulate with the distance travelled: an element near zero that
    // moved far (SGD's momentum) carries the errors of every step it took.
    double const w = got.weight(i);
    if (!(std::abs(w - e.w) <= tol * (std::abs(e.w) + lr_max + path))) {
      if (failures++ == 0) {
        first_bad = i;
        worst_ref = e.w;
        worst_got = w;
      }
    }
    if constexpr (P::has_master) {
      if (bits(got.param[i]) != bits(convert<typename P::param_type>(got.master[i]))) {
        if (failures++ == 0) {
          first_bad = i;
          worst_ref = static_cast<float>(convert<typename P::param_type>(got.master[i]));
          worst_got = static_cast<float>(got.param[i]);
        }
      }
    }
  }
  INFO(R::name << " " << P::name() << " n=" << n << ": " << failures << " of " << checked.size()
               << " elements off; first at " << first_bad << ": reference " << worst_ref
               << ", got " << worst_got);
  REQUIRE(failures == 0);
}

/// 2^20 + 3, or TIERSTATE_TEST_LARGE_SIZE: the sanitizer builds of .ci/run lower it, since
/// under ASan and TSan each element costs 15-50 times more and a larger array reaches no
/// code path that 65539 elements on five threads does not.
std::size_t large_size()
{
  static std::size_t const n = [] {
    std::size_t size = (std::size_t{1} << 20) + 3;
    if (char const* env = std::getenv("TIERSTATE_TEST_LARGE_SIZE")) {
      size = std::strtoull(env, nullptr, 10);
      if (size < 4097) { size = 4097; }
    }
    std::printf("host kernel test: large size %zu elements\n", size);
    return size;
  }();
  return n;
}

template <class R, class P>
struct combo {
  using rule      = R;
  using precision = P;
};

}  // namespace

namespace {

/// Every rule with every named precision; reduced (tests/matrix.hpp), each rule once and each
/// precision once: the conversions and the rules' branches are all still reached, in the
/// builds that run for another -march or a sanitizer.
using rules_x_precisions = matrix::pick<
  std::tuple<combo<Adam, Fp32>, combo<Adam, Bf16Mixed>, combo<Adam, Fp16Mixed>, combo<Adam, Bf16MixedBf16State>,
             combo<AdamW, Fp32>, combo<AdamW, Bf16Mixed>, combo<AdamW, Fp16Mixed>,
             combo<AdamW, Bf16MixedBf16State>, combo<AdamAmsgrad, Fp32>, combo<AdamAmsgrad, Bf16Mixed>,
             combo<AdamAmsgrad, Fp16Mixed>, combo<AdamAmsgrad, Bf16MixedBf16State>, combo<AdamWAmsgrad, Fp32>,
             combo<AdamWAmsgrad, Bf16Mixed>, combo<AdamWAmsgrad, Fp16Mixed>,
             combo<AdamWAmsgrad, Bf16MixedBf16State>, combo<SGDMomentum, Fp32>, combo<SGDMomentum, Bf16Mixed>,
             combo<SGDMomentum, Fp16Mixed>, combo<SGDMomentum, Bf16MixedBf16State>, combo<Lion, Fp32>,
             combo<Lion, Bf16Mixed>, combo<Lion, Fp16Mixed>, combo<Lion, Bf16MixedBf16State>, combo<SGD, Fp32>,
             combo<SGD, Bf16Mixed>, combo<SGD, Fp16Mixed>>,
  std::tuple<combo<Adam, Fp32>, combo<AdamW, Bf16Mixed>, combo<AdamAmsgrad, Fp16Mixed>,
             combo<AdamWAmsgrad, Bf16MixedBf16State>, combo<SGDMomentum, Bf16MixedBf16State>, combo<Lion, Fp16Mixed>,
             combo<SGD, Bf16Mixed>>>;

}  // namespace

TEMPLATE_LIST_TEST_CASE("host kernel matches the double reference and splits give the same bits",
                        "[host][reference]", rules_x_precisions)
{
  using R = typename TestType::rule;
  using P = typename TestType::precision;
  // fp16 gradients are what loss scaling is for: scale them, as GradScaler would.
  double const scale = std::is_same_v<typename P::grad_type, fp16> ? 1024.0 : 1.0;

  SECTION("torch defaults")
  {
    typename R::hyperparameters h;
    for (std::size_t const n : {std::size_t{1}, std::size_t{7}, std::size_t{4095}, std::size_t{4097},
                                large_size()}) {
      check_against_reference<R, P>(n, h, 1e-2, scale);
    }
  }
  SECTION("beta1 < 0.5, weight decay, maximize, Nesterov, a gradient scale")
  {
    for (std::size_t const n : {std::size_t{1}, std::size_t{7}, std::size_t{4095}, std::size_t{4097}}) {
      check_against_reference<R, P>(n, unusual_hyperparameters<R>(), 3e-3, 4.0 * scale);
    }
  }
  if constexpr (requires(typename R::hyperparameters h) { h.dampening; }) {
    SECTION("dampening, weight decay, maximize")
    {
      for (std::size_t const n : {std::size_t{7}, std::size_t{4097}}) {
        check_against_reference<R, P>(n, unusual_hyperparameters_2<R>(), 3e-3, 4.0 * scale);
      }
    }
  }
}

TEMPLATE_TEST_CASE("host non-finite check: every special value at every position, nothing finite counted",
                   "[host][nonfinite]", float, bf16, fp16)
{
  using T = TestType;
  thread_pool pool(3);
  float const inf = std::numeric_limits<float>::infinity();
  // The largest finite value of T, its negative, a subnormal, zeros: never found.
  float const largest = std::is_same_v<T, fp16>   ? 65504.0f
                        : std::is_same_v<T, bf16> ? 3.3895313892515355e38f
                                                  : std::numeric_limits<float>::max();
  for (std::size_t const n : {std::size_t{1}, std::size_t{15}, std::size_t{4097}, std::size_t{40009}}) {
    std::vector<T> g(n);
    for (std::size_t i = 0; i < n; ++i) {
      float const v = i % 4 == 0 ? largest : i % 4 == 1 ? -largest : i % 4 == 2 ? 1e-40f : -0.0f;
      g[i] = convert<T>(v);
    }
    REQUIRE_FALSE(host::any_nonfinite(g.data(), n));
    REQUIRE_FALSE(host::any_nonfinite(pool, g.data(), n));
    std::size_t const stride = n > 100 ? 997 : 1;
    float const nan = std::numeric_limits<float>::quiet_NaN();
    for (float const special : {inf, -inf, nan, -nan}) {
      for (std::size_t at = 0; at < n; at += stride) {
        T const kept = g[at];
        g[at]        = convert<T>(special);
        INFO("n " << n << ", position " << at << ", value " << special);
        CHECK(host::any_nonfinite(g.data(), n));
        CHECK(host::any_nonfinite(pool, g.data(), n));
        g[at] = kept;
      }
      T const kept = g[n - 1];  // the last element too
      g[n - 1]     = convert<T>(special);
      CHECK(host::any_nonfinite(pool, g.data(), n));
      g[n - 1] = kept;
    }
  }
}

namespace {

/// One 4 KiB page to use, followed by 15 inaccessible ones: the kernels' prefetches, 8 pages
/// ahead, land in them.
class page_before_a_guard {
 public:
  page_before_a_guard()
  {
    void* p = ::mmap(nullptr, 16 * 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    REQUIRE(p != MAP_FAILED);
    p_ = static_cast<std::byte*>(p);
    REQUIRE(::mprotect(p_ + 4096, 15 * 4096, PROT_NONE) == 0);
  }
  ~page_before_a_guard() { ::munmap(p_, 16 * 4096); }
  page_before_a_guard(page_before_a_guard const&)            = delete;
  page_before_a_guard& operator=(page_before_a_guard const&) = delete;
  template <class T>
  [[nodiscard]] T* get() const noexcept
  {
    return reinterpret_cast<T*>(p_);
  }

 private:
  std::byte* p_ = nullptr;
};

}  // namespace

TEST_CASE("host kernels: the prefetches ahead of a stream never fault past its memory, nor change a bit",
          "[host][prefetch]")
{
  constexpr std::size_t n = 1024;  // every array exactly its page
  page_before_a_guard param, grad, m, v;
  std::vector<float> param2(n), grad2(n), m2(n, 0.0f), v2(n, 0.0f);
  for (std::size_t i = 0; i < n; ++i) {
    param.get<float>()[i] = param2[i] = init_value(i);
    grad.get<float>()[i] = grad2[i] = 1e-3f * static_cast<float>(static_cast<int>(i % 17) - 8);
    m.get<float>()[i] = v.get<float>()[i] = 0.0f;
  }
  REQUIRE_FALSE(host::any_nonfinite(grad.get<float>(), n));
  grad.get<float>()[n - 1] = std::numeric_limits<float>::infinity();
  REQUIRE(host::any_nonfinite(grad.get<float>(), n));
  grad.get<float>()[n - 1] = grad2[n - 1];

  update_arrays<Fp32, 2> guarded, plain;
  guarded.param = param.get<float>(), guarded.grad = grad.get<float>();
  guarded.state = {m.get<float>(), v.get<float>()};
  plain.param = param2.data(), plain.grad = grad2.data(), plain.state = {m2.data(), v2.data()};
  AdamW::hyperparameters h;
  thread_pool pool(2);
  for (std::int64_t step = 1; step <= 3; ++step) {
    host::update<AdamW, Fp32>(pool, AdamW::coefficients_for(h, step), guarded, n);
    host::update<AdamW, Fp32>(pool, AdamW::coefficients_for(h, step), plain, n);
  }
  CHECK(std::memcmp(param.get<float>(), param2.data(), n * sizeof(float)) == 0);
  CHECK(std::memcmp(m.get<float>(), m2.data(), n * sizeof(float)) == 0);
  CHECK(std::memcmp(v.get<float>(), v2.data(), n * sizeof(float)) == 0);
}
