// SPDX-License-Identifier: Apache-2.0
// A disk that never answers: an I/O the kernel takes and never completes becomes an io_error
// with ETIMEDOUT after engine_options::timeout, in bounded time, naming path, offset, length
// and operation. Where the cancellation is confirmed the engine goes on; where it is not
// (an uncancellable hang, or psync, which cannot cancel a pread) the engine is unusable from
// then on, says so on every call, and names the buffers the kernel may still use. Through
// the library: an NvmeFile step (retryable when nothing changed, else state_lost), save (the
// previous checkpoint survives, no temporary is left) and load (nothing changes). And a
// user's streaming tier whose stream_progress throws: the step throws, once per step, with no
// busy loop and no hang.
#include "matrix.hpp"
#include "nvme_support.hpp"

#include <tierstate/io/engine.hpp>
#include <tierstate/tierstate.hpp>

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
#include <vector>

#include <fcntl.h>
#include <unistd.h>

using namespace tierstate;
using namespace tierstate::test;
using namespace std::chrono_literals;

namespace {

constexpr auto short_timeout = std::chrono::milliseconds(200);
/// A bound, not a speed: a hung call must return well within it (a timeout, a grace, and a
/// loaded machine or a sanitizer on top).
constexpr auto bound = std::chrono::seconds(60);

struct aligned_bytes {
  std::unique_ptr<std::byte, decltype(&std::free)> p;
  explicit aligned_bytes(std::size_t n) : p(static_cast<std::byte*>(std::aligned_alloc(4096, n)), &std::free) {}
  std::byte* get() const { return p.get(); }
};

struct temp_file {
  std::string path;
  int fd = -1;
  explicit temp_file(char const* name)
  {
    path = (std::filesystem::temp_directory_path() /
            (std::string("tierstate_") + name + "_" + std::to_string(::getpid())))
             .string();
    fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_DIRECT, 0600);
    if (fd < 0) { fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600); }  // tmpfs refuses O_DIRECT
    REQUIRE(fd >= 0);
  }
  ~temp_file()
  {
    ::close(fd);
    ::unlink(path.c_str());
  }
};

io::engine_options timed(io::backend b, std::shared_ptr<io::fault_plan> plan, unsigned depth = 4,
                         std::size_t block = 64 * 1024, unsigned rings = 1)
{
  io::engine_options o;
  o.backend     = b;
  o.queue_depth = depth;
  o.block_size  = block;
  o.rings       = rings;
  o.timeout     = short_timeout;
  o.faults      = std::move(plan);
  return o;
}

/// What an io_error said, copied out of the thread that caught it.
struct caught {
  bool threw  = false;
  int code    = 0;
  std::string operation, path, what;
  std::uint64_t offset = 0, length = 0;
  std::chrono::steady_clock::duration took{};
};

caught describe(io_error const& x)
{
  caught c;
  c.threw     = true;
  c.code      = x.code().value();
  c.operation = x.operation();
  c.path      = x.path();
  c.what      = x.what();
  c.offset    = x.offset();
  c.length    = x.length();
  return c;
}

/// Runs f, and says what io_error it threw (any other exception propagates).
template <class F>
caught catch_io(F&& f)
{
  auto const t0 = std::chrono::steady_clock::now();
  caught c;
  try {
    f();
  } catch (io_error const& x) {
    c = describe(x);
  }
  c.took = std::chrono::steady_clock::now() - t0;
  return c;
}

caught caught_in(std::exception_ptr const& e)
{
  if (!e) { return {}; }
  try {
    std::rethrow_exception(e);
  } catch (io_error const& x) {
    return describe(x);
  } catch (...) {
  }
  caught c;
  c.threw = true;
  return c;
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

bool inside(std::span<std::byte> part, std::byte const* base, std::size_t n)
{
  return part.data() >= base && part.data() + part.size() <= base + n;
}

}  // namespace

// --- the engines ----------------------------------------------------------------------------

