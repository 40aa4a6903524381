// SPDX-License-Identifier: Apache-2.0
// NvmeFile on filesystems made for the test (needs root, to mount them):
//   - a small loop-mounted ext4, for a real ENOSPC with O_DIRECT: a state larger than the
//     disk is refused when the optimizer builds it, leaving nothing behind, and a state
//     that fits is reserved in full, so a second one cannot take its space;
//   - loop-mounted btrfs and xfs (and the ext4), filled to the last block after the first
//     step: the reservation holds, every later step succeeds (btrfs, a copy-on-write
//     filesystem, only because the scratch file is made NOCOW);
//   - a ramfs, which refuses O_DIRECT: the buffered fallback, told once, and an error at the
//     optimizer's construction where require_direct says so;
//   - a read-only tmpfs: an error at the optimizer's construction, not at its first step.
// Without root, or where mounting is refused (an unprivileged container), it exits 77 (a
// skip) and says why. A filesystem whose tools or driver are missing here (btrfs, xfs) has
// its cases skipped, with the reason printed.
#include "nvme_support.hpp"

#include <catch2/catch.hpp>

#include "catch_session.hpp"

#include <cstdio>
#include <cstdlib>
#include <string>

#include <fcntl.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/statvfs.h>
#include <unistd.h>

using namespace tierstate;
using namespace tierstate::test;

