// SPDX-License-Identifier: Apache-2.0
// OffloadedOptimizer::save and load (the format: checkpoint/format.hpp).
#pragma once

#include <atomic>
#include <cerrno>
#include <cstring>
#include <string>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace tierstate {
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

}  // namespace detail

#define TIERSTATE_OPTIMIZER_TEMPLATE \
  template <rule Rule, precision Precision, tier StateTier, class Transfer, class Compute>
#define TIERSTATE_OPTIMIZER OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>

TIERSTATE_OPTIMIZER_TEMPLATE
checkpoint::header TIERSTATE_OPTIMIZER::make_header() const
{
  checkpoint::header h;
  h.rule           = std::string(Rule::name);
  h.precision      = Precision::name();
  h.step           = step_;
  h.chunk_elements = layout_->chunk_elements();
  h.chunk_bytes    = layout_->chunk_bytes();
  h.chunk_count    = layout_->chunk_count();
  h.total_elements = layout_->total_elements();
  for (std::size_t i = 0; i < layout_->slots().size(); ++i) {
    h.slots.push_back({static_cast<std::uint32_t>(layout_->slots()[i]),
                       static_cast<std::uint32_t>(layout_->slot_element_bytes(i))});
  }
  for (std::size_t t = 0; t < tensors_.size(); ++t) {
    h.tensors.push_back({tensors_[t].name, layout_->tensors()[t].offset, tensors_[t].count, tensors_[t].group});
  }
  h.values_per_group = static_cast<std::uint32_t>(Rule::hyperparameter_count);
  for (auto const& g : groups_) {
    auto const v = Rule::to_values(g);
    h.groups.emplace_back(v.begin(), v.end());
  }
  return h;
}