TEST_CASE("the timeout is an engine option, validated by name, 120 s by default, 0 for none", "[io][timeout]")
{
  CHECK(io::engine_options{}.timeout == std::chrono::seconds(120));
  io::engine_options o;
  o.timeout = std::chrono::milliseconds(-1);
  CHECK_THROWS_WITH(io::engine(o), Catch::Contains("io.timeout = -1 ms") && Catch::Contains("24 hours"));
  o.timeout = std::chrono::hours(25);
  CHECK_THROWS_WITH(io::engine(o), Catch::Contains("io.timeout = 90000000 ms"));
  o.timeout = std::chrono::milliseconds(0);
  CHECK_NOTHROW(io::engine(o));
  CHECK(io::cancel_grace(o) == std::chrono::milliseconds(100));
  o.timeout = std::chrono::minutes(2);
  CHECK(io::cancel_grace(o) == std::chrono::seconds(1));
}

TEST_CASE("an I/O that never answers fails with ETIMEDOUT, is cancelled, and the engine goes on", "[io][timeout]")
{
  auto const o_write     = GENERATE(false, true);
  unsigned const rings   = GENERATE(1u, 2u);
  unsigned const depth   = GENERATE(1u, 4u);
  INFO((o_write ? "write" : "read") << ", " << rings << " rings, depth " << depth);
  temp_file f("hang");
  std::size_t const block = 64 * 1024, n = 8 * block;
  aligned_bytes out(n), in(n);
  for (std::size_t i = 0; i < n; ++i) { out.get()[i] = static_cast<std::byte>((i * 19) ^ (i >> 9)); }
  auto plan = std::make_shared<io::fault_plan>();
  io::engine e(timed(io::backend::io_uring, plan, depth, block, rings));
  io::request const w{f.fd, 0, out.get(), n, true, &f.path};
  io::request const r{f.fd, 0, in.get(), n, false, &f.path};
  e.submit({&w, 1});

  io::op const o = o_write ? io::op::write : io::op::read;
  plan->hang(o, plan->seen(o) + 3);
  auto const result = within(bound, [&] { return catch_io([&] { e.submit({o_write ? &w : &r, 1}); }); });
  REQUIRE(result);  // in bounded time, not hung
  CHECK(result->threw);
  CHECK(result->code == ETIMEDOUT);
  CHECK(result->operation == (o_write ? "write" : "read"));
  CHECK(result->path == f.path);
  CHECK(result->length == block);
  CHECK(result->offset % block == 0);
  CHECK(result->offset < n);
  if (rings == 1 && depth == 1) { CHECK(result->offset == 2 * block); }  // pieces in order: the third
  CHECK_THAT(result->what, Catch::Contains("no answer within 200 ms") && Catch::Contains("cancelled"));
  CHECK(result->took >= short_timeout);
  CHECK(e.usable());
  CHECK(e.held().empty());

  // The engine goes on: the same transfer again, and the bytes are right.
  e.submit({&w, 1});
  std::memset(in.get(), 0, n);
  e.submit({&r, 1});
  CHECK(std::memcmp(in.get(), out.get(), n) == 0);
}

TEST_CASE("a streamed request that never answers fails alone with ETIMEDOUT; the others finish", "[io][timeout][stream]")
{
  unsigned const rings = GENERATE(1u, 2u);
  INFO(rings << " rings");
  temp_file f("hang_stream");
  std::size_t const block = 64 * 1024, per = 2 * block, count = 6;
  aligned_bytes out(per * count), in(per * count);
  for (std::size_t i = 0; i < per * count; ++i) { out.get()[i] = static_cast<std::byte>((i * 23) ^ (i >> 10)); }
  auto plan = std::make_shared<io::fault_plan>();
  io::engine e(timed(io::backend::io_uring, plan, 4, block, rings));
  io::request const w{f.fd, 0, out.get(), per * count, true, &f.path};
  e.submit({&w, 1});

  plan->hang(io::op::read, plan->seen(io::op::read) + 4);
  auto const finished = within(bound, [&] {
    std::map<std::uint64_t, caught> done;
    for (std::size_t k = 0; k < count; ++k) { e.start({f.fd, k * per, in.get() + k * per, per, false, &f.path}, k); }
    while (e.active() > 0) {
      e.progress(true, [&](std::uint64_t tag, std::exception_ptr err) { done[tag] = caught_in(err); });
    }
    return done;
  });
  REQUIRE(finished);
  REQUIRE(finished->size() == count);
  std::size_t timed_out = 0;
  for (auto const& [tag, c] : *finished) {
    INFO("request " << tag);
    if (!c.threw) {
      CHECK(std::memcmp(in.get() + tag * per, out.get() + tag * per, per) == 0);
      continue;
    }
    ++timed_out;
    CHECK(c.code == ETIMEDOUT);
    CHECK(c.operation == "read");
    CHECK(c.offset >= tag * per);
    CHECK(c.offset < (tag + 1) * per);
    CHECK(c.length == block);
    CHECK_THAT(c.what, Catch::Contains("cancelled"));
  }
  CHECK(timed_out == 1);
  CHECK(e.usable());
  std::memset(in.get(), 0, per * count);
  io::request const r{f.fd, 0, in.get(), per * count, false, &f.path};
  e.submit({&r, 1});
  CHECK(std::memcmp(in.get(), out.get(), per * count) == 0);
}

