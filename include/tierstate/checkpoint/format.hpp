// SPDX-License-Identifier: Apache-2.0
// The checkpoint file format, version 1.
//
// A checkpoint holds an optimizer's whole state: rule, precision, step count, layout,
// parameter groups and their hyper-parameters, and every chunk exactly as a tier holds it.
// All integers are little-endian; every region starts on a 4 KiB boundary, so the file is
// read and written with O_DIRECT.
//
//   [0, H)          the header, H = round_up(32 + P + 8, 4096):
//                     0  magic "TSCKPT\r\n" (8 bytes)
//                     8  u32 format version (1)        12 u32 reserved (0)
//                    16  u64 P, the payload's bytes     24 u64 reserved (0)
//                    32  the payload (below), P bytes
//                  32+P  u64 XXH3-64 of bytes [0, 32 + P)
//                    then zeros to H
//   [H, H + C*B)    chunk k at H + k*B: B = chunk bytes, C = chunk count
//   [H + C*B, end)  the table, round_up(8 + 8 + 8*C + 8, 4096) bytes:
//                     magic "TSCKTBL\n", u64 C, C x u64 XXH3-64 of each chunk,
//                     u64 XXH3-64 of the table's bytes before it, then zeros
//
// The payload, in order: str rule; str precision; i64 step; u64 chunk_elements, chunk_bytes,
// chunk_count, total_elements; u32 slot count, then per slot u32 slot id (core/concepts.hpp's
// slot_id: 0 to 4 for the library's slots, a hash of the name with the top bit set for a
// rule's own) and u32 element bytes (the bytes of one block, for a block codec); u64 tensor count, then per tensor str name, u64 offset (in elements), u64 count,
// u64 group; u64 group count, u32 values per group, then each group's values as f64 (the
// rule's hyper-parameters, in the rule's order); for a rule with a tensor phase, and only
// then, u64 tensor count, then per tensor u64 rows, u64 columns, u64 n and n f32 (the
// tensor's own state). A str is a u32 length and its bytes.
//
// Reading checks before it uses: the magic, the version, every length against what is left
// (nothing is allocated from a size the file gives before it is bounded by the file's own
// size), the header's checksum, the file's exact size, the table's checksum, and each
// chunk's checksum.
#pragma once

#include <tierstate/checkpoint/detail/fields.hpp>
#include <tierstate/checkpoint/error.hpp>
#include <tierstate/core/error.hpp>
#include <tierstate/io/request.hpp>  // io::engine_options only: a codec needs no engine, nor liburing

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#ifndef XXH_INLINE_ALL
#define XXH_INLINE_ALL  // header-only use: nothing to link
#endif
#include <xxhash.h>

