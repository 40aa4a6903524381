// SPDX-License-Identifier: Apache-2.0
// Shared by the NVMe tests: scratch directories, and one training run whose every bit
// (params, master and slots) can be compared between compositions.
#pragma once

#include "support.hpp"

#include <catch2/catch.hpp>

#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace tierstate::test {

/// A fresh directory (mkdtemp) under `parent`, removed with everything in it at the end.
struct scratch_dir {
  std::filesystem::path path;
  explicit scratch_dir(std::filesystem::path const& parent = std::filesystem::temp_directory_path())
  {
    std::string t = (parent / "tierstate-test-XXXXXX").string();
    if (::mkdtemp(t.data()) == nullptr) { throw std::runtime_error("mkdtemp in " + parent.string() + " failed"); }
    path = t;
  }
  ~scratch_dir()
  {
    std::error_code ec;
    std::filesystem::permissions(path, std::filesystem::perms::owner_all, ec);
    std::filesystem::remove_all(path, ec);
  }
  scratch_dir(scratch_dir const&)            = delete;
  scratch_dir& operator=(scratch_dir const&) = delete;

  /// The names of the entries in the directory.
  [[nodiscard]] std::vector<std::string> entries() const
  {
    std::vector<std::string> out;
    for (auto const& e : std::filesystem::directory_iterator(path)) {
      if (e.path().filename() != "lost+found") { out.push_back(e.path().filename().string()); }
    }
    return out;
  }
};

/// Tensor sizes that do and do not fill chunks: below a batch, straddling 2048 and 4096
/// boundaries, a whole number of 2048-element chunks, and larger than a few chunks.
inline std::vector<std::size_t> const nvme_sizes = {1, 4097, 7, 6144, 30011, 2047, 3};

/// Everything a training run leaves: params as bits, and every slot of every tensor.
struct run_result {
  std::vector<std::vector<std::uint32_t>> params;               // [tensor][i], bits widened
  std::vector<std::vector<std::vector<float>>> slots;          // [slot][tensor][i]
  std::int64_t steps = 0;
  bool operator==(run_result const&) const = default;
};

/// Options with `chunk` elements per chunk and `threads` threads (0: the default).
template <class Opt>
typename Opt::options chunked(std::size_t chunk, std::size_t threads = 0)
{
  typename Opt::options o;
  o.chunk_elements = chunk;
  o.threads        = threads;
  return o;
}

template <class P>
struct nvme_model : test_model<P> {
  nvme_model() : test_model<P>(nvme_sizes) {}
};

template <class Opt, class M>
void register_model(Opt& opt, M& m)
{
  for (std::size_t k = 0; k < m.params.size(); ++k) {
    opt.add_tensor(tensor_name(k), m.params[k].data(), m.params[k].size());
  }
  typename Opt::hyperparameters h;
  h.lr           = 3e-3;
  h.weight_decay = 0.0;
  if constexpr (requires { h.betas; }) {
    h.betas = {0.8, 0.99};
  } else if constexpr (Opt::rule_type::slots.size() == 1) {  // SGD with momentum
    h.momentum  = 0.5;
    h.dampening = 0.1;
  } else {
    h.maximize = true;
  }
  opt.add_group(h, {"t1", "t4"});
}

/// The hyper-parameters of group 0 at step t: a schedule, so every step differs (within 60).
template <class Opt>
typename Opt::hyperparameters schedule(int t)
{
  typename Opt::hyperparameters h;
  h.lr           = lr_at(1e-2, (t - 1) % 60 + 1, 60);  // a 60-step schedule, repeated
  h.weight_decay = 0.05;
  return h;
}

template <class Opt, class M>
run_result snapshot(Opt& opt, M const& m)
{
  run_result r;
  r.steps = opt.step_count();
  for (auto const& p : m.params) {
    r.params.emplace_back();
    for (auto const& x : p) {
      if constexpr (sizeof(x) == 4) {
        r.params.back().push_back(std::bit_cast<std::uint32_t>(x));
      } else {
        r.params.back().push_back(x.bits);
      }
    }
  }
  for (slot const s : opt.state_layout().slots()) {
    r.slots.emplace_back();
    for (std::size_t k = 0; k < m.params.size(); ++k) {
      r.slots.back().emplace_back(m.params[k].size());
      opt.copy_state(tensor_name(k), s, std::span<float>(r.slots.back().back()));
    }
  }
  return r;
}

