// SPDX-License-Identifier: Apache-2.0
// Checkpoints: resume is exact (also across tiers), every difference and every corruption
// is a clear error that changes nothing, and a failing save leaves the previous checkpoint
// whole, at every I/O position.
#include "matrix.hpp"
#include "nvme_support.hpp"

#include <catch2/catch.hpp>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <set>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

using namespace tierstate;
using namespace tierstate::test;

namespace {

/// An optimizer over the test model, stepping on the same schedule as train().
template <class Opt>
struct trainer {
  nvme_model<typename Opt::precision_type> m;
  Opt opt;
  explicit trainer(typename Opt::options const& o) : opt(schedule<Opt>(1), o) { register_model(opt, m); }
  void steps(int from, int to)
  {
    for (int t = from; t <= to; ++t) {
      m.fill_grads(t);
      opt.set_hyperparameters(0, schedule<Opt>(t));
      auto const views = m.views();
      opt.step(views);
    }
  }
};

template <class Opt>
typename Opt::options options_with(std::size_t chunk, scratch_dir const* d = nullptr)
{
  typename Opt::options o;
  o.chunk_elements = chunk;
  if constexpr (std::is_same_v<typename Opt::tier_type, NvmeFile>) { o.tier = in(*d); }
  return o;
}

std::vector<char> file_bytes(std::filesystem::path const& p)
{
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

void flip_bit(std::filesystem::path const& p, std::uint64_t offset, int bit)
{
  std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(offset));
  char c = 0;
  f.get(c);
  c = static_cast<char>(c ^ (1 << bit));
  f.seekp(static_cast<std::streamoff>(offset));
  f.put(c);
}

}  // namespace

TEMPLATE_LIST_TEST_CASE("N steps, save, load into a fresh optimizer, M steps: the bits of N + M steps", "[checkpoint]",
                        matrix::precisions)
{
  using P = TestType;
  scratch_dir d;
  auto const ckpt = d.path / "opt.ckpt";
  run_result const straight = reference<P>(12, 2048);

  SECTION("PinnedHost to PinnedHost")
  {
    trainer<HostOpt<P>> a(options_with<HostOpt<P>>(2048));
    a.steps(1, 7);
    a.opt.save(ckpt);
    trainer<HostOpt<P>> b(options_with<HostOpt<P>>(2048));
    b.m.params = a.m.params;  // the model's weights, which the user checkpoints (fp32: no master)
    b.opt.load(ckpt);
    CHECK(b.opt.step_count() == 7);
    b.steps(8, 12);
    CHECK(snapshot(b.opt, b.m) == straight);
  }
  SECTION("NvmeFile to PinnedHost, and back")
  {
    trainer<NvmeOpt<P>> a(options_with<NvmeOpt<P>>(2048, &d));
    a.steps(1, 5);
    a.opt.save(ckpt);
    trainer<HostOpt<P>> b(options_with<HostOpt<P>>(2048));
    b.m.params = a.m.params;
    b.opt.load(ckpt);
    b.steps(6, 9);
    b.opt.save(ckpt);  // over the first one
    trainer<NvmeOpt<P, Synchronous>> c(options_with<NvmeOpt<P, Synchronous>>(2048, &d));
    c.m.params = b.m.params;
    c.opt.load(ckpt);
    c.steps(10, 12);
    CHECK(snapshot(c.opt, c.m) == straight);
  }
  // Nothing but the checkpoint is left in the directory.
  auto entries = d.entries();
  CHECK(entries == std::vector<std::string>{"opt.ckpt"});
}

TEST_CASE("with a master, load writes the params from it", "[checkpoint]")
{
  scratch_dir d;
  trainer<HostOpt<Bf16Mixed>> a(options_with<HostOpt<Bf16Mixed>>(4096));
  a.steps(1, 3);
  a.opt.save(d.path / "c");
  trainer<HostOpt<Bf16Mixed>> b(options_with<HostOpt<Bf16Mixed>>(4096));  // params as at init
  b.opt.load(d.path / "c");
  CHECK(snapshot(b.opt, b.m) == snapshot(a.opt, a.m));
  CHECK(b.opt.group_count() == 2);
  CHECK(b.opt.group_of("t4") == 1);
  CHECK(b.opt.get_hyperparameters(1).betas[0] == 0.8);
}