TIERSTATE_OPTIMIZER_TEMPLATE
void TIERSTATE_OPTIMIZER::check_header(checkpoint::header const& h, std::string const& path) const
{
  auto differ = [&](std::string const& what, std::string const& there, std::string const& here) {
    throw checkpoint_error(path, "was saved with " + what + " " + there + ", and this optimizer has " + here);
  };
  if (h.rule != Rule::name) { differ("rule", "'" + h.rule + "'", "'" + std::string(Rule::name) + "'"); }
  if (h.precision != Precision::name()) { differ("precision", h.precision, Precision::name()); }
  auto const mine = make_header();
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
      differ("tensor " + std::to_string(t), "'" + a.name + "' of " + std::to_string(a.count) + " elements",
             "'" + b.name + "' of " + std::to_string(b.count) + " elements");
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
      throw checkpoint_error(path, "tensor '" + h.tensors[t].name + "' is in group " + std::to_string(h.tensors[t].group) +
                                     " of " + std::to_string(h.groups.size()) + " (corrupt)");
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

TIERSTATE_OPTIMIZER_TEMPLATE
void TIERSTATE_OPTIMIZER::params_from_master(std::size_t k, std::byte const* chunk)
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

TIERSTATE_OPTIMIZER_TEMPLATE
void TIERSTATE_OPTIMIZER::save(std::filesystem::path const& path, checkpoint_options const& o)
{
  check_not_streaming("save");
  flush();
  check_not_lost("save");
  o.io.validate();
  materialize();
  std::string const target = path.string();
  std::filesystem::path const dir = path.has_parent_path() ? path.parent_path() : std::filesystem::path(".");
  std::string const name = path.filename().string();
  if (name.empty() || name == "." || name == "..") {
    throw logic_error("save: '" + target + "' names no file");
  }
  static std::atomic<std::uint64_t> saves{0};
  std::string const temp = "." + name + ".tmp-" + std::to_string(::getpid()) + "-" + std::to_string(saves++);
  std::string const temp_path = (dir / temp).string();

  detail::unique_fd dirfd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dirfd.fd < 0) { throw io_error(errno, dir.string(), "open", 0, 0, "the directory of the checkpoint"); }
  auto observe = [&](save_event e, std::uint64_t offset = 0, std::uint64_t length = 0) {
    if (o.observer) { o.observer(e, offset, length); }
  };
  observe(save_event::create);
  detail::unique_fd fd(::openat(dirfd.fd, temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
  if (fd.fd < 0) { throw io_error(errno, temp_path, "create", 0, 0, "the checkpoint's temporary file"); }
  try {
    detail::try_direct(fd.fd);
    io::engine engine(o.io);
    auto write = [&](std::uint64_t offset, std::byte const* data, std::size_t n) {
      observe(save_event::write, offset, n);
      io::request const r{fd.fd, offset, const_cast<std::byte*>(data), n, true, &temp_path};
      engine.submit({&r, 1});
    };
    PinnedHost header = detail::aligned_copy(checkpoint::encode(make_header()));
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
    PinnedHost table = detail::aligned_copy(checkpoint::encode_table(sums));
    write(H + sums.size() * B, table.data(), table.size());
    observe(save_event::fsync_file);
    if (::fsync(fd.fd) != 0) { throw io_error(errno, temp_path, "fsync", 0, 0, "the checkpoint's temporary file"); }
    fd.reset();
    observe(save_event::rename);
    if (::renameat(dirfd.fd, temp.c_str(), dirfd.fd, name.c_str()) != 0) {
      throw io_error(errno, temp_path, "rename", 0, 0, "onto " + target);
    }
  } catch (...) {
    fd.reset();
    ::unlinkat(dirfd.fd, temp.c_str(), 0);  // nothing half-written is left, under any name
    throw;
  }
  // The rename is durable once the directory is.
  observe(save_event::fsync_directory);
  if (::fsync(dirfd.fd) != 0) { throw io_error(errno, dir.string(), "fsync", 0, 0, "the checkpoint's directory"); }
  observe(save_event::done);
}

TIERSTATE_OPTIMIZER_TEMPLATE
void TIERSTATE_OPTIMIZER::load(std::filesystem::path const& path, checkpoint_options const& o)
{
  check_not_streaming("load");
  try {
    flush();  // a failed update in flight is replaced by what is loaded
  } catch (...) {
  }
  delayed_.reset();  // its param buffer is made afresh from the params load writes
  o.io.validate();
  std::string const file = path.string();
  detail::unique_fd fd(::open(file.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.fd < 0) { throw io_error(errno, file, "open", 0, 0, "the checkpoint"); }
  detail::try_direct(fd.fd);
  struct stat st{};
  if (::fstat(fd.fd, &st) != 0) { throw io_error(errno, file, "fstat"); }
  auto const file_bytes = static_cast<std::uint64_t>(st.st_size);
  if (file_bytes < checkpoint::block) {
    throw checkpoint_error(file, "is " + std::to_string(file_bytes) + " bytes, shorter than a header (truncated)");
  }
  materialize();
  io::engine engine(o.io);
  auto read = [&](std::uint64_t offset, std::byte* data, std::size_t n) {
    io::request const r{fd.fd, offset, data, n, false, &file};
    engine.submit({&r, 1});
  };

  // The header: its first block, then the rest (bounded by the file's size).
  PinnedHost first(checkpoint::block);
  read(0, first.data(), checkpoint::block);
  std::uint64_t const H = checkpoint::header_bytes({first.data(), first.size()}, file_bytes, file);
  PinnedHost region(H);
  std::memcpy(region.data(), first.data(), checkpoint::block);
  if (H > checkpoint::block) { read(checkpoint::block, region.data() + checkpoint::block, H - checkpoint::block); }
  checkpoint::header const h = checkpoint::decode({region.data(), region.size()}, file, o.verify_checksums);
  check_header(h, file);

  // The file's size, now that its layout is known to be ours.
  std::size_t const B   = layout_->chunk_bytes();
  std::size_t const C   = layout_->chunk_count();
  std::uint64_t const T = checkpoint::table_bytes(C);
  if (file_bytes != H + C * B + T) {
    throw checkpoint_error(file, "is " + std::to_string(file_bytes) + " bytes; its header describes " +
                                   std::to_string(H + C * B + T) + " (truncated or extended)");
  }
  PinnedHost table(T);
  read(H + C * B, table.data(), T);
  std::vector<std::uint64_t> const sums = checkpoint::decode_table({table.data(), table.size()}, C, file, o.verify_checksums);

  auto corrupt_chunk = [&](std::size_t k) {
    return checkpoint_error(file, "chunk " + std::to_string(k) + " of " + std::to_string(C) + " (bytes [" +
                                    std::to_string(H + k * B) + ", " + std::to_string(H + (k + 1) * B) +
                                    ") of the file) does not match its checksum (corrupt)");
  };
  std::optional<PinnedHost> scratch;
  std::byte* buffer;
  if constexpr (addressable_tier<StateTier>) {
    scratch.emplace(B);
    buffer = scratch->data();
  } else {
    buffer = staging(0);
  }
  // Pass 1: every chunk verified before anything changes.
  if (o.verify_checksums) {
    for (std::size_t k = 0; k < C; ++k) {
      read(H + k * B, buffer, B);
      if (checkpoint::checksum(buffer, B) != sums[k]) { throw corrupt_chunk(k); }
    }
  }
  // Pass 2: into the tier. A failure here leaves the state part loaded: lost.
  try {
    for (std::size_t k = 0; k < C; ++k) {
      std::byte* chunk = buffer;
      if constexpr (addressable_tier<StateTier>) { chunk = tier_->data() + k * B; }
      read(H + k * B, chunk, B);
      if (o.verify_checksums && checkpoint::checksum(chunk, B) != sums[k]) { throw corrupt_chunk(k); }
      if constexpr (!addressable_tier<StateTier>) { tier_->write(k * B, std::span<std::byte const>(chunk, B)); }
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

#undef TIERSTATE_OPTIMIZER_TEMPLATE
#undef TIERSTATE_OPTIMIZER

}  // namespace tierstate