/// Trains the model for `steps` steps with the given composition and options: plain steps,
/// or (`streaming`) streaming steps, each step's gradients handed over last tensor first.
/// Tensors for which `absent(t, step)` holds get no gradient that step.
template <class Opt>
run_result train(int steps, typename Opt::options const& o, bool streaming = false,
                 bool (*absent)(std::size_t, int) = nullptr)
{
  nvme_model<typename Opt::precision_type> m;
  Opt opt(schedule<Opt>(1), o);
  register_model(opt, m);
  for (int t = 1; t <= steps; ++t) {
    m.fill_grads(t);
    opt.set_hyperparameters(0, schedule<Opt>(t));
    auto views = m.views();
    for (std::size_t k = 0; absent != nullptr && k < views.size(); ++k) {
      if (absent(k, t)) { views[k] = {}; }
    }
    if (!streaming) {
      opt.step(views);
      continue;
    }
    opt.begin_step();
    for (std::size_t k = views.size(); k-- > 0;) {
      if (views[k].data != nullptr) { opt.grad_ready(k, views[k]); }
    }
    (void)opt.finish_step();
  }
  return snapshot(opt, m);
}

template <class P, class Transfer = Pipelined<2>>
using NvmeOpt = OffloadedOptimizer<AdamW, P, NvmeFile, Transfer>;
template <class P>
using HostOpt = OffloadedOptimizer<AdamW, P, PinnedHost, Synchronous>;

template <class P>
run_result reference(int steps, std::size_t chunk)
{
  typename HostOpt<P>::options o;
  o.chunk_elements = chunk;
  return train<HostOpt<P>>(steps, o);
}

template <class P, class Transfer>
run_result on_nvme(int steps, std::size_t chunk, NvmeFile::options const& tier, std::size_t threads = 0)
{
  typename NvmeOpt<P, Transfer>::options o;
  o.chunk_elements = chunk;
  o.threads        = threads;
  o.tier           = tier;
  return train<NvmeOpt<P, Transfer>>(steps, o);
}

inline NvmeFile::options in(scratch_dir const& d)
{
  NvmeFile::options o;
  o.directory = d.path;
  return o;
}

/// Captures the notices told while it lives.
struct notice_capture {
  std::vector<std::string> told;
  notice_capture()
  {
    reset_notices();
    set_notice_handler([this](std::string_view, std::string_view text) { told.emplace_back(text); });
  }
  ~notice_capture() { set_notice_handler({}); }
  [[nodiscard]] bool contains(std::string_view s) const
  {
    for (auto const& t : told) {
      if (t.find(s) != std::string::npos) { return true; }
    }
    return false;
  }
};

/// Whether a file in `dir` can be switched to O_DIRECT (asked of the kernel directly).
inline bool filesystem_takes_o_direct(std::filesystem::path const& dir)
{
  auto const probe = (dir / "o_direct_probe").string();
  int const fd     = ::open(probe.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  REQUIRE(fd >= 0);
  bool const takes = ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_DIRECT) == 0;
  ::close(fd);
  ::unlink(probe.c_str());
  return takes;
}

/// On a filesystem that refuses O_DIRECT: buffered I/O, told once, the same numbers, and an
/// error instead where require_direct says so.
inline void check_buffered_fallback(scratch_dir const& d)
{
  REQUIRE_FALSE(filesystem_takes_o_direct(d.path));
  notice_capture notices;
  NvmeFile::options o = in(d);
  {
    NvmeFile a(8192, o), b(8192, o);
    CHECK_FALSE(a.direct());
    CHECK_FALSE(b.direct());
  }
  REQUIRE(notices.told.size() == 1);  // two tiers, one notice
  CHECK(notices.contains("refuses O_DIRECT"));
  CHECK(notices.contains(d.path.string()));
  CHECK(on_nvme<Fp32, Pipelined<2>>(10, 2048, o) == reference<Fp32>(10, 2048));
  o.require_direct = true;
  try {
    NvmeFile f(8192, o);
    FAIL("require_direct accepted a filesystem without O_DIRECT");
  } catch (io_error const& e) {
    CHECK(e.code().value() == EINVAL);
    CHECK_THAT(e.what(), Catch::Contains("require_direct") && Catch::Contains(d.path.string()));
  }
  CHECK(d.entries().empty());
}

}  // namespace tierstate::test
