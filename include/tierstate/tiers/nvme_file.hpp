// SPDX-License-Identifier: Apache-2.0
// NvmeFile: optimizer state in a scratch file on an NVMe drive, the ZeRO-Infinity placement.
//
// The state lives in one file inside a directory the user names (it may be reached through
// a symlink, like a /scratch mount). The file is
//   - private and nameless: by default made with O_TMPFILE (mode 0600, never in the
//     directory at all), or, where the filesystem lacks O_TMPFILE, created with mode 0600 and
//     O_CREAT | O_EXCL | O_NOFOLLOW and unlinked at once, so even a SIGKILL leaves nothing
//     behind and nothing in the directory is ever deleted or reused. A file or link already
//     there under the name the library would use is an error (`naming` chooses the path,
//     and `named` keeps the name until the tier is destroyed, for inspection);
//   - reserved to its full size with fallocate when the tier is made, so a full disk is an
//     error when the optimizer builds its state, not ten thousand steps later; if anything
//     in construction fails, the file is removed before the error leaves. On btrfs, a
//     copy-on-write filesystem, every overwrite would take new blocks and the reservation
//     would not hold: there the file is made NOCOW (FS_NOCOW_FL, `chattr +C`) while it is
//     still empty, so overwrites land in the reserved blocks (a snapshot of its subvolume
//     voids that: the next write of each block is copied once). Where btrfs refuses NOCOW,
//     and on ZFS and bcachefs (copy-on-write, no NOCOW here), it says so once (a notice);
//   - read and written with O_DIRECT (no page cache: host memory stays flat however large
//     the state) through the I/O engine of io/engine.hpp; where the filesystem refuses
//     O_DIRECT (tmpfs answers EINVAL) it falls back to buffered I/O and says so once per
//     directory (a notice, core/notice.hpp), unless `require_direct` makes that an error;
//   - removed when the tier is destroyed. It is scratch space, not a checkpoint.
//
// `preflight(options)` checks a place before anything is made there: the optimizer's
// constructor calls it, so a missing, read-only or unusable directory fails when the
// optimizer is built, not at its first step (see preflight below).
//
// Whole, aligned ranges (offset, length and address multiples of 4 KiB: what the layout's
// chunks are) go to the disk as they are; any other range goes through a 1 MiB bounce
// buffer, read-modify-write for writes.
//
// Thread safety: one thread at a time per tier.
#pragma once

#include <tierstate/core/error.hpp>
#include <tierstate/core/notice.hpp>
#include <tierstate/io/engine.hpp>
#include <tierstate/io/error.hpp>
#include <tierstate/tiers/tier.hpp>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <sys/resource.h>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

namespace tierstate::inline TIERSTATE_ABI {

class NvmeFile {
 public:
  struct options {
    /// Where the scratch file goes: an existing, writable directory, ideally on NVMe.
    std::filesystem::path directory;
    /// The file's name in it, for `unlinked` and `named`; empty: "tierstate-<pid>-<n>.state",
    /// n counting tiers made by this process.
    std::string file_name;
    enum class naming_mode : std::uint8_t {
      tmpfile,   ///< O_TMPFILE; where the filesystem lacks it, `unlinked`
      unlinked,  ///< created by name, O_EXCL | O_NOFOLLOW, then unlinked at once
      named,     ///< created by name and kept until the tier is destroyed (a crash leaves it)
    };
    naming_mode naming = naming_mode::tmpfile;
    /// Make a filesystem that refuses O_DIRECT an error instead of a buffered fallback.
    bool require_direct = false;
    io::engine_options io{};
  };
  static constexpr std::string_view name = "NvmeFile";
  static constexpr std::size_t alignment  = 4096;

