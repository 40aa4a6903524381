// SPDX-License-Identifier: Apache-2.0
// NvmeFile and PinnedHost as an ordinary user: RLIMIT_MEMLOCK refuses io_uring's registered
// buffers, and the tier goes on with unregistered ones (told once, same numbers); state kept
// in host memory locks nothing and is not refused under that limit; host memory the process
// may not have (RLIMIT_DATA) is refused at the first step with the numbers and the fix, and
// the optimizer steps once the limit allows; a directory the user may not write to is a
// clear error at the optimizer's construction.
//
// Run as root (as CI is), it forks a child that drops to the user "nobody" (uid and gid
// 65534: root's CAP_IPC_LOCK would ignore the limit) and runs the tests there. Run as an
// ordinary user, it runs them directly. Either way the memlock limit is lowered to 64 KiB
// first, below any staging ring.
#include "nvme_support.hpp"

#include <catch2/catch.hpp>

#include <algorithm>

#include "catch_session.hpp"

#include <cstdio>
#include <fstream>
#include <string>

#include <grp.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

using namespace tierstate;
using namespace tierstate::test;

namespace {

std::filesystem::path shared_dir;  // writable by the test's user
std::filesystem::path locked_dir;  // not writable by it

/// The process's data segment and private writable mappings now (VmData, what RLIMIT_DATA
/// limits), in bytes.
std::size_t data_bytes()
{
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmData:", 0) == 0) { return std::stoull(line.substr(7)) * 1024; }
  }
  FAIL("no VmData in /proc/self/status");
  return 0;
}

}  // namespace

TEST_CASE("an unprivileged user is not root", "[nvme][unprivileged]")
{
  CHECK(::geteuid() != 0);
  rlimit lim{};
  REQUIRE(::getrlimit(RLIMIT_MEMLOCK, &lim) == 0);
  CHECK(lim.rlim_cur <= 64 * 1024);
}

TEST_CASE("registered buffers refused by RLIMIT_MEMLOCK: told once, unregistered, the same bits", "[nvme][unprivileged]")
{
  scratch_dir d(shared_dir);
  notice_capture notices;
  run_result const got = on_nvme<Bf16Mixed, Pipelined<2>>(20, 4096, in(d));
  CHECK(got == reference<Bf16Mixed>(20, 4096));
  // (Told once; a notice that these small chunks' steps wait for I/O may come beside it.)
  CHECK(std::count_if(notices.told.begin(), notices.told.end(),
                      [](auto const& t) { return t.find("RLIMIT_MEMLOCK") != std::string::npos; }) == 1);
  CHECK(notices.contains("unregistered"));

  // The engine reports the refusal itself, too.
  NvmeFile f(1 << 20, in(d));
  std::vector<std::byte> region(1 << 20);
  CHECK(f.register_staging(region) == ENOMEM);
  CHECK(f.engine().registered().empty());
}

TEST_CASE("a directory the user may not write to is a clear error at the optimizer's construction", "[nvme][unprivileged]")
{
  using mode = NvmeFile::options::naming_mode;
  auto const naming = GENERATE(mode::tmpfile, mode::unlinked, mode::named);
  INFO("naming " << static_cast<int>(naming));
  NvmeFile::options o;
  o.directory = locked_dir;
  o.naming    = naming;
  try {
    NvmeFile f(4096, o);
    FAIL("created a file in a directory without write permission");
  } catch (io_error const& e) {
    CHECK(e.code().value() == EACCES);
    CHECK_THAT(e.what(), Catch::Contains(locked_dir.string()) && Catch::Contains("Permission denied"));
  }
  NvmeOpt<Fp32>::options oo;
  oo.tier = o;
  try {
    NvmeOpt<Fp32> opt({}, oo);
    FAIL("the optimizer was built on a directory without write permission");
  } catch (io_error const& e) {
    CHECK(e.code().value() == EACCES);
    CHECK_THAT(e.what(), Catch::Contains(locked_dir.string()) && Catch::Contains("Permission denied") &&
                           Catch::Contains("NvmeFile.directory"));
  }
}