TEST_CASE("an I/O whose cancellation is not confirmed leaves the engine unusable, saying so, and keeps its buffer",
          "[io][timeout]")
{
  auto const backend = GENERATE(io::backend::io_uring, io::backend::psync);
  bool const o_write = GENERATE(false, true);
  INFO(io::backend_name(backend) << ", " << (o_write ? "write" : "read"));
  temp_file f("hang_for_good");
  std::size_t const block = 64 * 1024, n = 6 * block;
  aligned_bytes buf(n);  // outlives the engine: held() asks for it never to be freed while it may land
  std::memset(buf.get(), 0x5c, n);
  auto plan = std::make_shared<io::fault_plan>();
  {
    auto e = std::make_unique<io::engine>(timed(backend, plan, 4, block));
    io::request const req{f.fd, 0, buf.get(), n, o_write, &f.path};
    io::op const o = o_write ? io::op::write : io::op::read;
    if (!o_write) {
      io::request const w{f.fd, 0, buf.get(), n, true, &f.path};
      e->submit({&w, 1});
    }
    plan->hang(o, plan->seen(o) + 2, /*cancellable=*/false);
    auto const result = within(bound, [&] { return catch_io([&] { e->submit({&req, 1}); }); });
    REQUIRE(result);
    CHECK(result->code == ETIMEDOUT);
    CHECK(result->operation == (o_write ? "write" : "read"));
    CHECK(result->path == f.path);
    CHECK(result->length == block);
    CHECK_THAT(result->what, Catch::Contains("no answer within 200 ms") && Catch::Contains("held()") &&
                               Catch::Contains("unusable"));
    if (backend == io::backend::io_uring) {
      CHECK_THAT(result->what, Catch::Contains("cancellation was not confirmed"));
    } else {
      CHECK_THAT(result->what, Catch::Contains("cannot be cancelled"));
    }
    CHECK_FALSE(e->usable());
    auto const held = e->held();
    REQUIRE_FALSE(held.empty());
    for (auto const& h : held) {
      CHECK(inside(h, buf.get(), n));
      CHECK(h.size() == block);
    }

    // Every later call refuses at once, naming the I/O that broke the engine.
    auto refused = [&](caught const& c) {
      return c.code == ETIMEDOUT && c.path == f.path && c.what.find("this engine is unusable") != std::string::npos &&
             c.what.find("make a new engine") != std::string::npos;
    };
    CHECK(refused(catch_io([&] { e->submit({&req, 1}); })));
    CHECK(refused(catch_io([&] { e->start(req, 1); })));
    CHECK(refused(catch_io([&] { (void)e->register_buffer({buf.get(), n}); })));
    CHECK(e->active() == 0);

    // Destroying it does not wait for what never answers.
    auto const gone = within(bound, [&] {
      e.reset();
      return true;
    });
    REQUIRE(gone);
  }
  plan->release_hangs();  // the planted hang ends (it never wrote a byte): a stuck psync thread leaves
  CHECK(std::count(buf.get(), buf.get() + n, std::byte{0x5c}) == static_cast<std::ptrdiff_t>(n));
}