TEST_CASE("a checkpoint from a different optimizer is refused, naming the difference", "[checkpoint][errors]")
{
  scratch_dir d;
  auto const ckpt = d.path / "c";
  trainer<HostOpt<Bf16Mixed>> a(options_with<HostOpt<Bf16Mixed>>(2048));
  a.steps(1, 2);
  a.opt.save(ckpt);
  auto expect_refusal = [&](auto& opt, std::string const& words, std::string const& tensor = "t1") {
    std::vector<float> before(tensor == "t1" ? nvme_sizes[1] : 100), after(before.size());
    opt.copy_state(tensor, slot::exp_avg_sq, before);
    auto const steps = opt.step_count();
    CHECK_THROWS_MATCHES(opt.load(ckpt), checkpoint_error,
                         Catch::Predicate<checkpoint_error>([&](checkpoint_error const& e) {
                           return std::string(e.what()).find(words) != std::string::npos &&
                                  std::string(e.what()).find(ckpt.string()) != std::string::npos;
                         }, "names: " + words));
    opt.copy_state(tensor, slot::exp_avg_sq, after);
    CHECK(before == after);
    CHECK(opt.step_count() == steps);
  };
  SECTION("another rule")
  {
    nvme_model<Bf16Mixed> m;
    OffloadedOptimizer<Adam, Bf16Mixed> b({}, {.chunk_elements = 2048});
    register_model(b, m);
    expect_refusal(b, "rule 'adamw', and this optimizer has 'adam'");
  }
  SECTION("another precision")
  {
    trainer<HostOpt<Fp32>> b(options_with<HostOpt<Fp32>>(2048));
    expect_refusal(b.opt, "precision bf16/bf16/fp32/fp32, and this optimizer has fp32/fp32/fp32/fp32");
  }
  SECTION("another chunk size")
  {
    trainer<HostOpt<Bf16Mixed>> b(options_with<HostOpt<Bf16Mixed>>(4096));
    expect_refusal(b.opt, "chunk_elements 2048, and this optimizer has 4096");
  }
  SECTION("other tensors")
  {
    std::vector<bf16> w(100);
    HostOpt<Bf16Mixed> b({}, {.chunk_elements = 2048});
    b.add_tensor("w", w.data(), w.size());
    expect_refusal(b, "tensor count 7, and this optimizer has 1", "w");
  }
}

TEST_CASE("an optimizer left at the default chunk takes a checkpoint's chunk when it loads before its state is made",
          "[checkpoint]")
{
  using Opt = HostOpt<Bf16Mixed8bit>;
  scratch_dir d;
  auto const ckpt = d.path / "c";
  trainer<Opt> a(options_with<Opt>(2048));  // as a file saved with another (or an older) default
  a.steps(1, 3);
  a.opt.save(ckpt);
  a.steps(4, 6);
  SECTION("fresh: it loads and steps on as the saver did")
  {
    trainer<Opt> b(typename Opt::options{});
    b.opt.load(ckpt);
    CHECK(b.opt.state_layout().chunk_elements() == 2048);
    b.steps(4, 6);
    for (std::size_t t = 0; t < a.m.params.size(); ++t) {
      CHECK(std::memcmp(a.m.params[t].data(), b.m.params[t].data(), a.m.params[t].size() * sizeof(bf16)) == 0);
      std::string const name = tensor_name(t);
      std::vector<float> x(a.m.params[t].size()), y(x.size());
      for (slot const s : {slot::exp_avg, slot::exp_avg_sq}) {
        a.opt.copy_state(name, s, x);
        b.opt.copy_state(name, s, y);
        CHECK(x == y);
      }
    }
  }
  SECTION("a refused load takes nothing: the next step makes the default chunk")
  {
    auto const bytes = file_bytes(ckpt);
    flip_bit(ckpt, bytes.size() / 2, 3);
    trainer<Opt> b(typename Opt::options{});
    CHECK_THROWS_AS(b.opt.load(ckpt), checkpoint_error);
    b.steps(1, 1);
    CHECK(b.opt.state_layout().chunk_count() == 1);
  }
  SECTION("lost in its loading pass at the file's chunk, it later loads a file of another chunk")
  {
    auto const bytes = file_bytes(ckpt);
    trainer<Opt> b(typename Opt::options{});
    std::set<std::uint64_t> seen;
    auto const failing = [&](std::uint64_t offset, std::span<std::byte> to) {
      // The loading pass reads the chunks a second time: the first of them fails.
      if (offset != 0 && !seen.insert(offset).second) { throw std::runtime_error("a read failed"); }
      std::memcpy(to.data(), bytes.data() + offset, to.size());
    };
    CHECK_THROWS_WITH(b.opt.load_from(bytes.size(), failing), Catch::Contains("a read failed"));
    REQUIRE(b.opt.state_lost());
    trainer<Opt> c(typename Opt::options{});  // saved at the default chunk: one, here
    c.steps(1, 2);
    auto const other = d.path / "other";
    c.opt.save(other);
    b.opt.load(other);
    CHECK_FALSE(b.opt.state_lost());
    CHECK(b.opt.state_layout().chunk_count() == 1);
    b.steps(3, 3);
    c.steps(3, 3);
    for (std::size_t t = 0; t < c.m.params.size(); ++t) {
      CHECK(std::memcmp(b.m.params[t].data(), c.m.params[t].data(), c.m.params[t].size() * sizeof(bf16)) == 0);
    }
  }
  SECTION("with its state made at another chunk, the load is refused and names both")
  {
    trainer<Opt> b(typename Opt::options{});
    b.steps(1, 1);
    std::size_t const mine = b.opt.state_layout().chunk_elements();
    CHECK_THROWS_WITH(b.opt.load(ckpt), Catch::Contains("chunk_elements 2048, and this optimizer has " +
                                                        std::to_string(mine)));
  }
}

