// SPDX-License-Identifier: Apache-2.0
// Per-tensor step counts, as torch.optim keeps state["step"]: a tensor without a gradient in
// a step is not updated and its count does not advance, so its next update has the bias
// corrections of its own next step. Checked against an optimizer that holds the tensor alone
// and steps only when it has a gradient (bit for bit: the numbers do not depend on where an
// element falls), for step(), streaming steps and the delayed update; the counts through
// set_step_count and a checkpoint; version-1 checkpoints (tests/data/checkpoint_v1, written
// by the previous format) loading into today's optimizer; and version 2's table of sections
// refusing what it must, by name.
#include "nvme_support.hpp"
#include "row_column_rule.hpp"

#include <catch2/catch.hpp>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

using namespace tierstate;
using namespace tierstate::test;

namespace {

template <class Rule>
using opt_of = OffloadedOptimizer<Rule, Bf16Mixed, PinnedHost, Synchronous>;
using Opt    = opt_of<AdamW>;

template <class Rule>
typename Rule::hyperparameters numbers_of()
{
  typename Rule::hyperparameters h;
  h.lr           = 3e-3;
  h.weight_decay = 0.02;
  if constexpr (std::is_same_v<Rule, SGDMomentum>) { h.dampening = 0.3; }  // where a late first step shows
  return h;
}

/// Two tensors, x and y; y has no gradient in steps t with t % 3 == 1, its first among them
/// (a conditionally computed tensor). `alone`: y only, stepped only when it has a gradient.
template <class Rule = AdamW>
struct two_tensors_of {
  using Opt = opt_of<Rule>;
  std::vector<bf16> x, y;
  std::vector<bf16> gx, gy;
  Opt opt;
  bool alone;
  explicit two_tensors_of(bool alone_, typename Opt::options o = make_options())
    : opt(numbers_of<Rule>(), o), alone(alone_)
  {
    for (std::size_t i = 0; i < 4097; ++i) { y.push_back(bf16(init_value(i + 7))); }
    if (!alone) {
      for (std::size_t i = 0; i < 1000; ++i) { x.push_back(bf16(init_value(i))); }
      opt.add_tensor("x", x.data(), x.size());
    }
    opt.add_tensor("y", y.data(), y.size());
    gx.resize(x.size());
    gy.resize(y.size());
  }
  static typename Opt::options make_options()
  {
    typename Opt::options o;
    o.chunk_elements = 2048;  // y spans chunks, and shares one with x
    return o;
  }
  static bool y_absent(int t) { return t % 3 == 1; }
  /// The gradients of step t; whether this optimizer steps at all.
  bool grads(int t, std::vector<grad_view<bf16>>& views)
  {
    for (std::size_t i = 0; i < gx.size(); ++i) { gx[i] = bf16(grad_value(i, static_cast<std::uint64_t>(t))); }
    for (std::size_t i = 0; i < gy.size(); ++i) { gy[i] = bf16(grad_value(i + 5, static_cast<std::uint64_t>(t))); }
    grad_view<bf16> const vy = y_absent(t) ? grad_view<bf16>{} : grad_view<bf16>{gy.data(), gy.size()};
    views.clear();
    if (!alone) { views.push_back({gx.data(), gx.size()}); }
    views.push_back(vy);
    return !(alone && y_absent(t));
  }
  void steps(int n, bool streaming = false)
  {
    std::vector<grad_view<bf16>> views;
    for (int t = 1; t <= n; ++t) {
      if (!grads(t, views)) { continue; }
      if (streaming) {
        opt.begin_step();
        for (std::size_t k = views.size(); k-- > 0;) {  // backward order; an absent one is never handed over
          if (views[k].data != nullptr) { opt.grad_ready(k, views[k]); }
        }
        (void)opt.finish_step();
      } else {
        (void)opt.step(views);
      }
    }
    (void)opt.flush();
  }
  [[nodiscard]] std::vector<std::vector<float>> y_state()
  {
    std::vector<std::vector<float>> s;
    s.emplace_back(y.size());
    opt.copy_state("y", slot::master, s.back());
    for (slot const sl : Rule::slots) {
      s.emplace_back(y.size());
      opt.copy_state("y", sl, s.back());
    }
    std::vector<float> params;
    for (bf16 const v : y) { params.push_back(static_cast<float>(v)); }
    s.push_back(std::move(params));
    return s;
  }
};
using two_tensors = two_tensors_of<>;

}  // namespace