namespace tierstate::inline TIERSTATE_ABI {

/// The operations of a save, in the order they happen (for observers: tests, progress bars).
enum class save_event : std::uint8_t {
  create,           ///< the temporary file is created
  write,            ///< a region (header, a chunk, the table) is about to be written
  fsync_file,       ///< the temporary file is about to be fsync'd
  rename,           ///< it is about to be renamed over the checkpoint's name
  fsync_directory,  ///< the directory is about to be fsync'd
  done,             ///< the checkpoint is complete and durable
};

[[nodiscard]] constexpr std::string_view save_event_name(save_event e) noexcept
{
  switch (e) {
    case save_event::create: return "create";
    case save_event::write: return "write";
    case save_event::fsync_file: return "fsync_file";
    case save_event::rename: return "rename";
    case save_event::fsync_directory: return "fsync_directory";
    case save_event::done: return "done";
  }
  return "?";
}

/// How save() and load() do their I/O.
struct checkpoint_options {
  /// Called before each operation of a save (offset and length for writes, else 0).
  std::function<void(save_event, std::uint64_t offset, std::uint64_t length)> observer;
  /// The engine for the checkpoint file (its backend, depth, block size; faults for tests).
  /// Unset: the state tier's engine options where the tier has them (NvmeFile's
  /// `options.tier.io`, without its fault plan), so a backend chosen for the tier (psync
  /// where io_uring is forbidden) carries over; else the defaults.
  std::optional<io::engine_options> io;
  /// Check chunk and header checksums on load. Turn off only to fuzz the parser behind them.
  bool verify_checksums = true;
};

namespace checkpoint {

inline constexpr std::array<char, 8> header_magic = {'T', 'S', 'C', 'K', 'P', 'T', '\r', '\n'};
inline constexpr std::array<char, 8> table_magic  = {'T', 'S', 'C', 'K', 'T', 'B', 'L', '\n'};
inline constexpr std::uint32_t format_version    = 1;
inline constexpr std::size_t block               = 4096;
inline constexpr std::size_t header_prefix       = 32;
/// The largest header payload a reader accepts (a model with millions of tensors fits).
inline constexpr std::uint64_t max_payload = std::uint64_t{1} << 30;

[[nodiscard]] inline std::uint64_t checksum(void const* p, std::size_t n) noexcept { return XXH3_64bits(p, n); }
[[nodiscard]] constexpr std::uint64_t round_up(std::uint64_t n) noexcept { return (n + block - 1) / block * block; }
[[nodiscard]] constexpr std::uint64_t table_bytes(std::uint64_t chunks) noexcept { return round_up(8 + 8 + 8 * chunks + 8); }

static_assert(std::endian::native == std::endian::little,
              "tierstate's checkpoint format is little-endian; a big-endian reader is not written yet");

/// The header's contents.
struct header {
  std::string rule, precision;
  std::int64_t step = 0;
  std::uint64_t chunk_elements = 0, chunk_bytes = 0, chunk_count = 0, total_elements = 0;
  struct slot_entry {
    std::uint32_t id, element_bytes;
  };
  std::vector<slot_entry> slots;
  struct tensor_entry {
    std::string name;
    std::uint64_t offset, count, group;
  };
  std::vector<tensor_entry> tensors;
  std::uint32_t values_per_group = 0;
  std::vector<std::vector<double>> groups;
  /// A rule with a tensor phase: each tensor's shape and own state, in tensor order.
  struct tensor_state_entry {
    std::uint64_t rows = 0, columns = 0;
    std::vector<float> values;
  };
  std::vector<tensor_state_entry> tensor_states;
};

/// The header region (H bytes, zero-padded, checksummed).
inline std::vector<std::byte> encode(header const& h)
{
  detail::writer p;
  p.put(std::string_view(h.rule));
  p.put(std::string_view(h.precision));
  p.put(h.step);
  p.put(h.chunk_elements);
  p.put(h.chunk_bytes);
  p.put(h.chunk_count);
  p.put(h.total_elements);
  p.put(static_cast<std::uint32_t>(h.slots.size()));
  for (auto const& s : h.slots) {
    p.put(s.id);
    p.put(s.element_bytes);
  }
  p.put(static_cast<std::uint64_t>(h.tensors.size()));
  for (auto const& t : h.tensors) {
    p.put(std::string_view(t.name));
    p.put(t.offset);
    p.put(t.count);
    p.put(t.group);
  }
  p.put(static_cast<std::uint64_t>(h.groups.size()));
  p.put(h.values_per_group);
  for (auto const& g : h.groups) {
    for (double const v : g) { p.put(v); }
  }
  if (!h.tensor_states.empty()) {
    p.put(static_cast<std::uint64_t>(h.tensor_states.size()));
    for (auto const& t : h.tensor_states) {
      p.put(t.rows);
      p.put(t.columns);
      p.put(static_cast<std::uint64_t>(t.values.size()));
      for (float const v : t.values) { p.put(v); }
    }
  }
  auto const& payload = p.bytes();
  std::vector<std::byte> out(round_up(header_prefix + payload.size() + 8));
  std::memcpy(out.data(), header_magic.data(), 8);
  std::uint32_t const version = format_version, zero32 = 0;
  std::uint64_t const size = payload.size(), zero64 = 0;
  std::memcpy(out.data() + 8, &version, 4);
  std::memcpy(out.data() + 12, &zero32, 4);
  std::memcpy(out.data() + 16, &size, 8);
  std::memcpy(out.data() + 24, &zero64, 8);
  std::memcpy(out.data() + header_prefix, payload.data(), payload.size());
  std::uint64_t const sum = checksum(out.data(), header_prefix + payload.size());
  std::memcpy(out.data() + header_prefix + payload.size(), &sum, 8);
  return out;
}

/// From the first block: the header region's size H, after checking magic, version and
/// that the payload's size is plausible for a file of `file_bytes` and at most `max_bytes`
/// (what the reader's own header can need: a reader allocates nothing from a size it has
/// not bounded, and a sparse file's apparent size is no bound).
inline std::uint64_t header_bytes(std::span<std::byte const> first_block, std::uint64_t file_bytes,
                                  std::string const& path, std::uint64_t max_bytes = max_payload)
{
  if (first_block.size() < header_prefix || std::memcmp(first_block.data(), header_magic.data(), 8) != 0) {
    throw checkpoint_error(path, "not a tierstate checkpoint (its first bytes are not the magic \"TSCKPT\")");
  }
  std::uint32_t version;
  std::memcpy(&version, first_block.data() + 8, 4);
  if (version != format_version) {
    throw checkpoint_error(path, "format version " + std::to_string(version) + "; this build reads version " +
                                   std::to_string(format_version));
  }
  std::uint64_t payload;
  std::memcpy(&payload, first_block.data() + 16, 8);
  if (payload > max_payload || header_prefix + payload + 8 > file_bytes) {
    throw checkpoint_error(path, "the header claims " + std::to_string(payload) + " bytes of payload in a file of " +
                                   std::to_string(file_bytes) + " bytes (corrupt or truncated)");
  }
  if (header_prefix + payload + 8 > max_bytes) {
    throw checkpoint_error(path, "the header claims " + std::to_string(payload) +
                                   " bytes of payload; a checkpoint of this optimizer's tensors needs at most " +
                                   std::to_string(max_bytes) + " (corrupt, or saved from a different model)");
  }
  return round_up(header_prefix + payload + 8);
}

/// Parses the whole header region (checksum first, when asked).
inline header decode(std::span<std::byte const> region, std::string const& path, bool verify)
{
  std::uint64_t payload;
  std::memcpy(&payload, region.data() + 16, 8);
  if (verify) {
    std::uint64_t stored;
    std::memcpy(&stored, region.data() + header_prefix + payload, 8);
    if (stored != checksum(region.data(), header_prefix + payload)) {
      throw checkpoint_error(path, "the header's checksum does not match (corrupt)");
    }
  }
  detail::reader r(region.subspan(header_prefix, payload), path);
  header h;
  h.rule           = r.str("rule");
  h.precision      = r.str("precision");
  h.step           = r.get<std::int64_t>("step");
  h.chunk_elements = r.get<std::uint64_t>("chunk_elements");
  h.chunk_bytes    = r.get<std::uint64_t>("chunk_bytes");
  h.chunk_count    = r.get<std::uint64_t>("chunk_count");
  h.total_elements = r.get<std::uint64_t>("total_elements");
  auto const nslots = r.get<std::uint32_t>("slot count");
  if (nslots > r.left() / 8) { throw checkpoint_error(path, "header field slot count = " + std::to_string(nslots) + " is too large (corrupt)"); }
  for (std::uint32_t i = 0; i < nslots; ++i) {
    header::slot_entry s{};
    s.id            = r.get<std::uint32_t>("slot id");
    s.element_bytes = r.get<std::uint32_t>("slot element bytes");
    h.slots.push_back(s);
  }
  auto const ntensors = r.count("tensor count", 4 + 24);
  h.tensors.reserve(ntensors);
  for (std::uint64_t i = 0; i < ntensors; ++i) {
    header::tensor_entry t;
    t.name   = r.str("tensor name");
    t.offset = r.get<std::uint64_t>("tensor offset");
    t.count  = r.get<std::uint64_t>("tensor count");
    t.group  = r.get<std::uint64_t>("tensor group");
    h.tensors.push_back(std::move(t));
  }
  auto const ngroups = r.get<std::uint64_t>("group count");
  h.values_per_group = r.get<std::uint32_t>("values per group");
  if (h.values_per_group == 0 || h.values_per_group > 64 || ngroups > r.left() / (8 * h.values_per_group)) {
    throw checkpoint_error(path, "header fields group count = " + std::to_string(ngroups) + " and values per group = " +
                                   std::to_string(h.values_per_group) + " do not fit in the header (corrupt)");
  }
  for (std::uint64_t g = 0; g < ngroups; ++g) {
    h.groups.emplace_back();
    for (std::uint32_t v = 0; v < h.values_per_group; ++v) { h.groups.back().push_back(r.get<double>("group value")); }
  }
  if (r.left() != 0) {  // the tensor phase's state
    auto const n = r.count("tensor state count", 24);
    h.tensor_states.reserve(n);
    for (std::uint64_t t = 0; t < n; ++t) {
      header::tensor_state_entry e;
      e.rows     = r.get<std::uint64_t>("tensor state rows");
      e.columns  = r.get<std::uint64_t>("tensor state columns");
      auto const m = r.count("tensor state floats", 4);
      e.values.reserve(m);
      for (std::uint64_t i = 0; i < m; ++i) { e.values.push_back(r.get<float>("tensor state value")); }
      h.tensor_states.push_back(std::move(e));
    }
  }
  if (r.left() != 0) {
    throw checkpoint_error(path, std::to_string(r.left()) + " bytes follow the header's last field (corrupt)");
  }
  return h;
}

/// The table region for `sums`.
inline std::vector<std::byte> encode_table(std::span<std::uint64_t const> sums)
{
  std::vector<std::byte> out(table_bytes(sums.size()));
  std::memcpy(out.data(), table_magic.data(), 8);
  std::uint64_t const n = sums.size();
  std::memcpy(out.data() + 8, &n, 8);
  std::memcpy(out.data() + 16, sums.data(), 8 * sums.size());
  std::uint64_t const sum = checksum(out.data(), 16 + 8 * sums.size());
  std::memcpy(out.data() + 16 + 8 * sums.size(), &sum, 8);
  return out;
}

/// The chunk checksums from a table region of `chunks` chunks.
inline std::vector<std::uint64_t> decode_table(std::span<std::byte const> region, std::uint64_t chunks,
                                               std::string const& path, bool verify)
{
  std::uint64_t n;
  std::memcpy(&n, region.data() + 8, 8);
  if (std::memcmp(region.data(), table_magic.data(), 8) != 0 || n != chunks) {
    throw checkpoint_error(path, "the chunk table is missing or names " + std::to_string(n) + " chunks for the header's " +
                                   std::to_string(chunks) + " (corrupt)");
  }
  if (verify) {
    std::uint64_t stored;
    std::memcpy(&stored, region.data() + 16 + 8 * chunks, 8);
    if (stored != checksum(region.data(), 16 + 8 * chunks)) {
      throw checkpoint_error(path, "the chunk table's checksum does not match (corrupt)");
    }
  }
  std::vector<std::uint64_t> sums(chunks);
  std::memcpy(sums.data(), region.data() + 16, 8 * chunks);
  return sums;
}

}  // namespace checkpoint
}  // namespace tierstate
