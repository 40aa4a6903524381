// SPDX-License-Identifier: Apache-2.0
// A sharded checkpoint's manifest (ranks::sharded::save and load): which rank saved which
// elements of which tensors into which file, with each file's size and checksum. Text, one
// record per line, the last line the checksum of every byte before it:
//   tierstate-sharded-checkpoint 1
//   ranks N
//   block B                       (the partition's)
//   step S
//   generation G                  (16 hex digits: the files' suffix)
//   tensors T
//   tensor COUNT NAME             (T lines, in registration order; the name to the line's end)
//   groups G
//   group V...                    (G lines: each group's hyper-parameters in the rule's table
//                                  order, each double's bits as 16 hex digits)
//   file RANK BYTES CHECKSUM PIECES NAME   (N lines; a rank without pieces: 0 0 0 0 -)
//   piece TENSOR BEGIN COUNT      (PIECES lines after each file line)
//   end CHECKSUM                  (XXH3-64 of the bytes before this line, 16 hex digits)
// A file's checksum is the XXH3-64 of all its bytes, so a manifest names exactly the files
// it was written with: a file from another save, or changed since, is refused by name.
#pragma once

#include <tierstate/checkpoint/error.hpp>
#include <tierstate/checkpoint/format.hpp>  // checkpoint::checksum (xxhash, inline)
#include <tierstate/core/error.hpp>
#include <tierstate/io/error.hpp>
#include <tierstate/ranks/communicator.hpp>  // detail::cat
#include <tierstate/ranks/partition.hpp>

#include <bit>
#include <cerrno>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <new>
#include <sstream>
#include <string_view>
#include <string>
#include <system_error>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