TEMPLATE_TEST_CASE("a tensor without a gradient keeps its own step count: bias corrections, a first step",
                   "[steps]", AdamW, SGDMomentum, Lion)
{
  for (int const how : {0, 1, 2}) {  // step(), streaming steps, delayed update
    INFO((how == 0 ? "step()" : how == 1 ? "streaming" : "delayed_update"));
    auto o = two_tensors_of<TestType>::make_options();
    o.delayed_update = how == 2;
    two_tensors_of<TestType> both(false, o), alone(true, o);
    both.steps(14, how == 1);
    alone.steps(14, how == 1);
    CHECK(both.opt.step_count() == 14);
    CHECK(both.opt.step_count("x") == 14);
    CHECK(both.opt.step_count("y") == 9);  // steps 1, 4, 7, 10 and 13 had no gradient for y
    CHECK(alone.opt.step_count("y") == 9);
    CHECK(both.y_state() == alone.y_state());
  }
}

TEST_CASE("set_step_count: all tensors, or one by name; refusals change nothing", "[steps]")
{
  two_tensors a(false), b(false);
  a.steps(4);
  b.steps(4);
  a.opt.set_step_count("y", 40);
  CHECK(a.opt.step_count("y") == 40);
  CHECK(a.opt.step_count("x") == 4);
  CHECK(a.opt.step_count() == 4);
  CHECK_THROWS_WITH(a.opt.set_step_count("z", 1), Catch::Contains("'z'"));
  CHECK_THROWS_WITH(a.opt.set_step_count("y", -1), Catch::Contains("tensor 'y'") && Catch::Contains("[0, 2^53]"));
  CHECK_THROWS_WITH(a.opt.step_count("z"), Catch::Contains("'z'"));
  CHECK_THROWS_WITH(a.opt.set_step_count("y", (std::int64_t{1} << 53) + 1), Catch::Contains("[0, 2^53]"));
  CHECK_THROWS_WITH(a.opt.set_step_count(std::int64_t{1} << 62), Catch::Contains("[0, 2^53]"));
  a.opt.begin_step();  // the step's driver counts while it runs: no reading a count meanwhile
  CHECK_THROWS_WITH(a.opt.step_count("y"), Catch::Contains("streaming step is in progress"));
  (void)a.opt.finish_step();
  CHECK(a.opt.step_count("y") == 40);  // (no tensor had a gradient)
  CHECK(a.opt.step_count() == 5);
  CHECK(a.opt.step_count("y") == 40);
  a.opt.set_step_count(7);
  CHECK(a.opt.step_count("x") == 7);
  CHECK(a.opt.step_count("y") == 7);
  CHECK(a.opt.step_count() == 7);
  // What the counts mean: y at its own count 40 continues as an optimizer whose y is at 40.
  b.opt.set_step_count(40);
  a.opt.set_step_count("y", 40);
  std::vector<grad_view<bf16>> va, vb;
  (void)a.grads(5, va);
  (void)b.grads(5, vb);
  (void)a.opt.step(va);
  (void)b.opt.step(vb);
  CHECK(a.y_state() == b.y_state());
}

TEST_CASE("a checkpoint keeps every tensor's step count", "[steps][checkpoint]")
{
  scratch_dir d;
  two_tensors a(false), b(false);
  a.steps(8);
  a.opt.save(d.path / "steps.ckpt");
  b.opt.load(d.path / "steps.ckpt");
  CHECK(b.opt.step_count() == 8);
  CHECK(b.opt.step_count("x") == 8);
  CHECK(b.opt.step_count("y") == 5);
  CHECK(b.y_state() == a.y_state());
}