TEST_CASE("a corrupt or truncated checkpoint is an error naming the damage, and changes nothing", "[checkpoint][errors]")
{
  scratch_dir d;
  auto const ckpt = d.path / "c";
  trainer<NvmeOpt<Bf16Mixed>> a(options_with<NvmeOpt<Bf16Mixed>>(2048, &d));
  a.steps(1, 3);
  a.opt.save(ckpt);
  auto const size = std::filesystem::file_size(ckpt);
  std::uint64_t const chunk_bytes = a.opt.state_layout().chunk_bytes();
  auto const good = snapshot(a.opt, a.m);

  std::string words;
  SECTION("a flipped bit in chunk 5")
  {
    flip_bit(ckpt, 4096 + 5 * chunk_bytes + 777, 3);
    words = "chunk 5 of 21";
  }
  SECTION("a flipped bit in the last chunk")
  {
    flip_bit(ckpt, 4096 + 21 * chunk_bytes - 1, 0);
    words = "chunk 20 of 21";
  }
  SECTION("a flipped bit in the header")
  {
    flip_bit(ckpt, 40, 1);
    words = "header's checksum";
  }
  SECTION("a flipped bit in the table")
  {
    flip_bit(ckpt, size - 4096 + 20, 6);
    words = "table's checksum";
  }
  SECTION("truncated")
  {
    std::filesystem::resize_file(ckpt, size - 4096);
    words = "truncated";
  }
  SECTION("not a checkpoint")
  {
    std::ofstream(ckpt, std::ios::trunc) << std::string(10000, 'x');
    words = "not a tierstate checkpoint";
  }
  SECTION("empty")
  {
    std::ofstream(ckpt, std::ios::trunc);
    words = "shorter than a header";
  }
  REQUIRE(a.opt.state_layout().chunk_count() == 21);
  try {
    a.opt.load(ckpt);
    FAIL("a damaged checkpoint loaded");
  } catch (checkpoint_error const& e) {
    CHECK_THAT(e.what(), Catch::Contains(words) && Catch::Contains(ckpt.string()));
    CHECK(e.path() == ckpt.string());
  }
  CHECK_FALSE(a.opt.state_lost());
  CHECK(snapshot(a.opt, a.m) == good);
}

TEST_CASE("a failed save leaves the previous checkpoint whole, at every I/O position", "[checkpoint][faults]")
{
  scratch_dir d;
  auto const ckpt = d.path / "c";
  trainer<HostOpt<Bf16Mixed>> a(options_with<HostOpt<Bf16Mixed>>(2048));
  a.steps(1, 2);
  a.opt.save(ckpt);
  auto const saved_at_2 = file_bytes(ckpt);
  a.steps(3, 4);

  // How many write pieces a save has, with small blocks so there are several per chunk.
  checkpoint_options o;
  o.io.emplace();
  o.io->block_size = 8192;
  o.io->faults     = std::make_shared<io::fault_plan>();
  a.opt.save(d.path / "probe", o);
  std::uint64_t const writes = o.io->faults->seen(io::op::write);
  auto const clean           = file_bytes(d.path / "probe");
  std::filesystem::remove(d.path / "probe");
  REQUIRE(writes > 20);

  std::size_t cases = 0;
  for (std::uint64_t k = 1; k <= writes; ++k) {
    for (int const err : {EIO, ENOSPC, 0}) {
      auto plan = std::make_shared<io::fault_plan>();
      if (err == 0) {
        plan->shorten(io::op::write, k, 4096);  // a short write: requeued, the save succeeds
      } else {
        plan->fail(io::op::write, k, err);
      }
      o.io->faults = plan;
      INFO("write piece " << k << ", errno " << err);
      if (err == 0) {
        a.opt.save(d.path / "short", o);
        CHECK(file_bytes(d.path / "short") == clean);  // the same bytes as a save without faults
        std::filesystem::remove(d.path / "short");
      } else {
        try {
          a.opt.save(ckpt, o);
          FAIL("the planted fault did not surface");
        } catch (io_error const& e) {
          CHECK(e.code().value() == err);
          CHECK(e.operation() == "write");
          CHECK_THAT(e.what(), Catch::Contains(d.path.string()));
        }
        CHECK(file_bytes(ckpt) == saved_at_2);  // the previous checkpoint, untouched
      }
      CHECK(d.entries() == std::vector<std::string>{"c"});  // no temporary file left
      ++cases;
    }
  }
  // And the checkpoint at step 2 still loads and resumes exactly.
  trainer<HostOpt<Bf16Mixed>> b(options_with<HostOpt<Bf16Mixed>>(2048));
  b.opt.load(ckpt);
  b.steps(3, 4);
  CHECK(snapshot(b.opt, b.m) == snapshot(a.opt, a.m));
  WARN("save fault cases tried: " << cases);
}

