// SPDX-License-Identifier: Apache-2.0
// The I/O engines (io_uring and psync): large batched transfers round-trip through O_DIRECT
// files, short transfers are requeued, planted faults surface, and every failure is an
// io_error naming path, offset, length, operation and errno.
#include <tierstate/core/error.hpp>
#include <tierstate/io/engine.hpp>

#include <catch2/catch.hpp>

#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

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

io::engine_options options_for(io::backend b, unsigned depth = 32, std::size_t block = std::size_t{1} << 20,
                               unsigned rings = 1)
{
  io::engine_options o;
  o.backend     = b;
  o.queue_depth = depth;
  o.block_size  = block;
  o.rings       = rings;
  return o;
}

TEST_CASE("batches of large aligned ranges round-trip, whatever the queue depth, block size and rings", "[io]")
{
  auto const backend = GENERATE(io::backend::io_uring, io::backend::psync);
  unsigned const rings = GENERATE(1u, 3u);
  temp_file f("roundtrip");
  INFO(io::backend_name(backend) << ", " << rings << " rings");
  INFO(f.path << (f.direct ? " with O_DIRECT" : " buffered (O_DIRECT refused here)"));
  std::size_t const n = std::size_t{9} << 20;  // not a multiple of the 4 MiB block below
  aligned_bytes out(n), in(n);
  for (std::size_t i = 0; i < n; ++i) { out.get()[i] = static_cast<std::byte>((i * 131) >> 3); }
  for (unsigned const depth : {1u, 4u, 64u}) {
    for (std::size_t const block : {std::size_t{4096} * 3, std::size_t{4} << 20}) {
      io::engine e(options_for(backend, depth, block, rings));
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
  auto const backend = GENERATE(io::backend::io_uring, io::backend::psync);
  std::string const path = (std::filesystem::temp_directory_path() / ("tierstate_short_" + std::to_string(::getpid()))).string();
  int const fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
  REQUIRE(fd >= 0);
  std::vector<std::byte> data(6000, std::byte{7}), back(8192, std::byte{0});
  REQUIRE(::pwrite(fd, data.data(), data.size(), 0) == 6000);
  io::engine e(options_for(backend));
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
  auto const backend = GENERATE(io::backend::io_uring, io::backend::psync);
  temp_file f("readonly");
  int const ro = ::open(f.path.c_str(), O_RDONLY);
  REQUIRE(ro >= 0);
  aligned_bytes buf(8192);
  io::engine e(options_for(backend));
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
  CHECK_THROWS_WITH(io::engine(options_for(io::backend::io_uring, 0)), Catch::Contains("io.queue_depth = 0"));
  CHECK_THROWS_WITH(io::engine(options_for(io::backend::psync, 8, 1000)), Catch::Contains("io.block_size = 1000"));
  CHECK_THROWS_WITH(io::engine(options_for(io::backend::io_uring, 8, 4096, 0)), Catch::Contains("io.rings = 0"));
  CHECK_THROWS_WITH(io::engine(options_for(static_cast<io::backend>(7))), Catch::Contains("io.backend = 7"));
}

TEST_CASE("a planted fault fails the k-th piece with its errno, and nothing after it is submitted", "[io][fault]")
{
  auto const backend = GENERATE(io::backend::io_uring, io::backend::psync);
  auto const err     = GENERATE(EIO, ENOSPC);
  INFO(io::backend_name(backend) << ", errno " << err);
  temp_file f("fault");
  std::size_t const block = 64 * 1024, n = 10 * block;
  aligned_bytes buf(n);
  std::memset(buf.get(), 1, n);
  auto o   = options_for(backend, 1, block);  // depth 1: pieces in order, so "k-th" is exact
  o.faults = std::make_shared<io::fault_plan>();
  o.faults->fail(io::op::write, 4, err);
  io::engine e(o);
  io::request w{f.fd, 0, buf.get(), n, true, &f.path};
  try {
    e.submit({&w, 1});
    FAIL("the planted fault did not surface");
  } catch (io_error const& x) {
    CHECK(x.code().value() == err);
    CHECK(x.operation() == "write");
    CHECK(x.offset() == 3 * block);
    CHECK(x.length() == block);
    CHECK_THAT(x.what(), Catch::Contains(f.path) && Catch::Contains("write of 65536 bytes at offset 196608"));
  }
  CHECK(o.faults->applied() == 1);
  CHECK(o.faults->seen(io::op::write) == 4);  // none submitted after the failure
  // The plan fires once: the same batch again goes through, and reads count separately.
  e.submit({&w, 1});
  CHECK(o.faults->seen(io::op::write) == 14);
  CHECK(o.faults->seen(io::op::read) == 0);
}

TEST_CASE("a planted short transfer is requeued until the data is complete", "[io][fault]")
{
  auto const backend = GENERATE(io::backend::io_uring, io::backend::psync);
  INFO(io::backend_name(backend));
  temp_file f("shorten");
  std::size_t const block = 64 * 1024, n = 6 * block;
  aligned_bytes out(n), in(n);
  for (std::size_t i = 0; i < n; ++i) { out.get()[i] = static_cast<std::byte>(i * 7 + (i >> 12)); }
  auto o   = options_for(backend, 4, block);
  o.faults = std::make_shared<io::fault_plan>();
  o.faults->shorten(io::op::write, 2, 4096);
  o.faults->shorten(io::op::read, 1, 12288);
  o.faults->shorten(io::op::read, 3, 5000);  // rounds down to 4096
  io::engine e(o);
  io::request w{f.fd, 0, out.get(), n, true, &f.path};
  e.submit({&w, 1});
  io::request r{f.fd, 0, in.get(), n, false, &f.path};
  e.submit({&r, 1});
  CHECK(o.faults->applied() == 3);
  CHECK(o.faults->seen(io::op::write) == 7);  // 6 pieces and one remainder
  CHECK(o.faults->seen(io::op::read) == 8);
  CHECK(std::memcmp(in.get(), out.get(), n) == 0);

  // A transfer shortened to nothing makes no progress: an error, not a loop.
  o.faults->shorten(io::op::read, 9, 0);
  try {
    e.submit({&r, 1});
    FAIL("a read that moved nothing succeeded");
  } catch (io_error const& x) {
    CHECK(x.code().value() == ENODATA);
    if (backend == io::backend::io_uring) { CHECK(x.offset() == 0); }  // psync's threads race for pieces
  }
}

TEST_CASE("a device that dies fails every piece from then on", "[io][fault]")
{
  temp_file f("dies");
  aligned_bytes buf(1 << 20);
  auto o   = options_for(io::backend::io_uring, 8, 65536);
  o.faults = std::make_shared<io::fault_plan>();
  o.faults->fail_from(io::op::read, 3, EIO);
  io::engine e(o);
  io::request w{f.fd, 0, buf.get(), 1 << 20, true, &f.path};
  e.submit({&w, 1});
  io::request r{f.fd, 0, buf.get(), 1 << 20, false, &f.path};
  for (int i = 0; i < 3; ++i) { CHECK_THROWS_AS(e.submit({&r, 1}), io_error); }
}

TEST_CASE("registered buffers: transfers inside and outside the region both work", "[io]")
{
  temp_file f("fixed");
  std::size_t const n = 1 << 20;
  aligned_bytes region(2 * n), other(n);
  for (std::size_t i = 0; i < n; ++i) { region.get()[i] = static_cast<std::byte>(i ^ (i >> 9)); }
  io::engine e(options_for(io::backend::io_uring, 8, 256 * 1024, 2));
  int const err = e.register_buffer({region.get(), 2 * n});
  INFO("register_buffer: " << err);
  CHECK((err == 0 || err == ENOMEM));  // ENOMEM: a small RLIMIT_MEMLOCK, which root does not have
  if (err == 0) { CHECK(e.registered().size() == 2 * n); }
  io::request w{f.fd, 0, region.get(), n, true, &f.path};
  e.submit({&w, 1});
  io::request r1{f.fd, 0, region.get() + n, n, false, &f.path};
  io::request r2{f.fd, 0, other.get(), n, false, &f.path};
  e.submit({&r1, 1});
  e.submit({&r2, 1});
  CHECK(std::memcmp(region.get(), region.get() + n, n) == 0);
  CHECK(std::memcmp(region.get(), other.get(), n) == 0);
  CHECK(e.register_buffer({}) == 0);
  CHECK(e.registered().empty());
}

TEST_CASE("streamed requests finish one by one; a fault fails only its own request", "[io][stream]")
{
  unsigned const rings = GENERATE(1u, 2u);
  INFO(rings << " rings");
  temp_file f("stream");
  std::size_t const block = 64 * 1024, per = 3 * block, count = 8;
  aligned_bytes out(per * count), in(per * count);
  for (std::size_t i = 0; i < per * count; ++i) { out.get()[i] = static_cast<std::byte>((i * 29) ^ (i >> 11)); }
  auto o   = options_for(io::backend::io_uring, 4, block, rings);
  o.faults = std::make_shared<io::fault_plan>();
  io::engine e(o);
  std::map<std::uint64_t, std::exception_ptr> finished;
  auto done = [&](std::uint64_t tag, std::exception_ptr err) {
    CHECK(finished.count(tag) == 0);  // once per request
    finished[tag] = std::move(err);
  };
  for (std::size_t k = 0; k < count; ++k) {
    e.start({f.fd, k * per, out.get() + k * per, per, true, &f.path}, 100 + k);
  }
  CHECK(e.active() == count);
  while (e.active() > 0) { e.progress(true, done); }
  REQUIRE(finished.size() == count);
  for (auto const& [tag, err] : finished) { CHECK_FALSE(err); }

  // Reads, with the 5th read piece failing: exactly one request reports it.
  finished.clear();
  o.faults->fail(io::op::read, 5, EIO);
  o.faults->shorten(io::op::read, 2, 4096);
  for (std::size_t k = 0; k < count; ++k) {
    e.start({f.fd, k * per, in.get() + k * per, per, false, &f.path}, k);
  }
  while (e.active() > 0) { e.progress(true, done); }
  REQUIRE(finished.size() == count);
  std::size_t failures = 0;
  for (auto const& [tag, err] : finished) {
    if (!err) {
      CHECK(std::memcmp(in.get() + tag * per, out.get() + tag * per, per) == 0);
      continue;
    }
    ++failures;
    try {
      std::rethrow_exception(err);
    } catch (io_error const& x) {
      CHECK(x.code().value() == EIO);
      CHECK(x.operation() == "read");
      CHECK(x.offset() >= tag * per);
      CHECK(x.offset() < (tag + 1) * per);
    }
  }
  CHECK(failures == 1);
  // The engine goes on working afterwards, batch or stream.
  io::request r{f.fd, 0, in.get(), per * count, false, &f.path};
  e.submit({&r, 1});
  CHECK(std::memcmp(in.get(), out.get(), per * count) == 0);
}

TEST_CASE("psync streams too: what was started runs in progress()", "[io][stream]")
{
  temp_file f("psync_stream");
  std::size_t const n = 256 * 1024;
  aligned_bytes out(n), in(n);
  std::memset(out.get(), 0x3c, n);
  io::engine e(options_for(io::backend::psync, 4, 65536));
  std::vector<std::uint64_t> tags;
  e.start({f.fd, 0, out.get(), n, true, &f.path}, 7);
  CHECK(e.active() == 1);
  e.progress(true, [&](std::uint64_t tag, std::exception_ptr err) {
    CHECK_FALSE(err);
    tags.push_back(tag);
  });
  e.start({f.fd, 0, in.get(), n, false, &f.path}, 8);
  e.progress(true, [&](std::uint64_t tag, std::exception_ptr err) {
    CHECK_FALSE(err);
    tags.push_back(tag);
  });
  CHECK(tags == std::vector<std::uint64_t>{7, 8});
  CHECK(e.active() == 0);
  CHECK(std::memcmp(in.get(), out.get(), n) == 0);
}