namespace {

/// A pattern of values exact in every precision involved (multiples of 2^-10 below 0.05).
float pattern(std::size_t i, unsigned salt)
{
  return static_cast<float>(static_cast<int>((i * 37 + salt * 11) % 97) - 48) / 1024.0f;
}

std::filesystem::path const v1_dir = std::filesystem::path(TIERSTATE_TEST_DATA) / "checkpoint_v1";

/// The optimizers tests/data/checkpoint_v1 were saved from (by tierstate at commit 1f374fb,
/// whose format was version 1): state written, not computed, so any build makes the same.
struct v1_adamw {
  std::vector<bf16> a = std::vector<bf16>(700, bf16(0.5f)), b = std::vector<bf16>(61, bf16(-0.25f)),
                    c = std::vector<bf16>(1000, bf16(0.125f));
  Opt opt;
  explicit v1_adamw(bool written) : opt({.lr = 1e-3, .weight_decay = 0.01}, options<Opt>())
  {
    opt.add_tensor("a", a.data(), a.size());
    opt.add_tensor("b", b.data(), b.size());
    opt.add_tensor("c", c.data(), tensor_shape{40, 25});
    opt.add_group({.lr = 2e-3, .weight_decay = 0.0}, {"b"});
    if (!written) { return; }
    opt.set_step_count(3);
    char const* const names[] = {"a", "b", "c"};
    std::size_t const sizes[] = {700, 61, 1000};
    for (unsigned t = 0; t < 3; ++t) {
      unsigned s = 0;
      for (slot const sl : {slot::master, slot::exp_avg, slot::exp_avg_sq}) {
        std::vector<float> v(sizes[t]);
        for (std::size_t i = 0; i < v.size(); ++i) {
          v[i] = pattern(i, s + 3 * t);
          if (sl == slot::exp_avg_sq) { v[i] *= v[i]; }
        }
        opt.write_state(names[t], sl, v);
        ++s;
      }
    }
  }
  template <class O>
  static typename O::options options()
  {
    typename O::options o;
    o.chunk_elements = 2048;
    o.threads        = 1;
    return o;
  }
  void step(int t)
  {
    std::vector<bf16> ga(a.size(), bf16(0.01f * static_cast<float>(t))), gb(b.size(), bf16(-0.02f)),
      gc(c.size(), bf16(0.003f * static_cast<float>(t)));
    std::vector<grad_view<bf16>> const g = {{ga.data(), ga.size()}, {gb.data(), gb.size()}, {gc.data(), gc.size()}};
    (void)opt.step(g);
  }
  std::vector<float> everything()
  {
    std::vector<float> out;
    for (auto const* p : {&a, &b, &c}) {
      char const name[] = {p == &a ? 'a' : p == &b ? 'b' : 'c', '\0'};
      for (slot const sl : {slot::master, slot::exp_avg, slot::exp_avg_sq}) {
        std::vector<float> v(p->size());
        opt.copy_state(name, sl, v);
        out.insert(out.end(), v.begin(), v.end());
      }
    }
    for (auto const* p : {&a, &b, &c}) {
      for (bf16 const v : *p) { out.push_back(static_cast<float>(v)); }
    }
    return out;
  }
};

using RcOpt = OffloadedOptimizer<RowColumn, Fp32, PinnedHost, Synchronous>;

struct v1_row_column {
  std::vector<float> w = std::vector<float>(7 * 33, 0.5f), v = std::vector<float>(50, -0.75f);
  RcOpt opt;
  explicit v1_row_column(bool written) : opt({}, v1_adamw::options<RcOpt>())
  {
    opt.add_tensor("w", w.data(), tensor_shape{7, 33});
    opt.add_tensor("v", v.data(), v.size());
    if (!written) { return; }
    opt.set_step_count(3);
    char const* const names[] = {"w", "v"};
    std::size_t const sizes[] = {7 * 33, 50};
    for (unsigned t = 0; t < 2; ++t) {
      std::vector<float> m(sizes[t]);
      for (std::size_t i = 0; i < m.size(); ++i) { m[i] = pattern(i, 5 + t); }
      opt.write_state(names[t], slot{"momentum"}, m);
      std::vector<float> ts(opt.tensor_state_size(names[t]));
      for (std::size_t i = 0; i < ts.size(); ++i) { ts[i] = 1.0f + pattern(i, 9 + t) * pattern(i, 9 + t); }
      opt.write_tensor_state(names[t], ts);
    }
  }
  void step(int t)
  {
    std::vector<float> gw(w.size()), gv(v.size());
    for (std::size_t i = 0; i < gw.size(); ++i) { gw[i] = grad_value(i, static_cast<std::uint64_t>(t)); }
    for (std::size_t i = 0; i < gv.size(); ++i) { gv[i] = grad_value(i + 3, static_cast<std::uint64_t>(t)); }
    std::vector<grad_view<float>> const g = {{gw.data(), gw.size()}, {gv.data(), gv.size()}};
    (void)opt.step(g);
  }
  std::vector<float> everything()
  {
    std::vector<float> out(w.begin(), w.end());
    out.insert(out.end(), v.begin(), v.end());
    for (char const* n : {"w", "v"}) {
      std::vector<float> m(n[0] == 'w' ? w.size() : v.size());
      opt.copy_state(n, slot{"momentum"}, m);
      out.insert(out.end(), m.begin(), m.end());
      std::vector<float> ts(opt.tensor_state_size(n));
      opt.copy_tensor_state(n, ts);
      out.insert(out.end(), ts.begin(), ts.end());
    }
    return out;
  }
};

}  // namespace

