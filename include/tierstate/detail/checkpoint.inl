// SPDX-License-Identifier: Apache-2.0
// OffloadedOptimizer::save and load (the format: checkpoint/format.hpp).
#pragma once

#include <atomic>
#include <cerrno>
#include <climits>
#include <csignal>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace tierstate::inline TIERSTATE_ABI {
namespace detail {

/// A file descriptor closed on scope exit.
struct unique_fd {
  int fd = -1;
  unique_fd() = default;
  explicit unique_fd(int f) : fd(f) {}
  unique_fd(unique_fd const&)            = delete;
  unique_fd& operator=(unique_fd const&) = delete;
  ~unique_fd() { reset(); }
  void reset() noexcept
  {
    if (fd >= 0) { ::close(std::exchange(fd, -1)); }
  }
};

/// Turns O_DIRECT on where the filesystem takes it; returns whether it did.
inline bool try_direct(int fd) noexcept
{
  int const flags = ::fcntl(fd, F_GETFL);
  return flags >= 0 && ::fcntl(fd, F_SETFL, flags | O_DIRECT) == 0;
}

/// Page-aligned bytes for O_DIRECT (PinnedHost: pinned too, under CUDA).
inline PinnedHost aligned_copy(std::vector<std::byte> const& bytes)
{
  PinnedHost buf(bytes.size());
  std::memcpy(buf.data(), bytes.data(), bytes.size());
  return buf;
}

/// `text` quoted, cut to at most `max` bytes: a string read from a file is never echoed whole.
inline std::string clipped(std::string const& text, std::size_t max = 96)
{
  if (text.size() <= max) { return text; }
  return text.substr(0, max) + "... (" + std::to_string(text.size()) + " bytes)";
}
inline std::string quoted(std::string const& text, std::size_t max = 96)
{
  if (text.size() <= max) { return "'" + text + "'"; }
  return "'" + text.substr(0, max) + "...' (" + std::to_string(text.size()) + " bytes)";
}

/// What kind of file `mode` is, for messages.
inline char const* file_kind(mode_t mode) noexcept
{
  if (S_ISDIR(mode)) { return "a directory"; }
  if (S_ISFIFO(mode)) { return "a FIFO"; }
  if (S_ISSOCK(mode)) { return "a socket"; }
  if (S_ISCHR(mode)) { return "a character device"; }
  if (S_ISBLK(mode)) { return "a block device"; }
  if (S_ISLNK(mode)) { return "a symbolic link"; }
  return "not a regular file";
}

/// Eight hex digits of a 64-bit hash.
inline std::string hex8(std::uint64_t h)
{
  static constexpr char digits[] = "0123456789abcdef";
  std::string out(8, '0');
  for (int i = 7; i >= 0; --i, h >>= 4) { out[static_cast<std::size_t>(i)] = digits[h & 15]; }
  return out;
}

/// Names a save's temporary for the checkpoint `name`, and recognizes those of dead
/// processes. The temporary exists under a name only for the instant between linking the
/// finished, nameless (O_TMPFILE) file and renaming it over `name`; where the filesystem has
/// no O_TMPFILE, for the whole save. Its name is ".<stem>.tmp-<host>-<pid>-<n>": <stem> is
/// `name`, or, where that would not fit the directory's name limit, a prefix of it and a hash
/// of the whole; <host> is a hash of the host name, so a process on another machine sharing
/// the directory is never taken for a dead one here.
class temp_names {
 public:
  temp_names(std::string const& name, long name_max)
  {
    char host[256] = {};
    (void)::gethostname(host, sizeof(host) - 1);
    host_ = hex8(checkpoint::checksum(host, std::strlen(host)));
    // ".", ".tmp-", the host, two "-", a pid (at most 10 digits) and a count (at most 20).
    std::size_t const fixed = 1 + 5 + 8 + 2 + 10 + 20;
    std::size_t const limit = name_max > 0 ? static_cast<std::size_t>(name_max) : 255;
    stem_ = name;
    if (stem_.size() + fixed > limit) {
      std::size_t const keep = limit > fixed + 9 ? limit - fixed - 9 : 0;
      stem_ = name.substr(0, keep) + "~" + hex8(checkpoint::checksum(name.data(), name.size()));
    }
    prefix_ = "." + stem_ + ".tmp-" + host_ + "-";
  }
  [[nodiscard]] std::string make(std::uint64_t n) const
  {
    return prefix_ + std::to_string(::getpid()) + "-" + std::to_string(n);
  }
  /// Whether `entry` is a temporary of this checkpoint left by a process of this host that
  /// is no longer running.
  [[nodiscard]] bool stale(std::string_view entry) const
  {
    if (entry.substr(0, prefix_.size()) != prefix_) { return false; }
    std::string_view rest = entry.substr(prefix_.size());
    auto const dash       = rest.find('-');
    if (dash == std::string_view::npos || dash == 0 || dash > 10) { return false; }
    long long pid = 0;
    for (char const c : rest.substr(0, dash)) {
      if (c < '0' || c > '9') { return false; }
      pid = pid * 10 + (c - '0');
    }
    for (char const c : rest.substr(dash + 1)) {
      if (c < '0' || c > '9') { return false; }
    }
    if (pid <= 0 || pid > INT_MAX || pid == ::getpid()) { return false; }
    return ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
  }