namespace tierstate::inline TIERSTATE_ABI::ranks::detail {

struct manifest_file {
  std::string name;  ///< in the manifest's directory; empty for a rank without pieces
  std::uint64_t bytes    = 0;
  std::uint64_t checksum = 0;
  std::vector<piece> pieces;
};

struct manifest {
  std::size_t block       = 4096;
  std::int64_t step       = 0;
  std::uint64_t generation = 0;
  std::vector<std::pair<std::string, std::size_t>> tensors;  ///< (name, elements)
  std::vector<std::vector<double>> groups;                   ///< each group's hyper-parameters
  std::vector<manifest_file> files;                          ///< one per rank
};

inline std::string hex16(std::uint64_t v)
{
  char b[17];
  std::snprintf(b, sizeof b, "%016llx", static_cast<unsigned long long>(v));
  return b;
}

[[nodiscard]] inline std::string to_text(manifest const& m)
{
  std::ostringstream o;
  o << "tierstate-sharded-checkpoint 1\nranks " << m.files.size() << "\nblock " << m.block << "\nstep " << m.step
    << "\ngeneration " << hex16(m.generation) << "\ntensors " << m.tensors.size() << "\n";
  for (auto const& [name, count] : m.tensors) { o << "tensor " << count << " " << name << "\n"; }
  o << "groups " << m.groups.size() << "\n";
  for (auto const& g : m.groups) {
    o << "group";
    for (double const v : g) { o << " " << hex16(std::bit_cast<std::uint64_t>(v)); }
    o << "\n";
  }
  for (std::size_t r = 0; r < m.files.size(); ++r) {
    auto const& f = m.files[r];
    o << "file " << r << " " << f.bytes << " " << hex16(f.checksum) << " " << f.pieces.size() << " "
      << (f.name.empty() ? "-" : f.name) << "\n";
    for (auto const& p : f.pieces) { o << "piece " << p.tensor << " " << p.begin << " " << p.count << "\n"; }
  }
  std::string text = o.str();
  return text + "end " + hex16(checkpoint::checksum(text.data(), text.size())) + "\n";
}

/// The manifest in `text` (read from `path`); checkpoint_error naming what is wrong. Every
/// number is a whole field of digits; the files' pieces must cover each tensor exactly once.
[[nodiscard]] inline manifest parse_manifest(std::string const& text, std::string const& path)
{
  auto bad = [&path](std::string const& why) { return checkpoint_error(path, "not a sharded checkpoint's manifest: " + why); };
  auto const end = text.rfind("end ", text.size() >= 21 ? text.size() - 21 : 0);
  if (end == std::string::npos || text.size() != end + 21 || (end > 0 && text[end - 1] != '\n')) {
    throw bad("its last line is not its checksum (cut short?)");
  }
  if (text.substr(end + 4, 16) != hex16(checkpoint::checksum(text.data(), end))) {
    throw bad("its checksum does not match its contents (changed or damaged)");
  }
  std::size_t at   = 0;  // the line
  std::size_t from = 0;  // where it starts
  std::string_view rest;  // what is left of it
  auto next = [&](std::string_view key) {
    std::size_t const stop = text.find('\n', from);
    if (from >= end || stop == std::string::npos || stop > end) { throw bad(cat("it ends before '", key, "'")); }
    std::string_view const line(text.data() + from, stop - from);
    ++at;
    from = stop + 1;
    if (line.substr(0, key.size()) != key || line.size() <= key.size() || line[key.size()] != ' ') {
      throw bad(cat("line ", std::to_string(at), " is not '", key, " ...'"));
    }
    rest = line.substr(key.size() + 1);
  };
  // The next space-separated field of the line (the last: the rest of it).
  auto field = [&](bool last = false) {
    std::size_t const cut = last ? rest.size() : std::min(rest.find(' '), rest.size());
    std::string_view const f = rest.substr(0, cut);
    rest = rest.substr(std::min(cut + 1, rest.size()));
    return f;
  };
  auto number = [&](int base = 10, bool last = false) {
    std::string_view const f = field(last);
    std::uint64_t v = 0;
    auto const [p, ec] = std::from_chars(f.data(), f.data() + f.size(), v, base);
    if (f.empty() || ec != std::errc{} || p != f.data() + f.size()) {
      throw bad(cat("line ", std::to_string(at), " has '", f.substr(0, 40), "' where a number belongs"));
    }
    return v;
  };
  manifest m;
  next("tierstate-sharded-checkpoint");
  if (number(10, true) != 1) { throw bad("an unknown version (this reader knows 1)"); }
  next("ranks");
  std::uint64_t const ranks = number(10, true);
  next("block");
  m.block = number(10, true);
  next("step");
  m.step = static_cast<std::int64_t>(number(10, true));
  next("generation");
  m.generation = number(16, true);
  next("tensors");
  std::uint64_t const count = number(10, true);
  if (ranks == 0 || ranks > (1u << 24) || count > text.size() || m.block == 0 || m.step < 0) {
    throw bad("an impossible rank count, tensor count, block or step");
  }
  for (std::size_t t = 0; t < count; ++t) {
    next("tensor");
    std::uint64_t const n = number();
    m.tensors.emplace_back(std::string(field(true)), n);
  }
  next("groups");
  std::uint64_t const groups = number(10, true);
  if (groups > count + 1) { throw bad("more groups than tensors"); }
  for (std::size_t g = 0; g < groups; ++g) {
    next("group");
    std::vector<double> values;
    while (!rest.empty() && values.size() < 64) { values.push_back(std::bit_cast<double>(number(16))); }
    m.groups.push_back(std::move(values));
  }
  std::vector<std::vector<piece>> by_tensor(count);
  for (std::size_t r = 0; r < ranks; ++r) {
    next("file");
    manifest_file f;
    if (number() != r) { throw bad(cat("line ", std::to_string(at), " is not rank ", std::to_string(r), "'s")); }
    f.bytes                   = number();
    f.checksum                = number(16);
    std::uint64_t const count_r = number();
    f.name                    = std::string(field(true));
    if (f.name == "-") { f.name.clear(); }
    if (f.name.find('/') != std::string::npos || count_r > count + ranks || f.name.empty() != (count_r == 0)) {
      throw bad(cat("rank ", std::to_string(r), "'s file line is wrong"));
    }
    for (std::size_t k = 0; k < count_r; ++k) {
      next("piece");
      piece p;
      p.tensor = number();
      p.begin  = number();
      p.count  = number(10, true);
      if (p.tensor >= count || p.count == 0 || p.begin > m.tensors[p.tensor].second ||
          p.count > m.tensors[p.tensor].second - p.begin) {
        throw bad(cat("line ", std::to_string(at), " names elements the tensors do not have"));
      }
      f.pieces.push_back(p);
      by_tensor[p.tensor].push_back(p);
    }
    m.files.push_back(std::move(f));
  }
  if (from != end) { throw bad("it has lines after the last rank's"); }
  for (std::size_t t = 0; t < count; ++t) {  // (in rank order, the pieces of a tensor follow each other)
    std::size_t covered = 0;
    for (auto const& p : by_tensor[t]) {
      if (p.begin != covered) { break; }
      covered += p.count;
    }
    if (covered != m.tensors[t].second) {
      throw bad("its files do not hold every element of tensor '" + m.tensors[t].first + "' exactly once");
    }
  }
  return m;
}

/// The XXH3-64 of every byte of `path`, and their count; io_error naming it.
[[nodiscard]] inline std::pair<std::uint64_t, std::uint64_t> file_checksum(std::filesystem::path const& path)
{
  int const fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) { throw io_error(errno, path.string(), "open"); }
  XXH3_state_t* st = XXH3_createState();
  if (st == nullptr) {
    ::close(fd);
    throw std::bad_alloc();
  }
  XXH3_64bits_reset(st);
  std::vector<char> buf(1 << 20);
  std::uint64_t total = 0;
  for (;;) {
    ssize_t const n = ::read(fd, buf.data(), buf.size());
    if (n < 0 && errno == EINTR) { continue; }
    if (n < 0) {
      int const e = errno;
      XXH3_freeState(st);
      ::close(fd);
      throw io_error(e, path.string(), "read");
    }
    if (n == 0) { break; }
    XXH3_64bits_update(st, buf.data(), static_cast<std::size_t>(n));
    total += static_cast<std::uint64_t>(n);
  }
  std::uint64_t const h = XXH3_64bits_digest(st);
  XXH3_freeState(st);
  ::close(fd);
  return {h, total};
}

