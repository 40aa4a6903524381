// SPDX-License-Identifier: Apache-2.0
// The I/O engines (io_uring and psync): large batched transfers round-trip through O_DIRECT
// files, short transfers are requeued, planted faults surface, and every failure is an
// io_error naming path, offset, length, operation and errno.
#include <tierstate/core/error.hpp>
#include <tierstate/io/engine.hpp>
#include <tierstate/transfer/detail/io_worker.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <sys/ioctl.h>
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

// --- a ring that fails while streaming ------------------------------------------------------

namespace {

using io::ring_call;

/// An io_uring engine's options with a fault plan, for the ring calls it fails.
io::engine_options with_plan(io::engine_options o)
{
  o.faults = std::make_shared<io::fault_plan>();
  return o;
}

/// The io_error an outcome holds, if it holds one.
std::optional<io_error> io_error_in(std::exception_ptr const& e)
{
  if (!e) { return std::nullopt; }
  try {
    std::rethrow_exception(e);
  } catch (io_error const& x) {
    return x;
  } catch (...) {
  }
  return std::nullopt;
}

/// Runs `f` on a thread of its own and returns its result, or nothing if it has not returned
/// within `limit` (the thread is then left behind, stuck, rather than hanging the test).
template <class F>
auto within(std::chrono::seconds limit, F f) -> std::optional<decltype(f())>
{
  std::packaged_task<decltype(f())()> task(std::move(f));
  auto result = task.get_future();
  std::thread(std::move(task)).detach();
  if (result.wait_for(limit) != std::future_status::ready) { return std::nullopt; }
  return result.get();
}

}  // namespace

