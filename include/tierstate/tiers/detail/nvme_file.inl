// SPDX-License-Identifier: Apache-2.0
// NvmeFile's scratch file (tiers/nvme_file.hpp): how it is named, made, reserved and checked,
// and what each refusal tells the user to change.
#pragma once

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include <fcntl.h>
#include <liburing.h>
#include <sys/ioctl.h>
#include <sys/statfs.h>
#include <unistd.h>

namespace tierstate::inline TIERSTATE_ABI {

inline std::string NvmeFile::default_file_name()
{
  static std::atomic<std::uint64_t> made{0};
  return "tierstate-" + std::to_string(::getpid()) + "-" + std::to_string(made++) + ".state";
}

inline void NvmeFile::validate(options const& o)
{
  if (o.directory.empty()) {
    throw invalid_option("NvmeFile.directory", "\"\"",
                         "name the directory for the scratch file (on the NVMe drive)");
  }
  std::string const& file = o.file_name;
  if (!file.empty() && (file == "." || file == ".." || file.find('/') != std::string::npos ||
                        file.find('\0') != std::string::npos)) {
    throw invalid_option("NvmeFile.file_name", "\"" + file + "\"", "must be a plain file name, without '/'");
  }
  o.io.validate();
}

inline std::string_view NvmeFile::directory_hint(int err) noexcept
{
  switch (err) {
    case ENOENT: return "NvmeFile.directory must name an existing directory";
    case ENOTDIR: return "NvmeFile.directory must name a directory, not a file";
    case EACCES:
    case EPERM: return "NvmeFile.directory must name a directory this process may write to";
    case EROFS: return "NvmeFile.directory is on a read-only filesystem: name a writable one";
    default: return "NvmeFile.directory must name a writable directory";
  }
}

inline int NvmeFile::open_directory(std::string const& directory)
{
  int const dir = ::open(directory.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (dir < 0) {
    int const err = errno;
    throw io_error(err, directory, "open", 0, 0,
                   "the directory for NvmeFile's scratch file; " + std::string(directory_hint(err)));
  }
  return dir;
}

inline NvmeFile::scratch NvmeFile::make_file(int dir, std::string const& directory, std::string const& file,
                                             options::naming_mode naming)
{
  scratch s;
  s.path = directory + "/" + file;
  s.name = file;
  if (naming == options::naming_mode::tmpfile) {
    s.fd = ::openat(dir, ".", O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
    if (s.fd >= 0) {
      s.path = directory + "/(O_TMPFILE)";
      s.name.clear();
      return s;
    }
    if (errno != EOPNOTSUPP && errno != EISDIR && errno != EINVAL) {
      int const err = errno;
      throw io_error(err, directory, "open(O_TMPFILE)", 0, 0,
                     "NvmeFile's scratch file; " + std::string(directory_hint(err)));
    }
  }
  s.fd = ::openat(dir, s.name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (s.fd < 0) {
    int const err = errno;
    if (err == EEXIST) {
      throw io_error(err, s.path, "create", 0, 0,
                     "a file or link of that name is already there: tierstate never reuses or "
                     "removes a file it did not create; remove it, or set NvmeFile.file_name");
    }
    throw io_error(err, s.path, "create", 0, 0, "NvmeFile's scratch file; " + std::string(directory_hint(err)));
  }
  if (naming != options::naming_mode::named) {
    // Nameless from now on: nothing to clean up after a crash.
    if (::unlinkat(dir, s.name.c_str(), 0) != 0) {
      int const err = errno;
      ::close(s.fd);
      throw io_error(err, s.path, "unlink", 0, 0, "NvmeFile's scratch file, right after creating it");
    }
    s.path += " (unlinked)";
    s.name.clear();
  }
  return s;
}

inline NvmeFile::scratch NvmeFile::make_probe(int dir, std::string const& directory, std::string const& file,
                                              options::naming_mode naming)
{
  if (!file.empty()) { return make_file(dir, directory, file, naming); }
  static std::atomic<std::uint64_t> probes{0};
  for (int attempt = 0;; ++attempt) {
    std::string const name = "tierstate-" + std::to_string(::getpid()) + "-" + std::to_string(probes++) + ".probe";
    try {
      return make_file(dir, directory, name, naming);
    } catch (io_error const& e) {
      if (e.code().value() != EEXIST || attempt == 7) { throw; }  // not ours: another name
    }
  }
}

inline bool NvmeFile::enable_direct(int fd, std::string const& path, std::string const& directory, bool required)
{
  int const flags = ::fcntl(fd, F_GETFL);
  if (flags >= 0 && ::fcntl(fd, F_SETFL, flags | O_DIRECT) == 0) { return true; }
  int const err = errno;
  if (err != EINVAL || required) {
    throw io_error(err, path, "fcntl(O_DIRECT)", 0, 0,
                   err == EINVAL ? "this filesystem refuses O_DIRECT and NvmeFile.require_direct is set; "
                                   "name a directory on another filesystem, or allow buffered I/O"
                                 : "enabling O_DIRECT");
  }
  notify_once("NvmeFile.buffered:" + directory,
              directory + " refuses O_DIRECT (EINVAL, as tmpfs does): NvmeFile uses "
                          "buffered I/O there, through the page cache");
  return false;
}

inline void NvmeFile::check_io_uring(unsigned queue_depth)
{
  io_uring ring{};
  int const r = io_uring_queue_init(queue_depth, &ring, 0);
  if (r < 0) {
    throw io_error(-r, "an io_uring of " + std::to_string(queue_depth) + " entries", "io_uring_queue_init", 0, 0,
                   std::string(r == -ENOSYS  ? "io_uring is not in this kernel"
                               : r == -EPERM ? "io_uring is forbidden here, by a seccomp filter "
                                               "or kernel.io_uring_disabled"
                                             : "io_uring is unavailable") +
                     "; NvmeFile.io.backend = io::backend::psync uses pread/pwrite instead");
  }
  io_uring_queue_exit(&ring);
}

inline void NvmeFile::keep_reservation(int fd, std::string const& directory)
{
  // linux/fs.h's values, spelled here: that header clashes with <sys/mount.h> in a user's
  // program (glibc 2.36).
  constexpr std::uint32_t btrfs_magic = 0x9123683E, zfs_magic = 0x2FC12FC1, bcachefs_magic = 0xCA451A4E;
  constexpr unsigned long get_flags = _IOR('f', 1, long), set_flags = _IOW('f', 2, long);
  constexpr int nocow = 0x00800000;  // FS_NOCOW_FL
  struct statfs fs{};
  if (::fstatfs(fd, &fs) != 0) { return; }
  auto const type = static_cast<std::uint32_t>(static_cast<unsigned long>(fs.f_type));
  std::string refused;
  if (type == btrfs_magic) {
    int flags = 0;  // FS_IOC_GETFLAGS and SETFLAGS take an int, whatever their macros say
    if (::ioctl(fd, get_flags, &flags) != 0) {
      refused = std::string("FS_IOC_GETFLAGS: ") + std::strerror(errno);
    } else if ((flags & nocow) == 0) {
      flags |= nocow;
      if (::ioctl(fd, set_flags, &flags) != 0) {
        refused = std::string("FS_IOC_SETFLAGS: ") + std::strerror(errno);
      } else if (::ioctl(fd, get_flags, &flags) != 0 || (flags & nocow) == 0) {
        refused = "the flag did not stay set";
      }
    }
    if (refused.empty()) { return; }
    refused = "btrfs, which refused to make the scratch file NOCOW (" + refused + ")";
  } else if (type == zfs_magic) {
    refused = "ZFS";
  } else if (type == bcachefs_magic) {
    refused = "bcachefs";
  } else {
    return;  // overwrites in place (ext4, xfs, tmpfs): the reservation holds
  }
  notify_once("NvmeFile.cow:" + directory,
              directory + " is on " + refused +
                ": a copy-on-write filesystem writes every overwrite to new blocks, so the space "
                "reserved for NvmeFile's scratch file does not keep later steps from running out; "
                "if the disk fills up, a step fails with ENOSPC and the state is lost. Keep space "
                "free there, or put NvmeFile.directory on ext4 or xfs");
}
}  // namespace tierstate
