// SPDX-License-Identifier: Apache-2.0
// The liburing engine: large batched transfers round-trip through O_DIRECT files, short
// transfers are requeued, and every failure is an io_error naming path, offset, length,
// operation and errno.
#include <tierstate/core/error.hpp>
#include <tierstate/io/uring_engine.hpp>

#include <catch2/catch.hpp>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>

#include <fcntl.h>
#include <unistd.h>

using namespace tierstate;

namespace {

struct aligned_bytes {
  std::unique_ptr<std::byte, decltype(&std::free)> p;
  explicit aligned_bytes(std::size_t n) : p(static_cast<std::byte*>(std::aligned_alloc(4096, n)), &std::free) {}
  std::byte* get() const { return p.get(); }
};

struct temp_file {
  std::string path;
  int fd = -1;
  bool direct = false;
  explicit temp_file(char const* name)
  {
    path = (std::filesystem::temp_directory_path() / (std::string("tierstate_") + name + "_" + std::to_string(::getpid()))).string();
    fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_DIRECT, 0600);
    direct = fd >= 0;
    if (fd < 0) { fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600); }  // tmpfs refuses O_DIRECT
    REQUIRE(fd >= 0);
  }
  ~temp_file()
  {
    ::close(fd);
    ::unlink(path.c_str());
  }
};

}  // namespace

TEST_CASE("batches of large aligned ranges round-trip, whatever the queue depth and block size", "[io]")
{
  temp_file f("roundtrip");
  INFO(f.path << (f.direct ? " with O_DIRECT" : " buffered (O_DIRECT refused here)"));
  std::size_t const n = std::size_t{9} << 20;  // not a multiple of the 4 MiB block below
  aligned_bytes out(n), in(n);
  for (std::size_t i = 0; i < n; ++i) { out.get()[i] = static_cast<std::byte>((i * 131) >> 3); }
  for (unsigned const depth : {1u, 4u, 64u}) {
    for (std::size_t const block : {std::size_t{4096} * 3, std::size_t{4} << 20}) {
      io::uring_engine e({depth, block});
      // Three requests of different sizes, written in one batch, read back in another.
      std::vector<io::request> w = {{f.fd, 0, out.get(), n / 3 / 4096 * 4096, true, &f.path},
                                    {f.fd, n / 3 / 4096 * 4096, out.get() + n / 3 / 4096 * 4096, 4096, true, &f.path},
                                    {f.fd, n / 3 / 4096 * 4096 + 4096, out.get() + n / 3 / 4096 * 4096 + 4096,
                                     n - n / 3 / 4096 * 4096 - 4096, true, &f.path}};
      e.submit(w);
      std::memset(in.get(), 0, n);
      io::request r{f.fd, 0, in.get(), n, false, &f.path};
      e.submit({&r, 1});
      INFO("depth " << depth << ", block " << block);
      CHECK(std::memcmp(in.get(), out.get(), n) == 0);
    }
  }
}

TEST_CASE("a short read is requeued, and reading past the end fails with ENODATA", "[io]")
{
  std::string const path = (std::filesystem::temp_directory_path() / ("tierstate_short_" + std::to_string(::getpid()))).string();
  int const fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
  REQUIRE(fd >= 0);
  std::vector<std::byte> data(6000, std::byte{7}), back(8192, std::byte{0});
  REQUIRE(::pwrite(fd, data.data(), data.size(), 0) == 6000);
  io::uring_engine e;
  io::request r{fd, 0, back.data(), back.size(), false, &path};
  try {
    e.submit({&r, 1});
    FAIL("read past the end succeeded");
  } catch (io_error const& x) {
    CHECK(x.code().value() == ENODATA);
    CHECK(x.path() == path);
    CHECK(x.operation() == "read");
    CHECK(x.offset() == 6000);  // the requeued remainder, after a short read of 6000 bytes
    CHECK(x.length() == 8192 - 6000);
    CHECK(std::string(x.what()).find(path) != std::string::npos);
  }
  CHECK(back[5999] == std::byte{7});  // what the short read got is in place
  ::close(fd);
  ::unlink(path.c_str());
}

TEST_CASE("a failed write names path, offset, length, operation and errno", "[io]")
{
  temp_file f("readonly");
  int const ro = ::open(f.path.c_str(), O_RDONLY);
  REQUIRE(ro >= 0);
  aligned_bytes buf(8192);
  io::uring_engine e;
  io::request w{ro, 4096, buf.get(), 8192, true, &f.path};
  try {
    e.submit({&w, 1});
    FAIL("write to a read-only descriptor succeeded");
  } catch (io_error const& x) {
    CHECK(x.code().value() == EBADF);
    CHECK(x.operation() == "write");
    CHECK(x.offset() == 4096);
    CHECK(x.length() == 8192);
    CHECK_THAT(x.what(), Catch::Contains("write of 8192 bytes at offset 4096 of " + f.path));
  }
  ::close(ro);
}

TEST_CASE("bad engine options are refused by name", "[io]")
{
  CHECK_THROWS_WITH(io::uring_engine({0, 4096}), Catch::Contains("queue_depth = 0"));
  CHECK_THROWS_WITH(io::uring_engine({8, 1000}), Catch::Contains("block_size = 1000"));
}