TEST_CASE("a load survives short reads anywhere; a failed read changes nothing until the loading pass", "[checkpoint][faults]")
{
  scratch_dir d;
  auto const ckpt = d.path / "c";
  trainer<HostOpt<Bf16Mixed>> a(options_with<HostOpt<Bf16Mixed>>(2048));
  a.steps(1, 2);
  a.opt.save(ckpt);
  a.steps(3, 4);
  auto const now = snapshot(a.opt, a.m);

  checkpoint_options o;
  o.io.emplace();
  o.io->block_size = 8192;
  o.io->faults     = std::make_shared<io::fault_plan>();
  trainer<HostOpt<Bf16Mixed>> probe(options_with<HostOpt<Bf16Mixed>>(2048));
  probe.opt.load(ckpt, o);
  std::uint64_t const reads = o.io->faults->seen(io::op::read);
  // The header (one block), the table (one block), then the checking pass over the chunks.
  std::uint64_t const chunk_pieces = (probe.opt.state_layout().chunk_bytes() + 8191) / 8192;
  std::uint64_t const checking     = 2 + probe.opt.state_layout().chunk_count() * chunk_pieces;
  REQUIRE(reads == checking + probe.opt.state_layout().chunk_count() * chunk_pieces);
  std::size_t cases = 0;
  // A short read at any position is requeued: the load succeeds and is exact.
  for (std::uint64_t k = 1; k <= reads; ++k) {
    auto plan = std::make_shared<io::fault_plan>();
    plan->shorten(io::op::read, k, 4096);
    o.io->faults = plan;
    trainer<HostOpt<Bf16Mixed>> b(options_with<HostOpt<Bf16Mixed>>(2048));
    b.opt.load(ckpt, o);
    b.steps(3, 4);
    INFO("short read at piece " << k);
    CHECK(snapshot(b.opt, b.m) == now);
    ++cases;
  }
  for (std::uint64_t k = 1; k <= 2 * reads; ++k) {
    int const err      = k <= reads ? EIO : ENOSPC;  // ENOSPC cannot come from a read; the loader must not care
    std::uint64_t const at = k <= reads ? k : k - reads;
    auto plan = std::make_shared<io::fault_plan>();
    plan->fail(io::op::read, at, err);
    o.io->faults = plan;
    INFO("read piece " << at << " of " << reads << ", errno " << err);
    CHECK_THROWS_MATCHES(a.opt.load(ckpt, o), io_error,
                         Catch::Predicate<io_error>([&](io_error const& e) {
                           return e.code().value() == err && e.path() == ckpt.string() && e.operation() == "read";
                         }, "an io_error naming the checkpoint, the read and the errno"));
    if (at <= checking) {
      CHECK_FALSE(a.opt.state_lost());
      CHECK(snapshot(a.opt, a.m) == now);
    } else {
      // The loading pass failed part-way: the optimizer says so rather than go on.
      CHECK(a.opt.state_lost());
      std::vector<float> buf(1);
      CHECK_THROWS_AS(a.opt.copy_state("t0", slot::exp_avg, buf), state_lost);
      a.opt.load(ckpt);  // and a good load restores it
      CHECK_FALSE(a.opt.state_lost());
      a.steps(3, 4);
      CHECK(snapshot(a.opt, a.m) == now);
    }
    ++cases;
  }
  WARN("load fault cases tried: " << cases);
}