/// `text` into `path`, atomically: a temporary beside it, fsync'd, renamed over it, and the
/// directory fsync'd. On failure the temporary is removed and io_error names the step.
inline void write_atomically(std::filesystem::path const& path, std::string const& text)
{
  auto const tmp = path.parent_path() / cat(".", path.filename().string(), ".tmp");
  int const fd   = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) { throw io_error(errno, tmp.string(), "create"); }
  auto fail = [&](char const* what) {
    int const e = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    throw io_error(e, tmp.string(), what);
  };
  for (std::size_t done = 0; done < text.size();) {
    ssize_t const n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) { continue; }
    if (n <= 0) { fail("write"); }
    done += static_cast<std::size_t>(n);
  }
  if (::fsync(fd) != 0) { fail("fsync"); }
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int const e = errno;
    ::unlink(tmp.c_str());
    throw io_error(e, tmp.string(), cat("rename to ", path.string()));
  }
  int const dir = ::open(path.parent_path().empty() ? "." : path.parent_path().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir >= 0) {
    ::fsync(dir);
    ::close(dir);
  }
}

/// A small file's bytes (a manifest: at most 64 MiB); checkpoint_error naming it.
[[nodiscard]] inline std::string read_small(std::filesystem::path const& path)
{
  std::error_code ec;
  auto const size = std::filesystem::file_size(path, ec);
  if (ec) { throw checkpoint_error(path.string(), cat("no sharded checkpoint's manifest here: ", ec.message())); }
  if (size > (64u << 20)) { throw checkpoint_error(path.string(), "too large for a manifest"); }
  std::string text(size, '\0');
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr || std::fread(text.data(), 1, size, f) != size) {
    if (f != nullptr) { std::fclose(f); }
    throw checkpoint_error(path.string(), "cannot be read");
  }
  std::fclose(f);
  return text;
}

}  // namespace tierstate::ranks::detail
