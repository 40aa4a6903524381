// SPDX-License-Identifier: Apache-2.0
// NvmeFile as an ordinary user: RLIMIT_MEMLOCK refuses io_uring's registered buffers, and
// the tier goes on with unregistered ones (told once, same numbers); a directory the user
// may not write to is a clear error.
//
// Run as root (as CI is), it forks a child that drops to the user "nobody" (uid and gid
// 65534: root's CAP_IPC_LOCK would ignore the limit) and runs the tests there. Run as an
// ordinary user, it runs them directly. Either way the memlock limit is lowered to 64 KiB
// first, below any staging ring.
#define CATCH_CONFIG_RUNNER
#include "nvme_support.hpp"

#include <catch2/catch.hpp>

#include <cstdio>
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
  CHECK(notices.told.size() == 1);
  CHECK(notices.contains("RLIMIT_MEMLOCK"));
  CHECK(notices.contains("unregistered"));

  // The engine reports the refusal itself, too.
  NvmeFile f(1 << 20, in(d));
  std::vector<std::byte> region(1 << 20);
  CHECK(f.register_staging(region) == ENOMEM);
  CHECK(f.engine().registered().empty());
}

TEST_CASE("a directory the user may not write to is a clear error", "[nvme][unprivileged]")
{
  NvmeFile::options o;
  o.directory = locked_dir;
  try {
    NvmeFile f(4096, o);
    FAIL("created a file in a directory without write permission");
  } catch (io_error const& e) {
    CHECK(e.code().value() == EACCES);
    CHECK_THAT(e.what(), Catch::Contains(locked_dir.string()) && Catch::Contains("Permission denied"));
  }
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
  if (!root) { return Catch::Session().run(argc, argv); }

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
    int const r = Catch::Session().run(argc, argv);
    std::fflush(stdout);
    std::_Exit(r == 0 ? 0 : 1);
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
}