  /// Creates and reserves the scratch file. Throws tierstate::invalid_option for bad
  /// options, and tierstate::io_error (naming the path and errno) when the directory is
  /// missing or not writable, the name is taken, the disk is too small, or io_uring is
  /// unavailable; nothing is left behind.
  NvmeFile(std::size_t bytes, options const& o) : size_(bytes)
  {
    validate(o);
    std::string const file = o.file_name.empty() ? default_file_name() : o.file_name;
    directory_ = o.directory.string();
    dir_       = open_directory(directory_);
    try {
      scratch s = make_file(dir_, directory_, file, o.naming);
      fd_       = s.fd;
      path_     = std::move(s.path);
      name_     = std::move(s.name);
    } catch (...) {
      ::close(std::exchange(dir_, -1));
      throw;
    }
    try {
      std::size_t const reserved = round_up(bytes);
      if (reserved > 0) {
        keep_reservation(fd_, directory_);  // before the first block: NOCOW takes only on an empty file
        // Every byte reserved now: a full disk fails here, not in the middle of training.
        int const err = ::posix_fallocate(fd_, 0, static_cast<off_t>(reserved));
        if (err != 0) { throw io_error(err, path_, "fallocate", 0, reserved, "reserving the scratch file's full size"); }
      }
      direct_ = enable_direct(fd_, path_, directory_, o.require_direct);
      engine_ = std::make_unique<io::engine>(o.io);
    } catch (...) {
      remove();
      throw;
    }
  }

  /// Checks, before any state exists, that `o` names a place where the constructor can make
  /// its file: the options are valid, the directory exists, is a directory and takes a new
  /// file from this process (a nameless O_TMPFILE file, or one created O_EXCL under
  /// `file_name`, or a "tierstate-<pid>-<n>.probe" name of its own, and unlinked at once: an
  /// existing file of that name is refused as the constructor refuses it, and nothing is
  /// left in the directory), that file takes
  /// O_DIRECT where `require_direct` asks for it, and io_uring is allowed where it is the
  /// backend. Throws what the constructor would (tierstate::invalid_option,
  /// tierstate::io_error naming the path, the errno and the option to change). It checks
  /// the place as it is now; the constructor checks again. Does not reserve any space.
  static void preflight(options const& o)
  {
    validate(o);
    std::string const directory = o.directory.string();
    int const dir               = open_directory(directory);
    int fd                      = -1;
    try {
      auto const naming = o.naming == options::naming_mode::named ? options::naming_mode::unlinked : o.naming;
      scratch s         = make_probe(dir, directory, o.file_name, naming);
      fd                = s.fd;
      if (o.require_direct) { (void)enable_direct(fd, s.path, directory, true); }
      if (o.io.backend == io::backend::io_uring) { check_io_uring(o.io.queue_depth); }
    } catch (...) {
      if (fd >= 0) { ::close(fd); }
      ::close(dir);
      throw;
    }
    ::close(fd);
    ::close(dir);
  }

  ~NvmeFile() { remove(); }
  NvmeFile(NvmeFile&& o) noexcept
    : size_(std::exchange(o.size_, 0)),
      directory_(std::move(o.directory_)),
      path_(std::move(o.path_)),
      name_(std::move(o.name_)),
      dir_(std::exchange(o.dir_, -1)),
      fd_(std::exchange(o.fd_, -1)),
      direct_(o.direct_),
      engine_(std::move(o.engine_))
  {
  }
  NvmeFile& operator=(NvmeFile&&)      = delete;
  NvmeFile(NvmeFile const&)            = delete;
  NvmeFile& operator=(NvmeFile const&) = delete;

  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  /// The scratch file's path as errors name it: "<dir>/<name>", "<dir>/<name> (unlinked)"
  /// or "<dir>/(O_TMPFILE)".
  [[nodiscard]] std::string const& path() const noexcept { return path_; }
  /// Whether the file still has a name in the directory (only with naming_mode::named).
  [[nodiscard]] bool named() const noexcept { return !name_.empty(); }
  /// The file descriptor (for fstat and the like; reads and writes belong to the tier).
  [[nodiscard]] int native_handle() const noexcept { return fd_; }
  /// Whether I/O bypasses the page cache (false after the buffered fallback).
  [[nodiscard]] bool direct() const noexcept { return direct_; }
  [[nodiscard]] io::engine const& engine() const noexcept { return *engine_; }

