// SPDX-License-Identifier: Apache-2.0
// save and load: a checkpoint written to a temporary, synced and renamed into place, and
// read back after every check; save_to and load_from: the same bytes and checks through a
// caller's writer and reader (write_checkpoint and read_checkpoint are the format's side).
#pragma once

#include <tierstate/checkpoint/detail/params_region.hpp>

namespace tierstate::inline TIERSTATE_ABI {

// Saves the whole state (master and slots from any tier, the step counts, every group's
// hyper-parameters, the layout, the rule and the precision) to `path` (format:
// checkpoint/format.hpp), chunk by chunk: it needs no more host memory than a step.
// Atomic: written to a nameless temporary file (O_TMPFILE) in `path`'s directory, fsync'd, linked under a temporary name and at once renamed over `path`, and the
// directory fsync'd, so a crash at any moment leaves the previous checkpoint whole and no
// temporary (but, from a crash between link and rename, a name that the next save of
// `path` removes). A `path` that exists and is not a regular file is refused (logic_error).
// On failure nothing is left and io_error is thrown; an optimizer whose state was not
// made stays so. The engine is `o.io`, or by default the tier's (checkpoint_options::io).
template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::save(
    std::filesystem::path const& path, checkpoint_options const& o)
{
  detail::gate_entry const gate(gate_, "save");
  check_not_streaming("save");
  flush();
  detail::flush_sources(sources_);  // a write of params that failed behind is this save's error, before any file
  store_.check_not_lost("save");
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
  bool const fresh = !store_.made();  // a failed save on an optimizer without state leaves it without
  PinnedHost header{0}, table{0};
  detail::trace_scope const traced(tracer_, trace_phase::save);  // (a refused save records nothing)
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
    write_checkpoint(header, table, o.progress ? o.progress : opts_.progress, write);
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
    if (fresh) { store_.discard(); }
    throw;
  }
  // The rename is durable once the directory is.
  observe(save_event::fsync_directory);
  if (::fsync(dirfd.fd) != 0) { throw io_error(errno, dir.string(), "fsync", 0, 0, "the checkpoint's directory"); }
  observe(save_event::done);
}