TEST_CASE("a batch over two rings: the ring that breaks the engine says why, whatever else failed first",
          "[io][timeout]")
{
  // The first read piece hangs for good and the second fails at once; each ring's thread
  // may meet either, or both. Whichever failure is seen first, the batch reports the one that
  // broke the engine, and the engine keeps the hung piece's buffer.
  temp_file f("hang_two_rings");
  std::size_t const block = 64 * 1024, n = 8 * block;
  aligned_bytes buf(n);  // outlives the engine, as held() asks
  std::memset(buf.get(), 0x3a, n);
  auto plan = std::make_shared<io::fault_plan>();
  {
    auto e = std::make_unique<io::engine>(timed(io::backend::io_uring, plan, 4, block, 2));
    io::request const w{f.fd, 0, buf.get(), n, true, &f.path};
    e->submit({&w, 1});
    plan->hang(io::op::read, plan->seen(io::op::read) + 1, /*cancellable=*/false);
    plan->fail(io::op::read, plan->seen(io::op::read) + 2, EIO);
    io::request const r{f.fd, 0, buf.get(), n, false, &f.path};
    auto const result = within(bound, [&] { return catch_io([&] { e->submit({&r, 1}); }); });
    REQUIRE(result);
    CHECK(result->code == ETIMEDOUT);
    CHECK(result->operation == "read");
    CHECK(result->length == block);
    CHECK_THAT(result->what, Catch::Contains("cancellation was not confirmed") && Catch::Contains("held()"));
    CHECK_FALSE(e->usable());
    auto const held = e->held();
    REQUIRE(held.size() == 1);
    CHECK(inside(held.front(), buf.get(), n));
    CHECK(held.front().size() == block);
    CHECK(catch_io([&] { e->submit({&r, 1}); }).what.find("this engine is unusable") != std::string::npos);
    auto const gone = within(bound, [&] {
      e.reset();
      return true;
    });
    REQUIRE(gone);
  }
  plan->release_hangs();
  CHECK(std::count(buf.get(), buf.get() + n, std::byte{0x3a}) == static_cast<std::ptrdiff_t>(n));
}

TEST_CASE("streaming: an uncancellable hang fails every active request and breaks the engine", "[io][timeout][stream]")
{
  auto const backend = GENERATE(io::backend::io_uring, io::backend::psync);
  INFO(io::backend_name(backend));
  temp_file f("hang_stream_for_good");
  std::size_t const block = 64 * 1024, per = 2 * block, count = 4;
  aligned_bytes buf(per * count);
  auto plan = std::make_shared<io::fault_plan>();
  {
    io::engine e(timed(backend, plan, 4, block));
    io::request const w{f.fd, 0, buf.get(), per * count, true, &f.path};
    e.submit({&w, 1});
    plan->hang(io::op::read, plan->seen(io::op::read) + 2, /*cancellable=*/false);
    auto const finished = within(bound, [&] {
      std::map<std::uint64_t, caught> done;
      for (std::size_t k = 0; k < count; ++k) {
        e.start({f.fd, k * per, buf.get() + k * per, per, false, &f.path}, k);
      }
      while (e.active() > 0) {
        e.progress(true, [&](std::uint64_t tag, std::exception_ptr err) { done[tag] = caught_in(err); });
      }
      return done;
    });
    REQUIRE(finished);
    REQUIRE(finished->size() == count);
    std::size_t hung = 0;
    for (auto const& [tag, c] : *finished) {
      INFO("request " << tag);
      if (!c.threw) { continue; }  // io_uring: finished before the engine gave up
      CHECK(c.code == ETIMEDOUT);
      CHECK(c.operation == "read");
      hung += c.what.find("held()") != std::string::npos ? 1 : 0;
    }
    CHECK(hung >= 1);
    CHECK_FALSE(e.usable());
    CHECK_FALSE(e.held().empty());
    CHECK(catch_io([&] { e.start({f.fd, 0, buf.get(), per, false, &f.path}, 9); }).code == ETIMEDOUT);
    CHECK(e.active() == 0);
  }
  plan->release_hangs();
}