  void read(std::size_t offset, std::span<std::byte> to) const
  {
    check(offset, to.size());
    if (aligned(offset, to.data(), to.size())) {
      io::request const r{fd_, offset, to.data(), to.size(), false, &path_};
      engine_->submit({&r, 1});
      return;
    }
    bounce(offset, to.size(), [&](std::size_t at, std::byte const* src, std::size_t n) {
      std::memcpy(to.data() + (at - offset), src, n);
    }, nullptr);
  }

  void write(std::size_t offset, std::span<std::byte const> from)
  {
    check(offset, from.size());
    if (aligned(offset, from.data(), from.size())) {
      // The engine's requests carry mutable pointers for reads; a write never changes them.
      io::request const r{fd_, offset, const_cast<std::byte*>(from.data()), from.size(), true, &path_};
      engine_->submit({&r, 1});
      return;
    }
    bounce(offset, from.size(), nullptr, [&](std::size_t at, std::byte* dst, std::size_t n) {
      std::memcpy(dst, from.data() + (at - offset), n);
    });
  }

  /// Independent reads and writes in one batch (the pipelined transfer's path).
  void transfer(std::span<tier_io const> ops)
  {
    std::vector<io::request> requests;
    requests.reserve(ops.size());
    for (auto const& op : ops) {
      check(op.offset, op.length);
      if (!aligned(op.offset, op.data, op.length)) {
        // Rare (the layout's chunks are aligned): one at a time through the bounce buffer.
        if (op.write) {
          write(op.offset, {op.data, op.length});
        } else {
          read(op.offset, {op.data, op.length});
        }
        continue;
      }
      requests.push_back({fd_, op.offset, op.data, op.length, op.write, &path_});
    }
    engine_->submit(requests);
  }

  /// Streaming (the pipelined transfer's path): reads and writes start one at a time and
  /// finish one at a time while the engine keeps the disk busy. Ranges must be aligned.
  void stream_start(tier_io const& op, std::uint64_t tag)
  {
    check(op.offset, op.length);
    TIERSTATE_EXPECTS(aligned(op.offset, op.data, op.length),
                      "NvmeFile::stream_start: ranges must be 4 KiB-aligned in offset, length and address");
    engine_->start({fd_, op.offset, op.data, op.length, op.write, &path_}, tag);
  }
  template <class Done>
  void stream_progress(bool wait, Done&& done)
  {
    engine_->progress(wait, done);
  }
  [[nodiscard]] std::size_t stream_active() const noexcept { return engine_->active(); }

  /// Registers the staging region as an io_uring fixed buffer. Where RLIMIT_MEMLOCK (8 MiB
  /// for ordinary users) refuses it, says so once and goes on with unregistered buffers.
  /// Returns 0 or the errno that refused it.
  int register_staging(std::span<std::byte> region)
  {
    int const err = engine_->register_buffer(region);
    if (err != 0) {
      rlimit lim{};
      ::getrlimit(RLIMIT_MEMLOCK, &lim);
      notify_once("NvmeFile.unregistered",
                  "io_uring refused to register " + std::to_string(region.size()) +
                    " bytes of staging buffers (" + std::strerror(err) +
                    (err == ENOMEM ? "; RLIMIT_MEMLOCK is " + std::to_string(lim.rlim_cur) + " bytes" : std::string()) +
                    "): NvmeFile transfers through unregistered buffers, which costs a little "
                    "CPU per transfer");
    }
    return err;
  }

 private:
  // The scratch file's making and checks, defined in tiers/detail/nvme_file.inl.
  /// "tierstate-<pid>-<n>.state", n counting the tiers this process has made.
  static std::string default_file_name();
  /// The options the constructor and preflight refuse before touching the filesystem.
  static void validate(options const& o);
  /// What to change, for an errno that refused the directory or a file in it.
  static std::string_view directory_hint(int err) noexcept;
  /// The directory, opened O_PATH (held, so the file is removed from where it was made).
  static int open_directory(std::string const& directory);

  struct scratch {
    int fd = -1;
    std::string path;  ///< as errors name it
    std::string name;  ///< empty once nameless
  };