TEMPLATE_TEST_CASE("version-1 checkpoints load: state, groups, shapes and step counts, then the same steps",
                   "[checkpoint][v1]", v1_adamw, v1_row_column)
{
  auto const file = v1_dir / (std::is_same_v<TestType, v1_adamw> ? "adamw_bf16_mixed.ckpt" : "row_column_fp32.ckpt");
  REQUIRE(std::filesystem::exists(file));
  TestType written(true), loaded(false);
  loaded.opt.load(file);
  CHECK(loaded.opt.step_count() == 3);
  for (auto const& t : written.opt.state_layout().tensors()) { CHECK(loaded.opt.step_count(t.name) == 3); }
  if constexpr (std::is_same_v<TestType, v1_adamw>) {
    CHECK(loaded.opt.group_of("b") == 1);
    CHECK(loaded.opt.get_hyperparameters(1).lr == 2e-3);
    CHECK(loaded.opt.get_hyperparameters(0).weight_decay == 0.01);
  }
  // The params follow the loaded master on load; the written optimizer's follow it at its
  // next step. So the comparison is after steps, which both take alike.
  for (int t = 1; t <= 5; ++t) {
    written.step(t);
    loaded.step(t);
  }
  CHECK(loaded.everything() == written.everything());
  CHECK(loaded.opt.step_count() == 8);
}

namespace {

/// Rewrites a checkpoint's header payload with `edit` (and its size and checksum), in place:
/// the new header must fit in the old header region.
template <class Edit>
void rewrite_payload(std::filesystem::path const& p, Edit&& edit)
{
  std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
  std::vector<std::byte> region(4096);
  f.read(reinterpret_cast<char*>(region.data()), static_cast<std::streamsize>(region.size()));
  std::uint64_t size;
  std::memcpy(&size, region.data() + 16, 8);
  std::vector<std::byte> payload(region.begin() + 32, region.begin() + 32 + static_cast<std::ptrdiff_t>(size));
  edit(payload);
  REQUIRE(32 + payload.size() + 8 <= region.size());
  std::fill(region.begin() + 32, region.end(), std::byte{0});
  size = payload.size();
  std::memcpy(region.data() + 16, &size, 8);
  std::memcpy(region.data() + 32, payload.data(), payload.size());
  std::uint64_t const sum = checkpoint::checksum(region.data(), 32 + payload.size());
  std::memcpy(region.data() + 32 + payload.size(), &sum, 8);
  f.seekp(0);
  f.write(reinterpret_cast<char const*>(region.data()), static_cast<std::streamsize>(region.size()));
}

/// Appends a section (tag, flags, body) to a version-2 payload.
void add_section(std::vector<std::byte>& payload, char const (&tag)[5], std::uint32_t flags, std::string_view body)
{
  std::uint32_t count;
  std::memcpy(&count, payload.data(), 4);
  ++count;
  std::memcpy(payload.data(), &count, 4);
  auto put = [&](void const* p, std::size_t n) {
    auto const* b = static_cast<std::byte const*>(p);
    payload.insert(payload.end(), b, b + n);
  };
  put(tag, 4);
  put(&flags, 4);
  std::uint64_t const n = body.size();
  put(&n, 8);
  put(body.data(), body.size());
}

/// Replaces the first occurrence of `from` in the payload by `to` (of the same length).
void replace_bytes(std::vector<std::byte>& payload, std::string_view from, std::string_view to)
{
  REQUIRE(from.size() == to.size());
  auto const* begin = reinterpret_cast<char const*>(payload.data());
  std::string_view const all(begin, payload.size());
  auto const at = all.find(from);
  REQUIRE(at != std::string_view::npos);
  std::memcpy(payload.data() + at, to.data(), to.size());
}

}  // namespace