 private:
  std::string host_, stem_, prefix_;
};

/// Removes, from the directory `dirfd`, the temporaries of `names` that dead processes left
/// (regular files only, never through a symlink: unlinkat removes the entry itself).
inline void remove_stale_temporaries(int dirfd, temp_names const& names) noexcept
{
  int const copy = ::fcntl(dirfd, F_DUPFD_CLOEXEC, 0);
  if (copy < 0) { return; }
  DIR* d = ::fdopendir(copy);
  if (d == nullptr) {
    ::close(copy);
    return;
  }
  std::vector<std::string> stale;
  while (dirent const* e = ::readdir(d)) {
    if (names.stale(e->d_name)) { stale.emplace_back(e->d_name); }
  }
  ::closedir(d);
  for (auto const& n : stale) {
    struct stat st{};
    if (::fstatat(dirfd, n.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode) &&
        st.st_uid == ::geteuid()) {
      ::unlinkat(dirfd, n.c_str(), 0);
    }
  }
}

}  // namespace detail

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
checkpoint::header OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::make_header() const
{
  return make_header(*layout_);
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
checkpoint::header OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::make_header(
    layout const& lay) const
{
  checkpoint::header h;
  h.rule           = std::string(Rule::name);
  h.precision      = Precision::name();
  h.step           = step_;
  h.chunk_elements = lay.chunk_elements();
  h.chunk_bytes    = lay.chunk_bytes();
  h.chunk_count    = lay.chunk_count();
  h.total_elements = lay.total_elements();
  for (std::size_t i = 0; i < lay.slots().size(); ++i) {
    h.slots.push_back({static_cast<std::uint32_t>(lay.slots()[i]),
                       static_cast<std::uint32_t>(lay.slot_element_bytes(i))});
  }
  for (std::size_t t = 0; t < tensors_.size(); ++t) {
    h.tensors.push_back({tensors_[t].name, lay.tensors()[t].offset, tensors_[t].count, tensors_[t].group});
  }
  h.values_per_group = static_cast<std::uint32_t>(Rule::hyperparameter_count);
  for (auto const& g : groups_) {
    auto const v = Rule::to_values(g);
    h.groups.emplace_back(v.begin(), v.end());
  }
  return h;
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::check_header(
    checkpoint::header const& h, layout const& lay, std::string const& path) const
{
  using detail::quoted;
  auto differ = [&](std::string const& what, std::string const& there, std::string const& here) {
    throw checkpoint_error(path, "was saved with " + what + " " + there + ", and this optimizer has " + here);
  };
  if (h.rule != Rule::name) { differ("rule", quoted(h.rule), quoted(std::string(Rule::name))); }
  if (h.precision != Precision::name()) { differ("precision", detail::clipped(h.precision), Precision::name()); }
  auto const mine = make_header(lay);
  if (h.slots.size() != mine.slots.size()) {
    differ("slot count", std::to_string(h.slots.size()), std::to_string(mine.slots.size()));
  }
  for (std::size_t i = 0; i < h.slots.size(); ++i) {
    if (h.slots[i].id != mine.slots[i].id || h.slots[i].element_bytes != mine.slots[i].element_bytes) {
      differ("slot " + std::to_string(i), "(id " + std::to_string(h.slots[i].id) + ", " +
               std::to_string(h.slots[i].element_bytes) + " bytes)",
             "(id " + std::to_string(mine.slots[i].id) + ", " + std::to_string(mine.slots[i].element_bytes) + " bytes)");
    }
  }
  if (h.tensors.size() != mine.tensors.size()) {
    differ("tensor count", std::to_string(h.tensors.size()), std::to_string(mine.tensors.size()));
  }
  for (std::size_t t = 0; t < h.tensors.size(); ++t) {
    auto const& a = h.tensors[t];
    auto const& b = mine.tensors[t];
    if (a.name != b.name || a.count != b.count || a.offset != b.offset) {
      differ("tensor " + std::to_string(t), quoted(a.name) + " of " + std::to_string(a.count) + " elements",
             quoted(b.name) + " of " + std::to_string(b.count) + " elements");
    }
  }
  if (h.chunk_elements != mine.chunk_elements) {
    differ("chunk_elements", std::to_string(h.chunk_elements), std::to_string(mine.chunk_elements));
  }
  if (h.chunk_bytes != mine.chunk_bytes || h.chunk_count != mine.chunk_count ||
      h.total_elements != mine.total_elements) {
    differ("a layout of", std::to_string(h.chunk_count) + " chunks of " + std::to_string(h.chunk_bytes) + " bytes",
           std::to_string(mine.chunk_count) + " chunks of " + std::to_string(mine.chunk_bytes) + " bytes");
  }
  if (h.step < 0) { throw checkpoint_error(path, "step count " + std::to_string(h.step) + " is negative (corrupt)"); }
  if (h.values_per_group != Rule::hyperparameter_count || h.groups.empty()) {
    throw checkpoint_error(path, std::to_string(h.groups.size()) + " groups of " + std::to_string(h.values_per_group) +
                                   " hyper-parameters; " + std::string(Rule::name) + " has " +
                                   std::to_string(Rule::hyperparameter_count) + " (corrupt)");
  }
  for (std::size_t t = 0; t < h.tensors.size(); ++t) {
    if (h.tensors[t].group >= h.groups.size()) {
      throw checkpoint_error(path, "tensor " + quoted(h.tensors[t].name) + " is in group " +
                                     std::to_string(h.tensors[t].group) + " of " + std::to_string(h.groups.size()) +
                                     " (corrupt)");
    }
  }
  for (std::size_t g = 0; g < h.groups.size(); ++g) {
    try {
      (void)Rule::from_values(h.groups[g]);
    } catch (invalid_option const& e) {
      throw checkpoint_error(path, "group " + std::to_string(g) + ": " + e.what());
    }
  }
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
io::engine_options OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::checkpoint_io(
    checkpoint_options const& o) const
{
  io::engine_options eo;
  if (o.io) {
    eo = *o.io;
  } else if constexpr (requires { { opts_.tier.io } -> std::convertible_to<io::engine_options const&>; }) {
    eo        = opts_.tier.io;  // the tier's engine choice (its backend above all) carries over
    eo.faults = nullptr;        // a fault plan planted for the tier is the tier's
  }
  try {
    eo.validate();
  } catch (invalid_option const& e) {
    throw invalid_option("checkpoint_options::io", o.io ? "(given)" : "(the tier's options.io)", e.what());
  }
  return eo;
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
io::engine OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::checkpoint_engine(
    io::engine_options const& eo, checkpoint_options const& o,
                                                  std::string const& path) const
{
  try {
    return io::engine(eo);
  } catch (io_error const& e) {
    throw io_error(e.code().value(), path, "start the checkpoint's I/O engine", 0, 0,
                   std::string(e.what()) + "; the checkpoint's engine is checkpoint_options::io" +
                     (o.io ? "" : ", which by default follows the state tier's (options.tier.io)") +
                     ": set its .backend = io::backend::psync where io_uring is forbidden");
  }
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::params_from_master(std::size_t k,
    std::byte const* chunk)
{
  if constexpr (Precision::has_master) {
    auto const* master = reinterpret_cast<float const*>(chunk + layout_->slot_offset(0));
    std::vector<param_type> staged;  // for params on the device
    for (std::size_t p = chunk_pieces_[k]; p < chunk_pieces_[k + 1]; ++p) {
      auto const& pc  = pieces_[p];
      auto const& t   = tensors_[pc.tensor];
      param_type* dst = t.param + pc.tensor_begin;
      if (t.where == location::device) {
        staged.resize(pc.count);
        dst = staged.data();
      }
      for (std::size_t i = 0; i < pc.count; ++i) { dst[i] = convert<param_type>(master[pc.chunk_begin + i]); }
      if (t.where == location::device) {
        device::copy(t.param + pc.tensor_begin, staged.data(), pc.count * sizeof(param_type));
      }
    }
  }
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::save(
    std::filesystem::path const& path, checkpoint_options const& o)
{
  detail::gate_entry const gate(gate_, "save");
  check_not_streaming("save");
  flush();
  check_not_lost("save");
  io::engine_options const eo = checkpoint_io(o);
  if (tensors_.empty()) { throw logic_error("save: no tensor is registered: add_tensor first"); }
  std::string const target = path.string();
  std::filesystem::path const dir = path.has_parent_path() ? path.parent_path() : std::filesystem::path(".");
  std::string const name = path.filename().string();
  if (name.empty() || name == "." || name == "..") {
    throw logic_error("save: '" + target + "' names no file");
  }
  detail::unique_fd dirfd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dirfd.fd < 0) { throw io_error(errno, dir.string(), "open", 0, 0, "the directory of the checkpoint"); }
  // The target is replaced by rename: anything there but a regular file is refused, so that
  // a save never replaces a directory, a device, a FIFO or a symlink (rather than its target).
  {
    struct stat st{};
    if (::fstatat(dirfd.fd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && !S_ISREG(st.st_mode)) {
      throw logic_error("save: '" + target + "' is " + detail::file_kind(st.st_mode) +
                        "; save replaces a regular file (a symlink: save to the path it points to)");
    }
  }
  long const name_max = ::fpathconf(dirfd.fd, _PC_NAME_MAX);
  if (name_max > 0 && name.size() > static_cast<std::size_t>(name_max)) {
    throw io_error(ENAMETOOLONG, target, "save", 0, 0,
                   "the file name is " + std::to_string(name.size()) + " bytes; this directory allows " +
                     std::to_string(name_max));
  }
  detail::temp_names const names(name, name_max);
  detail::remove_stale_temporaries(dirfd.fd, names);
  static std::atomic<std::uint64_t> saves{0};
  std::string const temp      = names.make(saves++);
  std::string const temp_path = (dir / temp).string();

  auto observe = [&](save_event e, std::uint64_t offset = 0, std::uint64_t length = 0) {
    if (o.observer) { o.observer(e, offset, length); }
  };
  observe(save_event::create);
  // Nameless until it is complete: a crash leaves nothing. Where the filesystem has no
  // O_TMPFILE, created under the temporary's name.
  bool named = false;  // whether `temp` names the file now
  detail::unique_fd fd(::openat(dirfd.fd, ".", O_TMPFILE | O_WRONLY | O_CLOEXEC, 0600));
  if (fd.fd < 0) {
    if (errno != EOPNOTSUPP && errno != EISDIR && errno != EINVAL) {
      throw io_error(errno, dir.string(), "open(O_TMPFILE)", 0, 0, "the checkpoint's temporary file");
    }
    fd.fd = ::openat(dirfd.fd, temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd.fd < 0) { throw io_error(errno, temp_path, "create", 0, 0, "the checkpoint's temporary file"); }
    named = true;
  }
  bool const fresh = !layout_;  // a failed save on an optimizer without state leaves it without
  PinnedHost header{0}, table{0};
  try {
    materialize();
    detail::try_direct(fd.fd);
    io::engine engine = checkpoint_engine(eo, o, target);
    auto write = [&](std::uint64_t offset, std::byte const* data, std::size_t n) {
      observe(save_event::write, offset, n);
      io::request const r{fd.fd, offset, const_cast<std::byte*>(data), n, true, &temp_path};
      try {
        engine.submit({&r, 1});
      } catch (...) {
        // A write the kernel may still read from: its memory is kept, never freed or reused.
        if (!engine.usable()) {
          header.abandon();
          table.abandon();
        }
        throw;
      }
    };
    header = detail::aligned_copy(checkpoint::encode(make_header()));
    write(0, header.data(), header.size());

    std::uint64_t const H = header.size();
    std::size_t const B   = layout_->chunk_bytes();
    std::vector<std::uint64_t> sums(layout_->chunk_count());
    for (std::size_t k = 0; k < layout_->chunk_count(); ++k) {
      std::byte* chunk;
      if constexpr (addressable_tier<StateTier>) {
        chunk = tier_->data() + k * B;
      } else {
        chunk = staging(0);
        tier_->read(k * B, std::span<std::byte>(chunk, B));
      }
      sums[k] = checkpoint::checksum(chunk, B);
      write(H + k * B, chunk, B);
    }
    table = detail::aligned_copy(checkpoint::encode_table(sums));
    write(H + sums.size() * B, table.data(), table.size());
    observe(save_event::fsync_file);
    if (::fsync(fd.fd) != 0) { throw io_error(errno, temp_path, "fsync", 0, 0, "the checkpoint's temporary file"); }
    observe(save_event::rename);
    if (!named) {
      // Linked through /proc (no capability needed), else by AT_EMPTY_PATH (which needs
      // CAP_DAC_READ_SEARCH): the name exists only until the rename below.
      std::string const self = "/proc/self/fd/" + std::to_string(fd.fd);
      int r = ::linkat(AT_FDCWD, self.c_str(), dirfd.fd, temp.c_str(), AT_SYMLINK_FOLLOW);
      if (r != 0 && errno == ENOENT) { r = ::linkat(fd.fd, "", dirfd.fd, temp.c_str(), AT_EMPTY_PATH); }
      if (r != 0) { throw io_error(errno, temp_path, "linkat", 0, 0, "naming the finished checkpoint before its rename"); }
      named = true;
    }
    fd.reset();
    if (::renameat(dirfd.fd, temp.c_str(), dirfd.fd, name.c_str()) != 0) {
      throw io_error(errno, temp_path, "rename", 0, 0, "onto " + target);
    }
    named = false;
  } catch (...) {
    fd.reset();
    if (named) { ::unlinkat(dirfd.fd, temp.c_str(), 0); }  // nothing half-written is left, under any name
    if (fresh) { discard_state(); }
    throw;
  }
  // The rename is durable once the directory is.
  observe(save_event::fsync_directory);
  if (::fsync(dirfd.fd) != 0) { throw io_error(errno, dir.string(), "fsync", 0, 0, "the checkpoint's directory"); }
  observe(save_event::done);
}

template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::load(
    std::filesystem::path const& path, checkpoint_options const& o)
{
  detail::gate_entry const gate(gate_, "load");
  check_not_streaming("load");
  // A delayed update in flight is finished first. If it failed, what is loaded replaces
  // it; if the load is refused, its failure stands (the state is lost).
  try {
    flush();
  } catch (std::exception const& e) {
    if (lost_.empty()) { lost_ = std::string("the delayed update failed: ") + e.what(); }
  } catch (...) {
    if (lost_.empty()) { lost_ = "the delayed update failed"; }
  }
  io::engine_options const eo = checkpoint_io(o);
  if (tensors_.empty()) { throw logic_error("load: no tensor is registered: add_tensor first"); }
  std::string const file = path.string();
  // Never blocks in open (a FIFO without a writer); anything but a regular file is refused.
  detail::unique_fd fd(::open(file.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC));
  if (fd.fd < 0) { throw io_error(errno, file, "open", 0, 0, "the checkpoint"); }
  struct stat st{};
  if (::fstat(fd.fd, &st) != 0) { throw io_error(errno, file, "fstat"); }
  if (!S_ISREG(st.st_mode)) {
    throw checkpoint_error(file, std::string("is ") + detail::file_kind(st.st_mode) + ", not a regular file");
  }
  if (int const fl = ::fcntl(fd.fd, F_GETFL); fl >= 0) { (void)::fcntl(fd.fd, F_SETFL, fl & ~O_NONBLOCK); }
  detail::try_direct(fd.fd);
  auto const file_bytes = static_cast<std::uint64_t>(st.st_size);
  if (file_bytes < checkpoint::block) {
    throw checkpoint_error(file, "is " + std::to_string(file_bytes) + " bytes, shorter than a header (truncated)");
  }
  // Everything is checked against the layout this optimizer has, or would make: nothing is
  // made before the file is known to be good.
  std::optional<layout> planned;
  if (!layout_) { planned.emplace(make_layout()); }
  layout const& lay = layout_ ? *layout_ : *planned;
  io::engine engine = checkpoint_engine(eo, o, file);
  // Load's buffers; kept (leaked), never freed, if a read the kernel never answered may
  // still land in them.
  PinnedHost first{0}, region{0}, table{0}, scratch{0};
  auto read = [&](std::uint64_t offset, std::byte* data, std::size_t n) {
    io::request const r{fd.fd, offset, data, n, false, &file};
    try {
      engine.submit({&r, 1});
    } catch (...) {
      if (!engine.usable()) {
        for (PinnedHost* b : {&first, &region, &table, &scratch}) { b->abandon(); }
      }
      throw;
    }
  };

  // The header: its first block, then the rest, bounded by what a header of this
  // optimizer's tensors can need (its own size, with a group per tensor), and never more
  // than 8 MiB for another's: a file's claim is never allocated before it is bounded.
  first = PinnedHost(checkpoint::block);
  read(0, first.data(), checkpoint::block);
  std::uint64_t const own_payload = checkpoint::encode(make_header(lay)).size();
  std::uint64_t const max_header  = std::max<std::uint64_t>(
    std::uint64_t{8} << 20,
    own_payload + (tensors_.size() + 1) * (8 * Rule::hyperparameter_count + 8) + checkpoint::block);
  std::uint64_t const H = checkpoint::header_bytes({first.data(), first.size()}, file_bytes, file, max_header);
  region = PinnedHost(H);
  std::memcpy(region.data(), first.data(), checkpoint::block);
  if (H > checkpoint::block) { read(checkpoint::block, region.data() + checkpoint::block, H - checkpoint::block); }
  checkpoint::header const h = checkpoint::decode({region.data(), region.size()}, file, o.verify_checksums);
  check_header(h, lay, file);

  // The file's size, now that its layout is known to be ours.
  std::size_t const B   = lay.chunk_bytes();
  std::size_t const C   = lay.chunk_count();
  std::uint64_t const T = checkpoint::table_bytes(C);
  if (file_bytes != H + C * B + T) {
    throw checkpoint_error(file, "is " + std::to_string(file_bytes) + " bytes; its header describes " +
                                   std::to_string(H + C * B + T) + " (truncated or extended)");
  }
  table = PinnedHost(T);
  read(H + C * B, table.data(), T);
  std::vector<std::uint64_t> const sums = checkpoint::decode_table({table.data(), table.size()}, C, file, o.verify_checksums);

  auto corrupt_chunk = [&](std::size_t k) {
    return checkpoint_error(file, "chunk " + std::to_string(k) + " of " + std::to_string(C) + " (bytes [" +
                                    std::to_string(H + k * B) + ", " + std::to_string(H + (k + 1) * B) +
                                    ") of the file) does not match its checksum (corrupt)");
  };
  scratch = PinnedHost(B);  // one chunk: what load needs beyond the header and the table
  // Pass 1: every chunk verified before anything changes.
  if (o.verify_checksums) {
    for (std::size_t k = 0; k < C; ++k) {
      read(H + k * B, scratch.data(), B);
      if (checkpoint::checksum(scratch.data(), B) != sums[k]) { throw corrupt_chunk(k); }
    }
  }
  // The file is good: the state is made (its master is not filled from the params: every
  // chunk is loaded below) and replaced. A failure from here on leaves it part loaded: lost.
  materialize(false);
  delayed_.reset();  // its param buffer is made afresh from the params load writes
  try {
    // Read into load's own buffer, then copied into the tier: a read that hangs never holds
    // the tier's memory, which a later load would then share with a late transfer.
    for (std::size_t k = 0; k < C; ++k) {
      std::byte* chunk = scratch.data();
      read(H + k * B, chunk, B);
      if (o.verify_checksums && checkpoint::checksum(chunk, B) != sums[k]) { throw corrupt_chunk(k); }
      tier_->write(k * B, std::span<std::byte const>(chunk, B));
      params_from_master(k, chunk);
    }
  } catch (std::exception const& e) {
    lost_ = e.what();
    throw;
  }
  step_ = h.step;
  groups_.clear();
  for (auto const& g : h.groups) { groups_.push_back(Rule::from_values(g)); }
  for (std::size_t t = 0; t < tensors_.size(); ++t) { tensors_[t].group = h.tensors[t].group; }
  lost_.clear();
}

}  // namespace tierstate
