// SPDX-License-Identifier: Apache-2.0
// NvmeFile on filesystems made for the test (needs root, to mount them):
//   - a small loop-mounted ext4, for a real ENOSPC with O_DIRECT: a state larger than the
//     disk is refused when the optimizer builds it, leaving nothing behind, and a state
//     that fits is reserved in full, so a second one cannot take its space;
//   - a ramfs, which refuses O_DIRECT: the buffered fallback, told once.
// Without root, or where mounting is refused (an unprivileged container), it exits 77 (a
// skip) and says why.
#define CATCH_CONFIG_RUNNER
#include "nvme_support.hpp"

#include <catch2/catch.hpp>

#include <cstdio>
#include <cstdlib>
#include <string>

#include <sys/statvfs.h>
#include <unistd.h>

using namespace tierstate;
using namespace tierstate::test;

namespace {

std::filesystem::path ext4_dir, ramfs_dir;

int run(std::string const& command) { return std::system((command + " >/dev/null 2>&1").c_str()); }

std::uint64_t free_bytes(std::filesystem::path const& p)
{
  struct statvfs s{};
  REQUIRE(::statvfs(p.c_str(), &s) == 0);
  return static_cast<std::uint64_t>(s.f_bavail) * s.f_frsize;
}

}  // namespace

TEST_CASE("a state larger than the disk is an error when it is built, and leaves nothing", "[nvme][enospc]")
{
  scratch_dir d(ext4_dir);
  std::uint64_t const avail = free_bytes(ext4_dir);
  INFO("free on the ext4: " << avail << " bytes");
  // Bf16Mixed AdamW: 12 bytes of state per element; ask for twice the free space.
  std::vector<bf16> w(avail * 2 / 12, bf16(0.5f)), g(w.size(), bf16(0.25f));
  NvmeOpt<Bf16Mixed>::options o;
  o.tier = in(d);
  NvmeOpt<Bf16Mixed> opt({}, o);
  opt.add_tensor("w", w.data(), w.size());
  std::vector<grad_view<bf16>> const views = {{g.data(), g.size()}};
  try {
    opt.step(views);
    FAIL("a state twice the disk's size was built");
  } catch (io_error const& e) {
    CHECK(e.code().value() == ENOSPC);
    CHECK(e.operation() == "fallocate");
    CHECK_THAT(e.what(), Catch::Contains(d.path.string()) && Catch::Contains("No space left on device"));
  }
  CHECK(d.entries().empty());
  CHECK(free_bytes(ext4_dir) >= avail - (1 << 20));  // the partial reservation is given back
  CHECK_FALSE(opt.state_lost());
  CHECK(opt.step_count() == 0);
}

TEST_CASE("a state that fits trains with O_DIRECT; its reservation keeps a second one out", "[nvme][enospc]")
{
  scratch_dir d(ext4_dir);
  {
    NvmeFile probe(4096, in(d));
    CHECK(probe.direct());  // ext4 on a loop device takes O_DIRECT
  }
  CHECK(on_nvme<Fp32, Pipelined<3>>(20, 2048, in(d)) == reference<Fp32>(20, 2048));

  std::uint64_t const avail = free_bytes(ext4_dir);
  std::size_t const first   = avail / 3 * 2 / 4096 * 4096;
  NvmeFile a(first, in(d));
  CHECK_THROWS_MATCHES(NvmeFile(first, in(d)), io_error,
                       Catch::Predicate<io_error>([](io_error const& e) { return e.code().value() == ENOSPC; }));
  CHECK(d.entries().empty());  // a's file is nameless, and the refused one is gone
  // a's space is its own: writing all of it works.
  std::vector<std::byte> buf(1 << 20, std::byte{0x5a});
  auto* aligned = static_cast<std::byte*>(std::aligned_alloc(4096, buf.size()));
  std::memcpy(aligned, buf.data(), buf.size());
  for (std::size_t off = 0; off + buf.size() <= first; off += buf.size()) {
    a.write(off, std::span<std::byte const>(aligned, buf.size()));
  }
  std::free(aligned);
}

TEST_CASE("a filesystem that refuses O_DIRECT (ramfs) gets buffered I/O, told once", "[nvme][files]")
{
  scratch_dir d(ramfs_dir);
  check_buffered_fallback(d);
}

int main(int argc, char** argv)
{
  if (::geteuid() != 0) {
    std::printf("SKIP: test_nvme_mounts needs root to loop-mount an ext4 and mount a ramfs\n");
    return 77;
  }
  scratch_dir top;
  auto const image = top.path / "ext4.img";
  ext4_dir         = top.path / "ext4";
  ramfs_dir        = top.path / "ramfs";
  std::filesystem::create_directory(ext4_dir);
  std::filesystem::create_directory(ramfs_dir);
  if (run("truncate -s 48M " + image.string()) != 0 || run("mkfs.ext4 -q -F " + image.string()) != 0) {
    std::printf("SKIP: cannot make an ext4 image (is e2fsprogs installed?)\n");
    return 77;
  }
  if (run("mount -o loop " + image.string() + " " + ext4_dir.string()) != 0) {
    std::printf("SKIP: mount -o loop refused here (no loop devices, or no CAP_SYS_ADMIN)\n");
    return 77;
  }
  if (run("mount -t ramfs ramfs " + ramfs_dir.string()) != 0) {
    run("umount " + ext4_dir.string());
    std::printf("SKIP: mount -t ramfs refused here\n");
    return 77;
  }
  int const result = Catch::Session().run(argc, argv);
  run("umount " + ext4_dir.string());
  run("umount " + ramfs_dir.string());
  return result;
}