TEST_CASE("version 2: sections a reader does not know are skipped, or refused when required", "[checkpoint][v2]")
{
  scratch_dir d;
  auto const file = d.path / "opt.ckpt";
  two_tensors a(false), b(false);
  a.steps(4);
  a.opt.save(file);
  auto const before = b.y_state();

  SECTION("an optional section of a later version is skipped")
  {
    rewrite_payload(file, [](std::vector<std::byte>& p) { add_section(p, "futr", 0, "anything at all"); });
    b.opt.load(file);
    CHECK(b.y_state() == a.y_state());
    CHECK(b.opt.step_count("y") == 2);
  }
  SECTION("a required one is refused by its tag, and nothing changes")
  {
    rewrite_payload(file, [](std::vector<std::byte>& p) { add_section(p, "futr", 1, "anything"); });
    CHECK_THROWS_WITH(b.opt.load(file), Catch::Contains("section \"futr\"") && Catch::Contains("newer tierstate"));
    CHECK(b.y_state() == before);
    CHECK(b.opt.step_count() == 0);
  }
  SECTION("a section twice is corrupt")
  {
    rewrite_payload(file, [](std::vector<std::byte>& p) { add_section(p, "step", 1, std::string(8, '\0')); });
    CHECK_THROWS_WITH(b.opt.load(file), Catch::Contains("section \"step\" twice"));
  }
  SECTION("another rule's table of hyper-parameters is refused by name")
  {
    rewrite_payload(file, [](std::vector<std::byte>& p) { replace_bytes(p, "weight_decay", "weight_decxy"); });
    CHECK_THROWS_WITH(b.opt.load(file), Catch::Contains("weight_decxy") && Catch::Contains("adamw's (lr, "));
    CHECK(b.y_state() == before);
  }
  SECTION("another codec for a slot is refused by name")
  {
    using namespace std::string_literals;
    rewrite_payload(file, [](std::vector<std::byte>& p) {  // exp_avg's codec: its name's length, then the name
      replace_bytes(p, "exp_avg\x04\0\0\0fp32"s, "exp_avg\x04\0\0\0fq32"s);
    });
    CHECK_THROWS_WITH(b.opt.load(file), Catch::Contains("slot 1") && Catch::Contains("codec 'fq32'") &&
                                          Catch::Contains("exp_avg: id 1, codec 'fp32'"));
  }
  SECTION("a shape that is not the tensor's count is corrupt")
  {
    rewrite_payload(file, [](std::vector<std::byte>& p) {
      auto const* begin = reinterpret_cast<char const*>(p.data());
      auto const at     = std::string_view(begin, p.size()).find("tens");
      REQUIRE(at != std::string_view::npos);
      std::size_t const rows_at = at + 16 + 8 + 4 + 1 + 24 + 8;  // x's rows, after its step
      std::uint64_t const rows  = 3;
      std::memcpy(p.data() + rows_at, &rows, 8);
    });
    CHECK_THROWS_WITH(b.opt.load(file), Catch::Contains("tensor 'x' of 1000 elements is shaped 3 x 1000"));
  }
  SECTION("a negative step count of a tensor is corrupt")
  {
    rewrite_payload(file, [](std::vector<std::byte>& p) {
      // "tens": x's entry is its name, offset, count, group, then its step.
      auto const* begin = reinterpret_cast<char const*>(p.data());
      auto const at     = std::string_view(begin, p.size()).find("tens");
      REQUIRE(at != std::string_view::npos);
      std::size_t const step_at = at + 16 + 8 + 4 + 1 + 24;
      std::int64_t const minus = -2;
      std::memcpy(p.data() + step_at, &minus, 8);
    });
    CHECK_THROWS_WITH(b.opt.load(file), Catch::Contains("tensor 'x' has step count -2"));
  }
}