TEST_CASE("a save writes everything, fsyncs the file, renames it, then fsyncs the directory", "[checkpoint]")
{
  scratch_dir d;
  trainer<NvmeOpt<Bf16Mixed>> a(options_with<NvmeOpt<Bf16Mixed>>(2048, &d));
  a.steps(1, 2);
  std::vector<std::pair<save_event, std::uint64_t>> seen;
  std::vector<std::string> present;  // what the directory holds at each event
  checkpoint_options o;
  o.observer = [&](save_event e, std::uint64_t offset, std::uint64_t) {
    seen.push_back({e, offset});
    std::string names;
    for (auto const& n : d.entries()) {
      if (!names.empty()) { names.push_back(','); }
      names.append(n, 0, 2);
    }
    present.push_back(names);
  };
  a.opt.save(d.path / "c", o);
  std::size_t const chunks = a.opt.state_layout().chunk_count();
  REQUIRE(seen.size() == chunks + 7);  // create, header, chunks, table, fsync, rename, fsync, done
  CHECK(seen.front().first == save_event::create);
  for (std::size_t i = 1; i <= chunks + 2; ++i) { CHECK(seen[i].first == save_event::write); }
  CHECK(seen[1].second == 0);  // the header first; the table last
  CHECK(seen[chunks + 2].second == 4096 + chunks * a.opt.state_layout().chunk_bytes());
  CHECK(seen[chunks + 3].first == save_event::fsync_file);
  CHECK(seen[chunks + 4].first == save_event::rename);
  CHECK(seen[chunks + 5].first == save_event::fsync_directory);
  CHECK(seen[chunks + 6].first == save_event::done);
  // Until the rename the file is nameless (O_TMPFILE), so the directory is empty (where the
  // filesystem lacks O_TMPFILE, only the temporary ".c.tmp-..." is there); from then on only "c".
  for (std::size_t i = 0; i <= chunks + 4; ++i) {
    INFO("event " << i);
    CHECK((present[i].empty() || present[i] == ".c"));
  }
  CHECK(present[chunks + 4].empty());  // /tmp has O_TMPFILE on every filesystem CI uses
  CHECK(present[chunks + 5] == "c");
}

TEST_CASE("save_to and load_from: the bytes of save, through a caller's writer and reader, with load's checks",
          "[checkpoint]")
{
  scratch_dir d;
  using Opt = NvmeOpt<Bf16Mixed>;
  trainer<Opt> a(options_with<Opt>(2048, &d));
  a.steps(1, 4);
  a.opt.save(d.path / "c");
  std::vector<std::byte> bytes;
  std::size_t pieces = 0;
  a.opt.save_to([&](std::span<std::byte const> piece) {
    bytes.insert(bytes.end(), piece.begin(), piece.end());
    ++pieces;
  });
  auto const on_disk = file_bytes(d.path / "c");
  REQUIRE(bytes.size() == on_disk.size());
  CHECK(std::memcmp(bytes.data(), on_disk.data(), bytes.size()) == 0);
  CHECK(pieces > 2);  // streamed: header, chunks, table; never the whole state at once

  auto reader = [&](std::vector<std::byte> const& from) {
    return [&from](std::uint64_t offset, std::span<std::byte> to) {
      std::memcpy(to.data(), from.data() + offset, to.size());
    };
  };
  trainer<HostOpt<Bf16Mixed>> b(options_with<HostOpt<Bf16Mixed>>(2048));
  b.opt.load_from(bytes.size(), reader(bytes));
  CHECK(snapshot(b.opt, b.m) == snapshot(a.opt, a.m));
  a.steps(5, 7);
  b.steps(5, 7);
  CHECK(snapshot(b.opt, b.m) == snapshot(a.opt, a.m));

  // Damage is refused before anything changes, named as load names it.
  trainer<HostOpt<Bf16Mixed>> c(options_with<HostOpt<Bf16Mixed>>(2048));
  auto const fresh = snapshot(c.opt, c.m);
  auto damaged     = bytes;
  damaged[damaged.size() / 2] ^= std::byte{0x10};
  CHECK_THROWS_WITH(c.opt.load_from(damaged.size(), reader(damaged)),
                    Catch::Contains("(load_from)") && Catch::Contains("does not match its checksum"));
  CHECK_THROWS_WITH(c.opt.load_from(bytes.size() - 4096, reader(bytes)), Catch::Contains("(truncated or extended)"));
  CHECK(snapshot(c.opt, c.m) == fresh);
  // A writer that fails leaves the optimizer as it was.
  CHECK_THROWS_WITH(c.opt.save_to([](std::span<std::byte const>) { throw std::runtime_error("the sink is full"); }),
                    Catch::Contains("the sink is full"));
  CHECK(snapshot(c.opt, c.m) == fresh);
}