TEST_CASE("with timeout 0 an I/O is waited for as long as it takes", "[io][timeout]")
{
  auto const backend = GENERATE(io::backend::io_uring, io::backend::psync);
  INFO(io::backend_name(backend));
  temp_file f("no_timeout");
  std::size_t const block = 64 * 1024, n = 4 * block;
  aligned_bytes buf(n);
  auto plan = std::make_shared<io::fault_plan>();
  auto o    = timed(backend, plan, 4, block);
  o.timeout = std::chrono::milliseconds(0);
  io::engine e(o);
  io::request const w{f.fd, 0, buf.get(), n, true, &f.path};
  e.submit({&w, 1});
  plan->hang(io::op::read, plan->seen(io::op::read) + 1);
  // The device answers at last, having moved nothing: 600 ms is three times the others' timeout.
  std::thread answer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(600));
    plan->release_hangs();
  });
  io::request const r{f.fd, 0, buf.get(), n, false, &f.path};
  auto const result = within(bound, [&] { return catch_io([&] { e.submit({&r, 1}); }); });
  answer.join();
  REQUIRE(result);
  CHECK(result->code == ENODATA);  // no progress, not a timeout
  // The answering thread's 600 ms began before the submit's clock did: it waited well past
  // a 200 ms timeout, for about 600 ms.
  CHECK(result->took >= std::chrono::milliseconds(400));
  CHECK(e.usable());
  e.submit({&r, 1});
}

// --- through the library --------------------------------------------------------------------

namespace {

/// How the planted hang behaves.
enum class hang_kind { cancellable, uncancellable, psync };

char const* name_of(hang_kind k)
{
  return k == hang_kind::cancellable ? "io_uring, cancellable" : k == hang_kind::uncancellable ? "io_uring, not cancellable" : "psync";
}

/// An NvmeFile optimizer over the test model whose engine times out after 200 ms.
template <class Transfer>
struct hung_run {
  using Opt = NvmeOpt<Fp32, Transfer>;
  scratch_dir d;
  std::shared_ptr<io::fault_plan> faults = std::make_shared<io::fault_plan>();
  nvme_model<Fp32> m;
  std::unique_ptr<Opt> opt;

  explicit hung_run(io::backend b = io::backend::io_uring)
  {
    typename Opt::options o;
    o.chunk_elements   = 2048;
    o.tier             = in(d);
    o.tier.io.backend  = b;
    o.tier.io.faults   = faults;
    o.tier.io.timeout  = short_timeout;
    opt = std::make_unique<Opt>(schedule<Opt>(1), o);
    register_model(*opt, m);
  }
  ~hung_run() { faults->release_hangs(); }
  step_result step(int t)
  {
    m.fill_grads(t);
    opt->set_hyperparameters(0, schedule<Opt>(t));
    auto const views = m.views();
    return opt->step(views);
  }
};

}  // namespace

TEMPLATE_LIST_TEST_CASE("an NvmeFile step whose first read never answers throws ETIMEDOUT in bounded time, changing nothing",
                        "[nvme][timeout]", matrix::host_transfers)
{
  auto const kind = GENERATE(hang_kind::cancellable, hang_kind::uncancellable, hang_kind::psync);
  INFO(name_of(kind));
  hung_run<TestType> run(kind == hang_kind::psync ? io::backend::psync : io::backend::io_uring);
  run.step(1);
  run.step(2);
  run.faults->hang(io::op::read, run.faults->seen(io::op::read) + 1, kind == hang_kind::cancellable);
  auto const result = within(bound, [&] { return catch_io([&] { run.step(3); }); });
  REQUIRE(result);
  CHECK(result->code == ETIMEDOUT);
  CHECK(result->operation == "read");
  CHECK(result->offset % 4096 == 0);
  CHECK_THAT(result->path, Catch::Contains(run.d.path.string()));
  CHECK_THAT(result->what, Catch::Contains("no answer within 200 ms"));
  CHECK_FALSE(run.opt->state_lost());  // no chunk was changed
  CHECK(run.opt->step_count() == 2);

  if (kind == hang_kind::cancellable) {
    // Retried, the step goes through, and training gives the reference's bits.
    CHECK(run.step(3).step == 3);
    for (int t = 4; t <= 6; ++t) { run.step(t); }
    CHECK(snapshot(*run.opt, run.m) == reference<Fp32>(6, 2048));
  } else {
    // The engine kept a buffer the kernel may still write into: it refuses, every time.
    for (int i = 0; i < 2; ++i) {
      auto const again = within(bound, [&] { return catch_io([&] { run.step(3); }); });
      REQUIRE(again);
      CHECK(again->code == ETIMEDOUT);
      CHECK_THAT(again->what, Catch::Contains("this engine is unusable"));
      CHECK_FALSE(run.opt->state_lost());
    }
  }
  // Destroying the optimizer does not wait for what never answers.
  auto const gone = within(bound, [&] {
    run.opt.reset();
    return true;
  });
  REQUIRE(gone);
}

