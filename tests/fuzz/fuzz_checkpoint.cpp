// SPDX-License-Identifier: Apache-2.0
// libFuzzer harness for checkpoint loading: every input is written to a nameless file (a
// memfd, else an O_TMPFILE in the temporary directory, so nothing is left behind however
// the run ends) and loaded, through /proc/self/fd/N, into an optimizer whose layout
// matches the seeds (tests/fuzz/seeds: v2_*, made by `fuzz_checkpoint --make-seeds DIR`,
// and v1_*, made by it when the format was version 1, which loading still reads), with
// checksum verification off so that mutations reach the parsing and the checks behind it. A load may refuse an input only with
// tierstate::checkpoint_error or tierstate::io_error; any other exception, crash, hang, leak
// or sanitizer report is a finding (and becomes a regression test in test_checkpoint).
#include <tierstate/tierstate.hpp>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

namespace {

using namespace tierstate;
using Opt = OffloadedOptimizer<AdamW, Bf16Mixed, PinnedHost, Synchronous>;

/// A small model: three tensors, one 2048-element chunk of state.
struct model {
  std::vector<bf16> a = std::vector<bf16>(700), b = std::vector<bf16>(61), c = std::vector<bf16>(1000);
  Opt opt;
  model() : opt({}, make_options())
  {
    opt.add_tensor("a", a.data(), a.size());
    opt.add_tensor("b", b.data(), b.size());
    opt.add_tensor("c", c.data(), c.size());
    opt.add_group({.lr = 1e-3, .weight_decay = 0.0}, {"b"});
  }
  static Opt::options make_options()
  {
    Opt::options o;
    o.chunk_elements = 2048;
    o.threads        = 1;
    return o;
  }
  void steps(int n)
  {
    for (int t = 1; t <= n; ++t) {
      std::vector<bf16> ga(a.size(), bf16(0.01f * t)), gb(b.size(), bf16(-0.02f)), gc(c.size(), bf16(0.003f * t));
      std::vector<grad_view<bf16>> const g = {{ga.data(), ga.size()}, {gb.data(), gb.size()}, {gc.data(), gc.size()}};
      opt.step(g);
    }
  }
};

/// The file every input goes into: a memfd (no name anywhere), or where memfd_create is
/// missing an O_TMPFILE in the temporary directory (no name either); load() opens it again
/// through /proc/self/fd/N (and may try O_DIRECT on it, which these refuse: load falls back
/// to buffered reads).
struct input_file {
  int fd = -1;
  std::string path;
  input_file()
  {
    fd = ::memfd_create("fuzz_checkpoint", MFD_CLOEXEC);
    if (fd < 0) {
      fd = ::open(std::filesystem::temp_directory_path().c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
    }
    if (fd < 0) {
      std::perror("fuzz_checkpoint: memfd_create and open(O_TMPFILE)");
      std::abort();
    }
    path = "/proc/self/fd/" + std::to_string(fd);
  }
  void write(std::uint8_t const* data, std::size_t size) const
  {
    if (::ftruncate(fd, 0) != 0) { std::abort(); }
    std::size_t done = 0;
    while (done < size) {
      ssize_t const n = ::pwrite(fd, data + done, size - done, static_cast<off_t>(done));
      if (n <= 0) { std::abort(); }
      done += static_cast<std::size_t>(n);
    }
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(std::uint8_t const* data, std::size_t size)
{
  static model m;
  static input_file const file;
  file.write(data, size);
  checkpoint_options o;
  o.verify_checksums = false;
  try {
    m.opt.load(file.path, o);
  } catch (checkpoint_error const&) {
  } catch (io_error const&) {
  }
  return 0;
}

/// `fuzz_checkpoint --make-seeds DIR` writes the seed checkpoints (0, 1 and 5 steps, and 1
/// step of the same tensors as offloaded params).
extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv)
{
  if (*argc >= 3 && std::string((*argv)[1]) == "--make-seeds") {
    std::filesystem::path const dir = (*argv)[2];
    std::filesystem::create_directories(dir);
    for (int const n : {0, 1, 5}) {
      model m;
      m.steps(n);
      auto const name = "v" + std::to_string(checkpoint::format_version) + "_steps_" + std::to_string(n) + ".ckpt";
      m.opt.save(dir / name);
    }
    {  // The same tensors as offloaded params: a file with section "parm" and a params region,
       // which the harness's model (params in memory) loads into its arrays.
      offloaded_params<bf16, PinnedHost> w;
      auto const layer = w.add_layer("all");
      Opt opt({}, model::make_options());
      model const shapes;
      std::vector<std::pair<char const*, std::vector<bf16> const*>> const tensors = {
        {"a", &shapes.a}, {"b", &shapes.b}, {"c", &shapes.c}};
      for (auto const& [name, values] : tensors) { w.add_tensor(layer, name, values->size()); }
      for (std::size_t t = 0; t < tensors.size(); ++t) {
        std::vector<bf16> v(tensors[t].second->size());
        for (std::size_t i = 0; i < v.size(); ++i) { v[i] = bf16(0.001f * static_cast<float>(i % 97) - 0.05f); }
        w.write(t, 0, v);
        opt.add_tensor(w, t);
      }
      opt.add_group({.lr = 1e-3, .weight_decay = 0.0}, {"b"});
      std::vector<bf16> ga(700, bf16(0.01f)), gb(61, bf16(-0.02f)), gc(1000, bf16(0.003f));
      std::vector<grad_view<bf16>> const g = {{ga.data(), ga.size()}, {gb.data(), gb.size()}, {gc.data(), gc.size()}};
      opt.step(g);
      opt.save(dir / ("v" + std::to_string(checkpoint::format_version) + "_params_steps_1.ckpt"));
    }
    std::printf("seeds written to %s\n", dir.c_str());
    std::exit(0);
  }
  return 0;
}