TEST_CASE("state in PinnedHost locks no memory: a small RLIMIT_MEMLOCK refuses nothing", "[pinned][unprivileged]")
{
  // Without CUDA, PinnedHost is pageable memory from mmap, which RLIMIT_MEMLOCK does not
  // limit (and CUDA's driver pins cudaHostAlloc's memory outside that limit too).
  notice_capture notices;
  CHECK(reference<Bf16Mixed>(5, 4096).steps == 5);
  PinnedHost big(std::size_t{64} << 20);  // 1024 times the limit
  CHECK(big.size() == std::size_t{64} << 20);
  CHECK(notices.told.empty());
}

TEST_CASE("host memory the process may not have is refused at the first step, saying how much and what to do; "
          "the optimizer steps once it may", "[pinned][unprivileged]")
{
  using Opt = OffloadedOptimizer<AdamW, Fp32, PinnedHost, Synchronous>;
  std::size_t const n = std::size_t{8} << 20;  // 64 MiB of state: m and v
  std::vector<float> w(n, 0.5f), g(n, 0.25f);
  Opt::options o;
  o.threads = 1;
  Opt opt({}, o);
  opt.add_tensor("w", w.data(), w.size());
  std::vector<grad_view<float>> const views = {{g.data(), g.size()}};

  rlimit old{};
  REQUIRE(::getrlimit(RLIMIT_DATA, &old) == 0);
  rlimit small  = old;
  small.rlim_cur = data_bytes() + (std::size_t{16} << 20);  // room for the test, not for the state
  REQUIRE(::setrlimit(RLIMIT_DATA, &small) == 0);
  std::string what;
  try {
    opt.step(views);
  } catch (std::exception const& e) {
    what = e.what();
  }
  REQUIRE(::setrlimit(RLIMIT_DATA, &old) == 0);
  INFO(what);
  CHECK_THAT(what, Catch::Contains("PinnedHost") && Catch::Contains(std::to_string(n * 8)) &&
                     Catch::Contains("RLIMIT_DATA") && Catch::Contains(std::to_string(small.rlim_cur)) &&
                     Catch::Contains("ulimit -d"));
  CHECK_FALSE(opt.state_lost());
  CHECK(opt.step_count() == 0);
  CHECK(w[0] == 0.5f);
  CHECK(opt.step(views).step == 1);  // the limit allows it now: the state is made
}

int main(int argc, char** argv)
{
  // Directories: one the test user may write to, one it may not.
  scratch_dir top;
  shared_dir = top.path / "shared";
  locked_dir = top.path / "locked";
  std::filesystem::create_directory(shared_dir);
  std::filesystem::create_directory(locked_dir);
  std::filesystem::permissions(top.path, std::filesystem::perms::owner_all | std::filesystem::perms::others_exec);
  std::filesystem::permissions(shared_dir, std::filesystem::perms::all);
  std::filesystem::permissions(locked_dir, std::filesystem::perms::owner_all | std::filesystem::perms::others_exec |
                                             std::filesystem::perms::others_read);
  bool const root = ::geteuid() == 0;
  if (!root) {
    std::filesystem::permissions(locked_dir, std::filesystem::perms::owner_read | std::filesystem::perms::owner_exec);
  }

  rlimit lim{};
  ::getrlimit(RLIMIT_MEMLOCK, &lim);
  lim.rlim_cur = 64 * 1024;
  if (lim.rlim_max != RLIM_INFINITY && lim.rlim_max < lim.rlim_cur) { lim.rlim_cur = lim.rlim_max; }
  if (::setrlimit(RLIMIT_MEMLOCK, &lim) != 0) {
    std::perror("setrlimit(RLIMIT_MEMLOCK)");
    return 1;
  }
  if (!root) { return tierstate::test::run_catch(argc, argv); }

  std::fflush(stdout);
  pid_t const child = ::fork();
  if (child < 0) {
    std::perror("fork");
    return 1;
  }
  if (child == 0) {
    gid_t const nobody = 65534;
    if (::setgroups(0, nullptr) != 0 || ::setgid(nobody) != 0 || ::setuid(nobody) != 0) {
      std::perror("dropping to uid/gid 65534");
      std::_Exit(1);
    }
    int const r = tierstate::test::run_catch(argc, argv);
    std::fflush(stdout);
    std::_Exit(r == 0 ? 0 : 1);
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
}