TEMPLATE_LIST_TEST_CASE("an NvmeFile write that never answers in the middle of a step throws ETIMEDOUT and loses the state",
                        "[nvme][timeout]", matrix::host_transfers)
{
  hung_run<TestType> run;
  run.step(1);
  std::size_t const chunks = run.opt->state_layout().chunk_count();
  REQUIRE(chunks > 4);
  run.faults->hang(io::op::write, run.faults->seen(io::op::write) + chunks / 2);
  auto const result = within(bound, [&] { return catch_io([&] { run.step(2); }); });
  REQUIRE(result);
  CHECK(result->code == ETIMEDOUT);
  CHECK(result->operation == "write");
  CHECK_THAT(result->path, Catch::Contains(run.d.path.string()));
  CHECK(run.opt->state_lost());  // chunks before it were written: part old, part new
  CHECK_THROWS_AS(run.step(3), state_lost);
}

TEST_CASE("a checkpoint write that never answers: save throws ETIMEDOUT, the previous checkpoint survives, no temporary is left",
          "[checkpoint][timeout]")
{
  auto const kind = GENERATE(hang_kind::cancellable, hang_kind::uncancellable, hang_kind::psync);
  INFO(name_of(kind));
  hung_run<Pipelined<2>> run;
  scratch_dir ckpt;
  auto const file = ckpt.path / "run.ckpt";
  run.step(1);
  run.step(2);
  run.opt->save(file);
  run_result const saved = snapshot(*run.opt, run.m);
  run.step(3);

  checkpoint_options co;
  co.io = timed(kind == hang_kind::psync ? io::backend::psync : io::backend::io_uring, run.faults, 4, 1 << 20);
  run.faults->hang(io::op::write, run.faults->seen(io::op::write) + 3, kind == hang_kind::cancellable);
  auto const result = within(bound, [&] { return catch_io([&] { run.opt->save(file, co); }); });
  REQUIRE(result);
  CHECK(result->code == ETIMEDOUT);
  CHECK(result->operation == "write");
  CHECK_THAT(result->what, Catch::Contains("no answer within 200 ms"));
  CHECK(ckpt.entries() == std::vector<std::string>{"run.ckpt"});  // no temporary, under any name
  CHECK_FALSE(run.opt->state_lost());  // saving reads the state; it changes none of it
  CHECK(run.opt->step_count() == 3);

  // The previous checkpoint is whole: it loads, with step 2's state.
  HostOpt<Fp32>::options ho;
  ho.chunk_elements = 2048;
  nvme_model<Fp32> m2;
  HostOpt<Fp32> fresh(schedule<HostOpt<Fp32>>(1), ho);
  register_model(fresh, m2);
  fresh.load(file);
  run_result const back = snapshot(fresh, m2);
  CHECK(back.steps == 2);
  CHECK(back.slots == saved.slots);
}

TEST_CASE("a checkpoint read that never answers: load throws ETIMEDOUT and changes nothing", "[checkpoint][timeout]")
{
  auto const kind = GENERATE(hang_kind::cancellable, hang_kind::uncancellable, hang_kind::psync);
  INFO(name_of(kind));
  hung_run<Pipelined<2>> run;
  scratch_dir ckpt;
  auto const file = ckpt.path / "run.ckpt";
  run.step(1);
  run.step(2);
  run.opt->save(file);
  run.step(3);
  run.step(4);
  run_result const before = snapshot(*run.opt, run.m);

  checkpoint_options co;
  co.io = timed(kind == hang_kind::psync ? io::backend::psync : io::backend::io_uring, run.faults, 4, 1 << 20);
  // The third read of the load: the header and the checksum table come first, then pass 1
  // checks chunks; nothing is written before every read of pass 1 has succeeded.
  run.faults->hang(io::op::read, run.faults->seen(io::op::read) + 3, kind == hang_kind::cancellable);
  auto const result = within(bound, [&] { return catch_io([&] { run.opt->load(file, co); }); });
  REQUIRE(result);
  CHECK(result->code == ETIMEDOUT);
  CHECK(result->operation == "read");
  CHECK(result->path == file.string());
  CHECK_FALSE(run.opt->state_lost());
  CHECK(snapshot(*run.opt, run.m) == before);  // params, every slot and the step count

  // It goes on, and a load without the hang works.
  CHECK(run.step(5).step == 5);
  run.opt->load(file);
  CHECK(run.opt->step_count() == 2);
}