  /// Makes the scratch file in `dir` as `naming` says (see the file comment). Throws
  /// io_error, leaving nothing behind, where that is refused.
  static scratch make_file(int dir, std::string const& directory, std::string const& file, options::naming_mode naming);
  /// preflight's file: made as the constructor would make it, nameless at once. Without a
  /// file name of the user's, a name of its own ("tierstate-<pid>-<n>.probe"), so the
  /// state's names are left to count tiers.
  static scratch make_probe(int dir, std::string const& directory, std::string const& file, options::naming_mode naming);
  /// Switches `fd` to O_DIRECT. Returns false (buffered, told once per directory) where the
  /// filesystem refuses it, or throws io_error there when `required`.
  static bool enable_direct(int fd, std::string const& path, std::string const& directory, bool required);
  /// Whether the kernel lets this process make an io_uring (ENOSYS: not built in; EPERM:
  /// seccomp or kernel.io_uring_disabled), in the words the engine uses.
  static void check_io_uring(unsigned queue_depth);
  /// Makes fallocate's reservation hold where the filesystem copies on write. On btrfs, sets
  /// FS_NOCOW_FL on the still empty file (btrfs takes it only then): overwrites then go to
  /// the blocks reserved. Tells once per directory where NOCOW is refused, and on ZFS and
  /// bcachefs, whose overwrites always take new blocks. Never fails: the file works either
  /// way, only a disk that fills later can then fail a step.
  static void keep_reservation(int fd, std::string const& directory);

  static constexpr std::size_t round_up(std::size_t n) noexcept
  {
    return (n + alignment - 1) / alignment * alignment;
  }
  static bool aligned(std::size_t offset, void const* p, std::size_t n) noexcept
  {
    return offset % alignment == 0 && n % alignment == 0 &&
           reinterpret_cast<std::uintptr_t>(p) % alignment == 0;
  }

  void check(std::size_t offset, std::size_t n) const
  {
    TIERSTATE_EXPECTS(offset <= size_ && n <= size_ - offset,
                      "NvmeFile: bytes [" + std::to_string(offset) + ", " + std::to_string(offset + n) +
                        ") are outside its " + std::to_string(size_) + " bytes");
  }

  /// Walks [offset, offset + n) in aligned windows of at most 1 MiB: reads each window, hands
  /// the part inside the range to `out(at, bytes, count)` (reads) or lets `in(at, bytes,
  /// count)` fill it and writes the window back (writes).
  template <class Out, class In>
  void bounce(std::size_t offset, std::size_t n, Out out, In in) const
  {
    constexpr std::size_t window = std::size_t{1} << 20;
    std::unique_ptr<std::byte, decltype(&std::free)> buf(
      static_cast<std::byte*>(std::aligned_alloc(alignment, window)), &std::free);
    if (!buf) { throw std::bad_alloc(); }
    std::size_t const end = offset + n;
    for (std::size_t lo = offset / alignment * alignment; lo < end; lo += window) {
      std::size_t const hi  = std::min(lo + window, round_up(end));
      std::size_t const len = hi - lo;
      io::request r{fd_, lo, buf.get(), len, false, &path_};
      engine_->submit({&r, 1});
      std::size_t const a = std::max(lo, offset), b = std::min(hi, end);
      if constexpr (std::is_same_v<In, std::nullptr_t>) {
        out(a, buf.get() + (a - lo), b - a);
      } else {
        in(a, buf.get() + (a - lo), b - a);
        r.write = true;
        engine_->submit({&r, 1});
      }
    }
  }

  void remove() noexcept
  {
    engine_.reset();
    if (fd_ >= 0) {
      ::close(std::exchange(fd_, -1));
      if (!name_.empty()) { ::unlinkat(dir_, name_.c_str(), 0); }
    }
    if (dir_ >= 0) { ::close(std::exchange(dir_, -1)); }
  }

  std::size_t size_ = 0;
  std::string directory_, path_, name_;
  int dir_     = -1;  ///< the directory, held open: the file is removed from where it was made
  int fd_      = -1;
  bool direct_ = false;
  std::unique_ptr<io::engine> engine_;
};

static_assert(batched_tier<NvmeFile> && streaming_tier<NvmeFile> && staging_aware_tier<NvmeFile> &&
              !addressable_tier<NvmeFile>);

}  // namespace tierstate

#include <tierstate/tiers/detail/nvme_file.inl>