TEST_CASE("a ring that fails while streaming fails every active request, and the engine goes on", "[io][stream][ring]")
{
  unsigned const rings = GENERATE(1u, 2u);
  int const err        = GENERATE(EIO, ENOMEM);
  INFO(rings << " rings, errno " << err);
  temp_file f("ring_fails");
  std::size_t const block = 64 * 1024, per = 3 * block, count = 6;
  aligned_bytes out(per * count), in(per * count);
  for (std::size_t i = 0; i < per * count; ++i) { out.get()[i] = static_cast<std::byte>((i * 13) ^ (i >> 12)); }
  io::uring_engine e(with_plan(options_for(io::backend::io_uring, 4, block, rings)));  // 18 pieces: some wait
  io::request w{f.fd, 0, out.get(), per * count, true, &f.path};
  e.submit({&w, 1});

  std::map<std::uint64_t, std::exception_ptr> finished;
  auto done = [&](std::uint64_t tag, std::exception_ptr error) {
    CHECK(finished.count(tag) == 0);  // once per request
    finished[tag] = std::move(error);
  };
  e.options().faults->fail_ring(ring_call::submit, err);  // the next io_uring_submit fails
  for (std::size_t k = 0; k < count; ++k) {
    e.start({f.fd, k * per, in.get() + k * per, per, false, &f.path}, k);
  }
  e.progress(true, done);
  CHECK(e.active() == 0);
  REQUIRE(finished.size() == count);
  for (auto const& [tag, error] : finished) {
    INFO("request " << tag);
    auto const x = io_error_in(error);
    REQUIRE(x);
    CHECK(x->code().value() == err);
    CHECK(x->operation() == "io_uring_submit");
    CHECK(x->path() == f.path);
    CHECK(x->offset() == tag * per);
    CHECK(x->length() == per);
    CHECK_THAT(x->what(), Catch::Contains("io_uring_submit of 196608 bytes at offset") &&
                            Catch::Contains("read unfinished"));
  }

  // The engine goes on: streamed, then batched.
  finished.clear();
  std::memset(in.get(), 0, per * count);
  for (std::size_t k = 0; k < count; ++k) {
    e.start({f.fd, k * per, in.get() + k * per, per, false, &f.path}, 10 + k);
  }
  for (int i = 0; i < 100'000 && e.active() > 0; ++i) { e.progress(true, done); }
  CHECK(e.active() == 0);
  REQUIRE(finished.size() == count);
  for (auto const& [tag, error] : finished) { CHECK_FALSE(error); }
  CHECK(std::memcmp(in.get(), out.get(), per * count) == 0);
  std::memset(in.get(), 0, per * count);
  io::request r{f.fd, 0, in.get(), per * count, false, &f.path};
  e.submit({&r, 1});
  CHECK(std::memcmp(in.get(), out.get(), per * count) == 0);
}

TEST_CASE("a failed wait: the pieces in the kernel's hands finish before their requests are failed", "[io][stream][ring]")
{
  unsigned const rings = GENERATE(1u, 2u);
  INFO(rings << " rings");
  // Reads from an empty pipe stay in the kernel's hands until someone writes to it.
  int p[2];
  REQUIRE(::pipe(p) == 0);
  std::string const name = "the test's pipe";
  std::size_t const n = 4096, count = 4;
  std::vector<std::byte> bufs(n * count, std::byte{0});
  io::uring_engine e(with_plan(options_for(io::backend::io_uring, 8, n, rings)));
  std::map<std::uint64_t, std::exception_ptr> finished;
  auto done = [&](std::uint64_t tag, std::exception_ptr error) {
    CHECK(finished.count(tag) == 0);
    finished[tag] = std::move(error);
  };
  e.options().faults->fail_ring(ring_call::wait, EOWNERDEAD);
  for (std::size_t k = 0; k < count; ++k) { e.start({p[0], 0, bufs.data() + k * n, n, false, &name}, k); }
  ssize_t written = 0;
  std::thread writer([&] {  // no Catch2 assertions off the main thread
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    std::vector<std::byte> const data(n * count, std::byte{0x5a});
    written = ::write(p[1], data.data(), data.size());
  });
  e.progress(true, done);  // the wait fails; the engine then waits for the writer
  writer.join();
  CHECK(written == static_cast<ssize_t>(n * count));
  CHECK(e.active() == 0);
  REQUIRE(finished.size() == count);
  for (auto const& [tag, error] : finished) {
    INFO("request " << tag);
    auto const x = io_error_in(error);
    REQUIRE(x);
    CHECK(x->code().value() == EOWNERDEAD);
    CHECK_THAT(x->operation(), Catch::StartsWith("io_uring_wait_cqe"));
    CHECK(x->path() == name);
    CHECK(x->length() == n);
  }
  // Every read had finished when it was reported: the pipe is empty, the buffers full.
  int left = -1;
  CHECK(::ioctl(p[0], FIONREAD, &left) == 0);
  CHECK(left == 0);
  CHECK(std::count(bufs.begin(), bufs.end(), std::byte{0x5a}) == static_cast<std::ptrdiff_t>(n * count));

  // The engine goes on.
  finished.clear();
  std::vector<std::byte> const more(n, std::byte{0x33});
  REQUIRE(::write(p[1], more.data(), n) == static_cast<ssize_t>(n));
  e.start({p[0], 0, bufs.data(), n, false, &name}, 99);
  for (int i = 0; i < 100'000 && e.active() > 0; ++i) { e.progress(true, done); }
  REQUIRE(finished.size() == 1);
  CHECK_FALSE(finished[99]);
  CHECK(bufs[0] == std::byte{0x33});
  CHECK(bufs[n - 1] == std::byte{0x33});
  ::close(p[0]);
  ::close(p[1]);
}

TEST_CASE("a ring that fails in a batched submit is drained, and the engine goes on", "[io][ring]")
{
  // The failed io_uring_submit_and_wait leaves pieces prepared in the ring but never
  // submitted. Waiting for their completions would never return; leaving them queued would
  // let the next call submit them against buffers the caller has freed: they are withdrawn.
  unsigned const rings = GENERATE(1u, 2u);
  INFO(rings << " rings");
  temp_file f("ring_fails_batch");
  std::size_t const block = 64 * 1024, size = 12 * block;
  aligned_bytes out(size), in(size);
  for (std::size_t i = 0; i < size; ++i) { out.get()[i] = static_cast<std::byte>((i * 7) ^ (i >> 11)); }
  io::uring_engine e(with_plan(options_for(io::backend::io_uring, 4, block, rings)));
  io::request const w{f.fd, 0, out.get(), size, true, &f.path};
  e.submit({&w, 1});

  e.options().faults->fail_ring(ring_call::submit, EIO);
  io::request const r{f.fd, 0, in.get(), size, false, &f.path};
  auto const failed = within(std::chrono::seconds(30), [&] {
    try {
      e.submit({&r, 1});
    } catch (io_error const& x) {
      return x.code().value();
    }
    return 0;
  });
  REQUIRE(failed.has_value());  // returned, rather than waiting for what was never submitted
  CHECK(*failed == EIO);

  std::memset(in.get(), 0, size);
  e.submit({&r, 1});
  CHECK(std::memcmp(in.get(), out.get(), size) == 0);
}

TEST_CASE("a batched submit that fails moves no byte the kernel never took, and the engine goes on", "[io][ring]")
{
  // The planted failure returns before the kernel is entered: every piece of the batch is
  // prepared in the ring and none is taken. None may be counted in flight, none may be
  // submitted later (its request has been reported failed), and no buffer is in the kernel's
  // hands, so the engine is not broken.
  unsigned const rings = GENERATE(1u, 2u);
  unsigned const times = GENERATE(1u, io::fault_plan::forever);
  INFO(rings << " rings, " << (times == 1 ? "one failure" : "a ring that stays failed"));
  temp_file f("ring_fails_untaken");
  std::size_t const block = 64 * 1024, size = 6 * block;
  aligned_bytes out(size), in(size);
  for (std::size_t i = 0; i < size; ++i) { out.get()[i] = static_cast<std::byte>((i * 11) ^ (i >> 10)); }
  io::uring_engine e(with_plan(options_for(io::backend::io_uring, 8, block, rings)));  // room for every piece
  io::request const w{f.fd, 0, out.get(), size, true, &f.path};
  e.submit({&w, 1});

  std::memset(in.get(), 0, size);
  io::request const r{f.fd, 0, in.get(), size, false, &f.path};
  e.options().faults->fail_ring(ring_call::submit, EIO, times);
  for (int attempt = 0; attempt < (times == 1 ? 1 : 2); ++attempt) {
    INFO("attempt " << attempt);
    try {
      e.submit({&r, 1});
      FAIL("a failed io_uring_submit_and_wait went unreported");
    } catch (io_error const& x) {
      CHECK(x.code().value() == EIO);
      CHECK_THAT(x.operation(), Catch::StartsWith("io_uring_submit_and_wait"));
      CHECK(x.path() == f.path);
      CHECK(x.length() == block);
      CHECK_THAT(x.what(), Catch::Contains("read unfinished"));
      CHECK_THAT(x.what(), !Catch::Contains("make a new one"));
    }
    // Nothing the kernel never took was run behind the caller's back: the failed ring's
    // pieces (all of them; with two rings and one failure, the half dealt to that ring) are
    // untouched, and the other ring's, if any, were read in full.
    std::size_t untouched = 0;
    for (std::size_t b = 0; b < size / block; ++b) {
      bool const zero = std::all_of(in.get() + b * block, in.get() + (b + 1) * block,
                                    [](std::byte x) { return x == std::byte{0}; });
      CHECK((zero || std::memcmp(in.get() + b * block, out.get() + b * block, block) == 0));
      untouched += zero ? 1 : 0;
    }
    CHECK(untouched == (rings == 2 && times == 1 ? 3u : 6u));
    std::memset(in.get(), 0, size);
  }
  e.options().faults->fail_ring(ring_call::submit, 0, 0);
  e.submit({&r, 1});
  CHECK(std::memcmp(in.get(), out.get(), size) == 0);
}

TEST_CASE("a ring whose submit always fails fails every request, every time, and runs none of them", "[io][stream][ring]")
{
  temp_file f("ring_dies");
  std::size_t const block = 64 * 1024, per = 2 * block, count = 3;
  aligned_bytes buf(per * count);
  std::memset(buf.get(), 0x11, per * count);
  io::uring_engine e(with_plan(options_for(io::backend::io_uring, 2, block)));
  io::request w{f.fd, 0, buf.get(), per * count, true, &f.path};
  e.submit({&w, 1});
  std::memset(buf.get(), 0, per * count);

  std::map<std::uint64_t, std::exception_ptr> finished;
  auto done = [&](std::uint64_t tag, std::exception_ptr error) { finished[tag] = std::move(error); };
  e.options().faults->fail_ring(ring_call::submit, EBADF, io::fault_plan::forever);
  for (int round = 0; round < 2; ++round) {
    INFO("round " << round);
    finished.clear();
    for (std::size_t k = 0; k < count; ++k) { e.start({f.fd, k * per, buf.get() + k * per, per, false, &f.path}, k); }
    e.progress(true, done);
    CHECK(e.active() == 0);
    REQUIRE(finished.size() == count);
    for (auto const& [tag, error] : finished) {
      auto const x = io_error_in(error);
      REQUIRE(x);
      CHECK(x->code().value() == EBADF);
      CHECK(x->operation() == "io_uring_submit");
      CHECK(x->offset() == tag * per);
      CHECK_THAT(x->what(), Catch::Contains("read unfinished") && !Catch::Contains("could not be drained"));
    }
    // The kernel took nothing, so nothing ran, and no buffer is in its hands.
    CHECK(std::count(buf.get(), buf.get() + per * count, std::byte{0}) == static_cast<std::ptrdiff_t>(per * count));
    CHECK(e.usable());
    CHECK(e.held().empty());
  }
  e.options().faults->fail_ring(ring_call::submit, 0, 0);
  io::request r{f.fd, 0, buf.get(), per * count, false, &f.path};
  e.submit({&r, 1});
  CHECK(std::count(buf.get(), buf.get() + per * count, std::byte{0x11}) == static_cast<std::ptrdiff_t>(per * count));
}

TEST_CASE("a ring that cannot be drained fails its requests, then every later call, saying so, and keeps the buffers",
          "[io][stream][ring]")
{
  // Reads from an empty pipe stay in the kernel's hands; a wait that always fails cannot see
  // them finish, so the kernel may write into their buffers at any later time.
  int p[2];
  REQUIRE(::pipe(p) == 0);
  std::string const name = "the test's pipe";
  std::size_t const n = 4096, count = 3;
  std::vector<std::byte> bufs(n * count, std::byte{0});  // outlives the engine, as held() asks
  {
    io::uring_engine e(with_plan(options_for(io::backend::io_uring, 4, n)));
    std::map<std::uint64_t, std::exception_ptr> finished;
    auto done = [&](std::uint64_t tag, std::exception_ptr error) { finished[tag] = std::move(error); };
    for (std::size_t k = 0; k < count; ++k) { e.start({p[0], 0, bufs.data() + k * n, n, false, &name}, k); }
    e.progress(false, done);  // submitted: now in the kernel's hands
    CHECK(finished.empty());
    e.options().faults->fail_ring(ring_call::wait, EBADF, io::fault_plan::forever);
    e.progress(true, done);
    CHECK(e.active() == 0);
    REQUIRE(finished.size() == count);
    for (auto const& [tag, error] : finished) {
      auto const x = io_error_in(error);
      REQUIRE(x);
      CHECK(x->code().value() == EBADF);
      CHECK_THAT(x->operation(), Catch::StartsWith("io_uring_wait_cqe"));
      CHECK(x->length() == n);
      CHECK_THAT(x->what(), Catch::Contains("could not be drained"));
    }
    CHECK_FALSE(e.usable());
    auto const held = e.held();
    REQUIRE(held.size() == count);
    for (auto const& h : held) {
      CHECK(h.size() == n);
      CHECK((h.data() >= bufs.data() && h.data() + h.size() <= bufs.data() + bufs.size()));
    }
    // Later calls fail at once, and say why, instead of waiting for what never comes.
    auto refused = [](io_error const& x) {
      return x.code().value() == EBADF && std::string_view(x.what()).find("make a new one") != std::string_view::npos;
    };
    try {
      e.start({p[0], 0, bufs.data(), n, false, &name}, 7);
      FAIL("a broken engine started a request");
    } catch (io_error const& x) {
      CHECK(refused(x));
    }
    CHECK(e.active() == 0);
    io::request r{p[0], 0, bufs.data(), n, false, &name};
    try {
      e.submit({&r, 1});
      FAIL("a broken engine ran a batch");
    } catch (io_error const& x) {
      CHECK(refused(x));
    }
    try {
      (void)e.register_buffer({bufs.data(), bufs.size()});
      FAIL("a broken engine registered a buffer");
    } catch (io_error const& x) {
      CHECK(refused(x));
    }
    e.progress(true, done);  // nothing active: returns
    CHECK(finished.size() == count);
  }  // closing the ring cancels the reads
  ::close(p[0]);
  ::close(p[1]);
  CHECK(std::count(bufs.begin(), bufs.end(), std::byte{0}) == static_cast<std::ptrdiff_t>(n * count));
}

namespace {

/// A streaming tier on a file, through an io_uring engine the test can make fail.
struct uring_file_tier {
  struct options {
    int fd                  = -1;
    std::string const* path = nullptr;
  };
  static constexpr std::string_view name = "uring_file_tier";

  uring_file_tier(std::size_t bytes, options const& o) : bytes_(bytes), o_(o) {}
  [[nodiscard]] std::size_t size() const { return bytes_; }
  void read(std::size_t offset, std::span<std::byte> to) const
  {
    io::request r{o_.fd, offset, to.data(), to.size(), false, o_.path};
    engine_.submit({&r, 1});
  }
  void write(std::size_t offset, std::span<std::byte const> from)
  {
    io::request w{o_.fd, offset, const_cast<std::byte*>(from.data()), from.size(), true, o_.path};
    engine_.submit({&w, 1});
  }
  void stream_start(tier_io const& op, std::uint64_t tag)
  {
    engine_.start({o_.fd, op.offset, op.data, op.length, op.write, o_.path}, tag);
  }
  template <class Done>
  void stream_progress(bool wait, Done&& done)
  {
    engine_.progress(wait, done);
  }
  [[nodiscard]] std::size_t stream_active() const { return engine_.active(); }
  io::uring_engine& engine() { return engine_; }

 private:
  std::size_t bytes_;
  options o_;
  mutable io::uring_engine engine_{with_plan(options_for(io::backend::io_uring, 4, 64 * 1024))};
};
static_assert(streaming_tier<uring_file_tier>);

}  // namespace

TEST_CASE("the pipelined transfer's I/O thread survives a failing ring instead of hanging", "[io][stream][ring]")
{
  temp_file f("ring_worker");
  constexpr std::size_t per = 128 * 1024, jobs = 6, buffers = 4;
  std::vector<std::byte> expected(per * jobs);
  for (std::size_t i = 0; i < expected.size(); ++i) { expected[i] = static_cast<std::byte>(i * 7 + (i >> 10)); }
  {
    aligned_bytes out(per * jobs);
    std::memcpy(out.get(), expected.data(), expected.size());
    io::engine e(options_for(io::backend::psync));
    io::request w{f.fd, 0, out.get(), per * jobs, true, &f.path};
    e.submit({&w, 1});
  }

  struct outcome {
    int ring_error = 0;  ///< what wait_all threw after the ring failed once
    std::string ring_operation;
    std::size_t active_after = 99;
    bool went_on             = false;  ///< reads after it succeeded, with the right bytes
    int dead_error           = 0;      ///< what wait_all threw once the ring died
    int later_error          = 0;      ///< ... and for a job queued after that
  };
  auto const result = within(std::chrono::seconds(30), [fd = f.fd, path = f.path, expected] {
    outcome o;
    uring_file_tier t(per * jobs, {fd, &path});
    aligned_bytes staging(per * buffers);
    auto read_all = [&](detail::io_worker<uring_file_tier>& w) {
      for (std::size_t k = 0; k < jobs; ++k) {
        w.enqueue({k * per, staging.get() + (k % buffers) * per, per, false}, static_cast<unsigned>(k % buffers));
      }
      w.wait_all();
    };
    {
      detail::io_worker<uring_file_tier> w(t);
      t.engine().options().faults->fail_ring(ring_call::submit, EIO);
      try {
        read_all(w);
      } catch (io_error const& x) {
        o.ring_error     = x.code().value();
        o.ring_operation = x.operation();
      }
      w.drain();
      o.active_after = t.stream_active();

      // It goes on: the last `buffers` jobs' bytes are in the staging buffers.
      try {
        read_all(w);
        o.went_on = true;
        for (std::size_t b = 0; b < buffers; ++b) {
          std::size_t const last = b + (jobs - 1 - b) / buffers * buffers;  // the last job on buffer b
          o.went_on = o.went_on && std::memcmp(staging.get() + b * per, expected.data() + last * per, per) == 0;
        }
      } catch (...) {
        o.went_on = false;
      }

      // A ring that dies: every wait throws, none hangs, and the worker still stops.
      t.engine().options().faults->fail_ring(ring_call::submit, EBADF, io::fault_plan::forever);
      try {
        read_all(w);
      } catch (io_error const& x) {
        o.dead_error = x.code().value();
      }
      w.drain();
      try {
        read_all(w);
      } catch (io_error const& x) {
        o.later_error = x.code().value();
      }
      w.drain();
    }  // ~io_worker joins its thread
    return o;
  });
  REQUIRE(result);  // within 30 seconds, not hung
  CHECK(result->ring_error == EIO);
  CHECK(result->ring_operation == "io_uring_submit");
  CHECK(result->active_after == 0);
  CHECK(result->went_on);
  CHECK(result->dead_error == EBADF);
  CHECK(result->later_error == EBADF);
}

namespace {

/// A streaming tier in memory whose stream_progress throws, every time, while requests are
/// active: a tier whose device has gone away and that cannot say what became of them.
struct throwing_stream_tier {
  struct options {};
  static constexpr std::string_view name = "throwing_stream_tier";

  throwing_stream_tier(std::size_t bytes, options const&) : bytes_(bytes) {}
  [[nodiscard]] std::size_t size() const { return bytes_; }
  void read(std::size_t, std::span<std::byte>) const {}
  void write(std::size_t, std::span<std::byte const>) {}
  void stream_start(tier_io const&, std::uint64_t tag) { active_.push_back(tag); }
  template <class Done>
  void stream_progress(bool, Done&& done)
  {
    ++calls;
    if (failing.load()) { throw std::runtime_error("throwing_stream_tier: the device went away"); }
    for (auto const tag : std::exchange(active_, {})) { done(tag, nullptr); }
  }
  [[nodiscard]] std::size_t stream_active() const { return active_.size(); }

  std::atomic<std::uint64_t> calls{0};
  std::atomic<bool> failing{true};

 private:
  std::size_t bytes_;
  std::vector<std::uint64_t> active_;
};
static_assert(streaming_tier<throwing_stream_tier>);

}  // namespace

TEST_CASE("a tier whose stream_progress throws with requests active fails the jobs once, without looping or hanging",
          "[io][stream][worker]")
{
  struct outcome {
    int failures_first      = 0;   ///< wait_all's throws in the first round
    std::uint64_t calls_first = 0;  ///< stream_progress calls when the first round failed
    std::uint64_t calls_later = 0;  ///< ... 300 ms later
    bool later_fails        = false;  ///< a later job fails too, with the tier's error
    std::uint64_t calls_end = 0;
  };
  auto const result = within(std::chrono::seconds(30), [] {
    outcome o;
    throwing_stream_tier t(1 << 20, {});
    std::vector<std::byte> staging(3 * 4096);
    {
      detail::io_worker<throwing_stream_tier> w(t);
      for (unsigned k = 0; k < 3; ++k) { w.enqueue({k * 4096, staging.data() + k * 4096, 4096, false}, k); }
      try {
        w.wait_all();
      } catch (std::runtime_error const& x) {
        o.failures_first += std::string_view(x.what()).find("went away") != std::string_view::npos ? 1 : 0;
      }
      o.calls_first = t.calls.load();
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      o.calls_later = t.calls.load();
      w.drain();
      w.enqueue({0, staging.data(), 4096, false}, 0);
      try {
        w.wait_all();
      } catch (std::runtime_error const& x) {
        o.later_fails = std::string_view(x.what()).find("went away") != std::string_view::npos;
      }
      w.drain();
    }  // ~io_worker joins its thread
    o.calls_end = t.calls.load();
    return o;
  });
  REQUIRE(result);  // within 30 seconds: no hang
  CHECK(result->failures_first == 1);
  CHECK(result->calls_first >= 1);
  CHECK(result->calls_later == result->calls_first);  // no busy loop on a throwing tier
  CHECK(result->later_fails);                          // refused, with the tier's own error
  CHECK(result->calls_end == result->calls_first);     // the tier is never driven again
}