// Loads a checkpoint (of either format version) saved by an optimizer with the same rule,
// precision, chunk size and tensors (names and sizes, in order), from any tier into this
// one. Everything is checked first (checkpoint_error names the difference or the corrupt
// chunk, or that `path` is not a regular file; io_error a failed read), against the
// layout this optimizer has or would make, so a refused load leaves even a fresh one as it
// was. Never blocks in open (a FIFO). The file is read twice: every chunk's checksum, then
// the load, which replaces the state, the step counts, the groups and their numbers (with
// a master, every param too). It also restores a lost optimizer ("Failures"); a read
// failing in the second pass loses it.
template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::load(
    std::filesystem::path const& path, checkpoint_options const& o)
{
  detail::gate_entry const gate(gate_, "load");
  check_not_streaming("load");
  flush_before_load();
  io::engine_options const eo = checkpoint_io(o);
  if (tensors_.empty()) { throw logic_error("load: no tensor is registered: add_tensor first"); }
  detail::trace_scope const traced(tracer_, trace_phase::load);
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

  read_checkpoint(file_bytes, file, o.verify_checksums, o.progress ? o.progress : opts_.progress, first, region, table,
                  scratch, read);
}

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::flush_before_load()
{
  // A delayed update in flight is finished first. If it failed, what is loaded replaces
  // it; if the load is refused, its failure stands (the state is lost).
  try {
    flush();
  } catch (std::exception const& e) {
    store_.mark_lost(std::string("the delayed update failed: ") + e.what(), true);
  } catch (...) {
    store_.mark_lost("the delayed update failed", true);
  }
  detail::flush_sources(sources_, true);  // writes still behind land first; their failures are replaced by the load
}

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
template <class Write>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::write_checkpoint(PinnedHost& header,
    PinnedHost& table, progress_callback const& progress, Write&& write)
{
  auto const h = make_header();
  header       = detail::aligned_copy(checkpoint::encode(h));
  write(0, header.data(), header.size());

  std::uint64_t const H = header.size();
  std::size_t const B   = store_.layout().chunk_bytes();
  std::size_t const C   = store_.layout().chunk_count();
  std::vector<std::uint64_t> counts;  // of the tensors whose params the file keeps
  for (auto const t : h.param_tensors) { counts.push_back(tensors_[t].count); }
  std::size_t const PB  = checkpoint::detail::param_block_bytes(B);
  std::uint64_t const P = checkpoint::detail::param_blocks(counts, sizeof(param_type), PB);
  std::uint64_t const R = H + C * B;  // the params region
  std::vector<std::uint64_t> sums(C + P);
  std::uint64_t const total = R + P * PB + checkpoint::table_bytes(C + P);
  auto const report         = [&](std::uint64_t done) {
    if (progress) { progress(progress_phase::save, done, total); }
  };
  step_stats ignored;
  for (std::size_t k = 0; k < C; ++k) {
    store_.with_chunk(k, false, ignored, [&](std::byte const* chunk) {
      sums[k] = checkpoint::checksum(chunk, B);
      write(H + k * B, chunk, B);
    });
    report(H + (k + 1) * B);
  }
  // Offloaded params, a block at a time (never the whole model in memory).
  PinnedHost block(P > 0 ? PB : 0);
  for (std::uint64_t j = 0; j < P; ++j) {
    std::memset(block.data(), 0, PB);
    checkpoint::detail::walk_param_block(counts, sizeof(param_type), j, PB, block.data(),
                                         [&](std::size_t i, std::size_t offset, std::byte* at, std::size_t n) {
                                           detail::read_params(tensors_[h.param_tensors[i]], offset,
                                                       {reinterpret_cast<param_type*>(at), n});
                                         });
    sums[C + j] = checkpoint::checksum(block.data(), PB);
    write(R + j * PB, block.data(), PB);
    report(R + (j + 1) * PB);
  }
  table = detail::aligned_copy(checkpoint::encode_table(sums));
  write(R + P * PB, table.data(), table.size());
  report(total);
}

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::save_to(
    std::function<void(std::span<std::byte const>)> const& write)
{
  detail::gate_entry const gate(gate_, "save_to");
  check_not_streaming("save_to");
  flush();
  detail::flush_sources(sources_);
  store_.check_not_lost("save_to");
  if (!write) { throw logic_error("save_to: the writer is empty"); }
  if (tensors_.empty()) { throw logic_error("save_to: no tensor is registered: add_tensor first"); }
  bool const fresh = !store_.made();  // a failed save on an optimizer without state leaves it without
  PinnedHost header{0}, table{0};
  try {
    materialize();
    std::uint64_t next = 0;  // the pieces come in order: each starts where the last ended
    write_checkpoint(header, table, opts_.progress, [&](std::uint64_t offset, std::byte const* data, std::size_t n) {
      TIERSTATE_EXPECTS(offset == next, "save_to: a piece out of order");
      write(std::span<std::byte const>(data, n));
      next = offset + n;
    });
  } catch (...) {
    if (fresh) { store_.discard(); }
    throw;
  }
}

template <class Rule, precision Precision, tier StateTier, class Transfer, class Compute>
void OffloadedOptimizer<Rule, Precision, StateTier, Transfer, Compute>::load_from(std::uint64_t size,
    std::function<void(std::uint64_t offset, std::span<std::byte> to)> const& read, bool verify_checksums)
{
  detail::gate_entry const gate(gate_, "load_from");
  check_not_streaming("load_from");
  flush_before_load();
  if (!read) { throw logic_error("load_from: the reader is empty"); }
  if (tensors_.empty()) { throw logic_error("load_from: no tensor is registered: add_tensor first"); }
  PinnedHost first{0}, region{0}, table{0}, scratch{0};
  read_checkpoint(size, "(load_from)", verify_checksums, opts_.progress, first, region, table, scratch,
                  [&](std::uint64_t offset, std::byte* data, std::size_t n) {
                    if (offset + n > size) {
                      throw checkpoint_error("(load_from)", "a read of [" + std::to_string(offset) + ", " +
                                                              std::to_string(offset + n) + ") past its " +
                                                              std::to_string(size) + " bytes");
                    }
                    read(offset, std::span<std::byte>(data, n));
                  });
}

}  // namespace tierstate

