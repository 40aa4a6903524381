// SPDX-License-Identifier: Apache-2.0
// OnHostDispatched (kernels/host/dispatch.hpp): this program is built for plain x86-64 and its
// kernels once per level (unit.cpp). For each composition of kernels.hpp, 12 steps over
// tensors of awkward sizes with the dispatched kernels move the params, and are bit-identical
// to the same optimizer's with OnHost<> (this build's SSE2 kernels: the kernels fuse their
// multiply-adds at every level) and across thread counts and chunk sizes. meson runs it with
// TIERSTATE_ARCH unset and set to each level (77 where the CPU lacks it), and with a level that
// does not exist (--refused: dispatched_host_level() must refuse it, naming it).
#include "kernels.hpp"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace {

using namespace dispatch_test;

int failures = 0;

void check(bool ok, std::string const& what)
{
  if (!ok) {
    ++failures;
    std::printf("FAILED: %s\n", what.c_str());
  }
}

template <class R, class P, class Compute>
std::vector<float> train(std::size_t threads, std::size_t chunk)
{
  using Opt    = OffloadedOptimizer<R, P, PinnedHost, Synchronous, Compute>;
  using param_t = typename P::param_type;
  using grad_t  = typename P::grad_type;
  // Awkward sizes: one element, a partial SIMD batch, a partial 8-bit block, and a matrix
  // (Adafactor's rows and columns) spanning several chunks.
  std::vector<tensor_shape> const shapes = {tensor_shape::of_vector(1), tensor_shape::of_vector(1000),
                                            tensor_shape::of_vector(4099), tensor_shape{67, 1031, 1, false}};
  std::size_t total = 0;
  for (auto const& s : shapes) { total += s.elements(); }
  std::vector<param_t> params(total);
  std::vector<grad_t> grads(total);
  for (std::size_t i = 0; i < total; ++i) {
    params[i] = static_cast<param_t>(0.5f + 0.25f * std::sin(static_cast<float>(i) * 0.37f));
  }
  typename Opt::options o;
  o.threads = threads;
  if (chunk != 0) { o.chunk_elements = chunk; }
  typename R::hyperparameters h{};
  h.lr = 1e-2;
  Opt opt(h, o);
  std::vector<grad_view<grad_t>> views;
  for (std::size_t t = 0, off = 0; t < shapes.size(); off += shapes[t].elements(), ++t) {
    std::string name = "t";  // (not "t" + ...: GCC 12 -Wrestrict false positive, bug 105329)
    name += std::to_string(t);
    opt.add_tensor(std::move(name), params.data() + off, shapes[t]);
    views.push_back({grads.data() + off, shapes[t].elements(), location::host});
  }
  for (std::uint64_t step = 1; step <= 12; ++step) {
    for (std::size_t i = 0; i < total; ++i) {
      auto const r = static_cast<float>((i * 2654435761u + step * 40503u) % 2001u) - 1000.0f;
      grads[i]     = static_cast<grad_t>(r * 1e-3f);
    }
    opt.step(views);
  }
  std::vector<float> out(total);
  for (std::size_t i = 0; i < total; ++i) { out[i] = static_cast<float>(params[i]); }
  return out;
}

template <class K>
void check_kernel()
{
  using R = typename K::rule_type;
  using P = typename K::precision_type;
  std::string const name = std::string(R::name) + " " + P::name();
  auto const dispatched  = train<R, P, OnHostDispatched<kernels>>(2, 0);
  auto const baseline    = train<R, P, OnHost<>>(2, 0);
  auto const initial     = [&] {
    std::vector<float> v(dispatched.size());
    for (std::size_t i = 0; i < v.size(); ++i) {
      v[i] = static_cast<float>(static_cast<typename P::param_type>(0.5f + 0.25f * std::sin(static_cast<float>(i) * 0.37f)));
    }
    return v;
  }();
  std::size_t moved = 0, differ = 0;
  for (std::size_t i = 0; i < dispatched.size(); ++i) {
    moved += dispatched[i] != initial[i];
    differ += std::memcmp(&dispatched[i], &baseline[i], sizeof(float)) != 0;
  }
  check(moved > dispatched.size() / 2, name + ": the dispatched steps moved " + std::to_string(moved) + " of " +
                                         std::to_string(dispatched.size()) + " params");
  check(differ == 0, name + ": " + std::to_string(differ) + " params differ from OnHost<>'s");
  check(train<R, P, OnHostDispatched<kernels>>(1, 8192) == dispatched,
        name + ": one thread and 8192-element chunks differ from two threads and the default chunks");
  std::printf("%-50s moved %zu of %zu params, %zu differ from OnHost<>'s\n", name.c_str(), moved, dispatched.size(),
              differ);
}

template <class... K>
void check_all(host_kernels<K...>*)
{
  (check_kernel<K>(), ...);
}

}  // namespace

int main(int argc, char** argv)
{
  char const* forced = std::getenv("TIERSTATE_ARCH");
  if (argc > 1 && std::string_view(argv[1]) == "--refused") {
    try {
      (void)dispatched_host_level();
      std::printf("FAILED: TIERSTATE_ARCH=%s was not refused\n", forced != nullptr ? forced : "");
      return 1;
    } catch (invalid_option const& e) {
      std::printf("refused: %s\n", e.what());
      return e.option() == "TIERSTATE_ARCH" && std::string_view(e.what()).find("unset it") != std::string_view::npos ? 0 : 1;
    }
  }
  host_level l{};
  try {
    l = dispatched_host_level();
  } catch (invalid_option const& e) {
    // Only a level this CPU lacks is a skip; any other refusal fails.
    std::printf("%s\n", e.what());
    return std::string_view(e.what()).find("cannot run") != std::string_view::npos ? 77 : 1;
  }
  std::printf("kernels: %s (program built for %s)\n", l.name, host::arch_name());
  if (forced != nullptr && *forced != '\0') { check(std::string_view(forced) == l.name, "TIERSTATE_ARCH is not the level chosen"); }
  check_all(static_cast<kernels*>(nullptr));
  std::printf("%s\n", failures == 0 ? "ok" : "FAILED");
  return failures == 0 ? 0 : 1;
}