// --- a tier whose stream_progress throws --------------------------------------------------

namespace {

/// A streaming tier in memory whose stream_progress, once `failing` is set, throws every time
/// while requests are active: a tier whose device went away without a word about them.
struct failing_stream_tier {
  struct options {};
  static constexpr std::string_view name = "failing_stream_tier";

  failing_stream_tier(std::size_t bytes, options const&) : bytes_(bytes, std::byte{0}) {}
  [[nodiscard]] std::size_t size() const { return bytes_.size(); }
  void read(std::size_t offset, std::span<std::byte> to) const
  {
    std::memcpy(to.data(), bytes_.data() + offset, to.size());
  }
  void write(std::size_t offset, std::span<std::byte const> from)
  {
    std::memcpy(bytes_.data() + offset, from.data(), from.size());
  }
  void stream_start(tier_io const& op, std::uint64_t tag) { active_.push_back({op, tag}); }
  template <class Done>
  void stream_progress(bool, Done&& done)
  {
    ++control->calls;
    if (control->failing.load()) { throw std::runtime_error("failing_stream_tier: the device went away"); }
    for (auto const& [op, tag] : std::exchange(active_, {})) {
      if (op.write) {
        write(op.offset, {op.data, op.length});
      } else {
        read(op.offset, {op.data, op.length});
      }
      done(tag, nullptr);
    }
  }
  [[nodiscard]] std::size_t stream_active() const { return active_.size(); }

  /// Shared with the test's thread (and kept apart: the tier itself is moved into place).
  struct switches {
    std::atomic<std::uint64_t> calls{0};
    std::atomic<bool> failing{false};
  };
  std::shared_ptr<switches> control = std::make_shared<switches>();

 private:
  std::vector<std::byte> bytes_;
  std::vector<std::pair<tier_io, std::uint64_t>> active_;
};
static_assert(streaming_tier<failing_stream_tier> && !addressable_tier<failing_stream_tier>);

}  // namespace

TEST_CASE("a user tier whose stream_progress throws: the step throws, in bounded time, with no busy loop and no hang",
          "[tier][timeout][stream]")
{
  using Opt = OffloadedOptimizer<AdamW, Fp32, failing_stream_tier, Pipelined<2>>;
  struct outcome {
    bool first_throws      = false;
    std::uint64_t calls_at = 0;   ///< stream_progress calls when the step threw
    std::uint64_t calls_later = 0;  ///< ... 300 ms later
    bool lost               = true;
    bool later_throws       = false;
    std::uint64_t calls_end = 0;
  };
  auto const result = within(bound, [] {
    outcome o;
    nvme_model<Fp32> m;
    Opt::options opts;
    opts.chunk_elements = 2048;
    auto opt = std::make_unique<Opt>(schedule<Opt>(1), opts);
    register_model(*opt, m);
    auto step = [&](int t) {
      m.fill_grads(t);
      auto const views = m.views();
      return opt->step(views);
    };
    step(1);
    auto const control = opt->state_tier().control;
    control->failing   = true;
    try {
      step(2);
    } catch (std::runtime_error const& x) {
      o.first_throws = std::string_view(x.what()).find("went away") != std::string_view::npos;
    }
    o.calls_at = control->calls.load();
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    o.calls_later = control->calls.load();
    o.lost        = opt->state_lost();
    try {
      step(2);
    } catch (std::runtime_error const& x) {
      o.later_throws = std::string_view(x.what()).find("went away") != std::string_view::npos;
    }
    o.calls_end = control->calls.load();
    opt.reset();  // joins the I/O thread
    return o;
  });
  REQUIRE(result);  // no hang, in the step or in the destructor
  CHECK(result->first_throws);
  CHECK(result->calls_at >= 1);
  CHECK(result->calls_later == result->calls_at);  // not called again: no busy loop
  CHECK_FALSE(result->lost);                        // it failed on the step's first reads
  CHECK(result->later_throws);                      // refused, with the tier's own error
  CHECK(result->calls_end == result->calls_at);
}