namespace {

std::filesystem::path ext4_dir, ramfs_dir, readonly_dir;
std::filesystem::path btrfs_dir, xfs_dir;      // empty where that filesystem cannot be had here
std::string btrfs_missing, xfs_missing;       // why not

int run(std::string const& command) { return std::system((command + " >/dev/null 2>&1").c_str()); }

std::uint64_t free_bytes(std::filesystem::path const& p)
{
  struct statvfs s{};
  REQUIRE(::statvfs(p.c_str(), &s) == 0);
  return static_cast<std::uint64_t>(s.f_bavail) * s.f_frsize;
}

/// Writes a file in `dir` until the filesystem has no block left (ENOSPC), and syncs it.
void fill(std::filesystem::path const& dir)
{
  auto const name = (dir / "filler").string();
  int const fd    = ::open(name.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0600);
  REQUIRE(fd >= 0);
  std::vector<char> block(1 << 20, 'f');
  bool full = false;
  for (std::size_t n : {std::size_t{1} << 20, std::size_t{4096}}) {
    for (;;) {
      ssize_t const w = ::write(fd, block.data(), n);
      if (w < 0) {
        REQUIRE(errno == ENOSPC);
        full = true;
        break;
      }
    }
  }
  ::fsync(fd);  // btrfs may find its last blocks only now; whatever it says, the disk is full
  ::close(fd);
  ::sync();
  CHECK(full);
}

/// Trains the test model on NvmeFile in `dir`, filling the disk after the first step: the
/// reservation made at the first step must carry every later one.
run_result train_on_full_disk(std::filesystem::path const& dir, NvmeFile::options const& tier, int steps)
{
  using Opt = NvmeOpt<Fp32, Pipelined<2>>;
  Opt::options o;
  o.chunk_elements = 2048;
  o.tier           = tier;
  nvme_model<Fp32> m;
  Opt opt(schedule<Opt>(1), o);
  register_model(opt, m);
  for (int t = 1; t <= steps; ++t) {
    m.fill_grads(t);
    opt.set_hyperparameters(0, schedule<Opt>(t));
    auto const views = m.views();
    INFO("step " << t);
    REQUIRE_NOTHROW(opt.step(views));
    if (t == 1) { fill(dir); }
  }
  CHECK_FALSE(opt.state_lost());
  return snapshot(opt, m);
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

TEST_CASE("a disk filled after the first step does not fail a later one: ext4, xfs, btrfs", "[nvme][enospc][cow]")
{
  using mode = NvmeFile::options::naming_mode;
  auto const naming = GENERATE(mode::tmpfile, mode::unlinked);
  auto const fs     = GENERATE(as<std::string>{}, "ext4", "xfs", "btrfs");
  INFO(fs << ", naming " << static_cast<int>(naming));
  std::filesystem::path const top = fs == "ext4" ? ext4_dir : fs == "xfs" ? xfs_dir : btrfs_dir;
  if (top.empty()) {
    WARN("SKIP " << fs << ": " << (fs == "xfs" ? xfs_missing : btrfs_missing));
    return;
  }
  scratch_dir d(top);
  NvmeFile::options tier = in(d);
  tier.naming            = naming;
  notice_capture notices;
  {
    NvmeFile f(1 << 20, tier);
    CHECK(f.direct());
    if (fs == "btrfs") {
      int flags = 0;
      REQUIRE(::ioctl(f.native_handle(), FS_IOC_GETFLAGS, &flags) == 0);
      CHECK((flags & FS_NOCOW_FL) != 0);  // overwrites in place, into the space reserved
    }
  }
  int const steps = 8;
  CHECK(train_on_full_disk(d.path, tier, steps) == reference<Fp32>(steps, 2048));
  CHECK(notices.told.empty());  // NOCOW taken where it is needed: nothing to tell
  std::filesystem::remove(d.path / "filler");
  CHECK(d.entries().empty());
}

TEST_CASE("a read-only place or one without O_DIRECT under require_direct fails at construction", "[nvme][errors]")
{
  using Opt = NvmeOpt<Fp32, Pipelined<2>>;
  Opt::options o;
  SECTION("a read-only filesystem")
  {
    o.tier.directory = readonly_dir;
    try {
      Opt opt({}, o);
      FAIL("the optimizer was built on a read-only filesystem");
    } catch (io_error const& e) {
      CHECK(e.code().value() == EROFS);
      CHECK_THAT(e.what(), Catch::Contains(readonly_dir.string()) && Catch::Contains("Read-only file system"));
    }
  }
  SECTION("a ramfs (no O_DIRECT) under require_direct")
  {
    scratch_dir d(ramfs_dir);
    o.tier                = in(d);
    o.tier.require_direct = true;
    auto const naming     = GENERATE(NvmeFile::options::naming_mode::tmpfile, NvmeFile::options::naming_mode::unlinked);
    o.tier.naming         = naming;
    try {
      Opt opt({}, o);
      FAIL("require_direct accepted a filesystem without O_DIRECT at construction");
    } catch (io_error const& e) {
      CHECK(e.code().value() == EINVAL);
      CHECK_THAT(e.what(), Catch::Contains("require_direct") && Catch::Contains(d.path.string()));
    }
    CHECK(d.entries().empty());
  }
}

namespace {

/// Makes a `size` image with `mkfs` and loop-mounts it on `dir`; the empty string, or why not.
std::string loop_mount(std::filesystem::path const& image, std::string const& size, std::string const& mkfs,
                       std::filesystem::path const& dir)
{
  std::filesystem::create_directory(dir);
  if (run("truncate -s " + size + " " + image.string()) != 0 || run(mkfs + " " + image.string()) != 0) {
    return "cannot make the image (" + mkfs + " failed, or is not installed)";
  }
  if (run("mount -o loop " + image.string() + " " + dir.string()) != 0) {
    return "mount -o loop refused it (no driver for it in this kernel?)";
  }
  return {};
}

}  // namespace

int main(int argc, char** argv)
{
  if (::geteuid() != 0) {
    std::printf("SKIP: test_nvme_mounts needs root to loop-mount ext4, xfs and btrfs and mount a ramfs and a tmpfs\n");
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
  readonly_dir = top.path / "readonly";
  std::filesystem::create_directory(readonly_dir);
  if (run("mount -t tmpfs -o ro,size=1M tmpfs " + readonly_dir.string()) != 0) {
    run("umount " + ext4_dir.string());
    run("umount " + ramfs_dir.string());
    std::printf("SKIP: mount -t tmpfs -o ro refused here\n");
    return 77;
  }
  btrfs_dir     = top.path / "btrfs";
  btrfs_missing = loop_mount(top.path / "btrfs.img", "128M", "mkfs.btrfs -q -f", btrfs_dir);
  if (!btrfs_missing.empty()) {
    std::printf("SKIP (btrfs cases): %s\n", btrfs_missing.c_str());
    btrfs_dir.clear();
  }
  xfs_dir     = top.path / "xfs";
  xfs_missing = loop_mount(top.path / "xfs.img", "320M", "mkfs.xfs -q -f", xfs_dir);
  if (!xfs_missing.empty()) {
    std::printf("SKIP (xfs cases): %s\n", xfs_missing.c_str());
    xfs_dir.clear();
  }
  int const result = tierstate::test::run_catch(argc, argv);
  for (auto const& dir : {ext4_dir, ramfs_dir, readonly_dir, btrfs_dir, xfs_dir}) {
    if (!dir.empty()) { run("umount " + dir.string()); }
  }
  return result;
}
