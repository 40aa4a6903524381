// SPDX-License-Identifier: Apache-2.0
// The files under save and load: descriptors, O_DIRECT, temporary names and their cleanup
// (the format itself: checkpoint/format.hpp).
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

}  // namespace tierstate
