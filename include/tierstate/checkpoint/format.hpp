// SPDX-License-Identifier: Apache-2.0
// The checkpoint file format, version 2 (and the reading of version 1).
//
// A checkpoint holds an optimizer's whole state: rule, precision, step counts, layout,
// tensors and their shapes, parameter groups and their hyper-parameters, per-tensor rule
// state, and every chunk exactly as a tier holds it. All integers are little-endian; every
// region starts on a 4 KiB boundary, so the file is read and written with O_DIRECT.
//
//   [0, H)          the header, H = round_up(32 + P + 8, 4096):
//                     0  magic "TSCKPT\r\n" (8 bytes)
//                     8  u32 format version (2)        12 u32 reserved (0)
//                    16  u64 P, the payload's bytes     24 u64 reserved (0)
//                    32  the payload (below), P bytes
//                  32+P  u64 XXH3-64 of bytes [0, 32 + P)
//                    then zeros to H
//   [H, H + C*B)    chunk k at H + k*B: B = chunk bytes, C = chunk count
//   [H + C*B, H + C*B + R*B')
//                   the params region (only with section "parm"): the params of the tensors
//                   "parm" names, in its order, back to back (element e of the region at
//                   byte e * its element bytes), in R = ceil(bytes / B') blocks of B' bytes,
//                   the last one zero-padded: B' = B, or 1 MiB where B is 0 (no state per
//                   element: SGD or Adafactor with fp32 params)
//   [H + C*B + R*B', end)
//                   the table, round_up(8 + 8 + 8*(C+R) + 8, 4096) bytes:
//                     magic "TSCKTBL\n", u64 C + R, C x u64 XXH3-64 of each chunk, then R of
//                     each params block, u64 XXH3-64 of the table's bytes before it, zeros
//
// The payload is a table of sections: u32 section count, then each section as a 4-byte tag,
// a u32 of flags (bit 0: required, a reader that does not know the tag refuses the file;
// without it, such a reader skips the section), a u64 length and that many bytes. A later
// version adds sections (params, a rank's manifest) rather than a new format. Version 2's,
// each required and present once (a str is a u32 length and its bytes):
//   "rule"  str rule; u32 M, then M str: the names of its hyper-parameters, in table order
//   "prec"  str precision; u32 S, then per slot (the master or compensation first, then the
//           rule's): u32 slot id (core/concepts.hpp's slot_id), str slot name, str codec,
//           u32 elements per block, u32 bytes per block
//   "layt"  u64 chunk_elements, chunk_bytes, chunk_count, total_elements
//   "step"  i64 the optimizer's step count
//   "tens"  u64 T, then per tensor str name, u64 offset (in elements), u64 count, u64 group,
//           i64 its own step count, u64 rows (every batch's), u64 columns
//   "grps"  u64 G, u32 M, then G x M f64: each group's hyper-parameters, in table order
//   "tphs"  (a rule with a tensor phase, and only then) u64 T, then per tensor u64 n and n f32
// and one optional section (files saved before it see each tensor as "tens" says):
//   "dims"  u64 T, then per tensor u64 batches (its rows are "tens"'s over these), u8 1 for
//           a vector (core/tensor.hpp's tensor_shape), else 0
// and, where the optimizer has offloaded params (state/offloaded_params.hpp), one more
// required section, which a reader older than it refuses by name:
//   "parm"  u32 bytes of one param element (2 or 4); u64 N >= 1, then N u64 tensor indices
//           (into "tens"), ascending: the tensors whose params the params region holds
//
// Version 1 (still read) had one fixed payload: str rule; str precision; i64 step; the four
// u64 of "layt"; u32 slot count and per slot u32 id, u32 element bytes; u64 tensor count and
// per tensor str name, u64 offset, u64 count, u64 group; "grps"'s fields; and, for a rule
// with a tensor phase, u64 tensor count and per tensor u64 rows, u64 columns, u64 n, n f32.
// Its tensors all take the file's step count.
//
// Reading checks before it uses: the magic, the version, every length against what is left
// (nothing is allocated from a size the file gives before it is bounded by the file's own
// size), the header's checksum, the file's exact size, the table's checksum, and each
// chunk's checksum.
#pragma once

#include <tierstate/checkpoint/detail/fields.hpp>
#include <tierstate/checkpoint/detail/payload.hpp>
#include <tierstate/checkpoint/error.hpp>
#include <tierstate/core/error.hpp>
#include <tierstate/core/progress.hpp>
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
  std::function<void(save_event, std::uint64_t offset, std::uint64_t length)> observer{};
  /// The engine for the checkpoint file (its backend, depth, block size; faults for tests).
  /// Unset: the state tier's engine options where the tier has them (NvmeFile's
  /// `options.tier.io`, without its fault plan), so a backend chosen for the tier (psync
  /// where io_uring is forbidden) carries over; else the defaults.
  std::optional<io::engine_options> io;
  /// Check chunk and header checksums on load. Turn off only to fuzz the parser behind them.
  bool verify_checksums = true;
  /// Hears the save's or load's progress (core/progress.hpp); empty: the optimizer's
  /// options.progress, if any.
  progress_callback progress{};
};

namespace checkpoint {

inline constexpr std::array<char, 8> header_magic = {'T', 'S', 'C', 'K', 'P', 'T', '\r', '\n'};
inline constexpr std::array<char, 8> table_magic  = {'T', 'S', 'C', 'K', 'T', 'B', 'L', '\n'};
inline constexpr std::uint32_t format_version    = 2;
/// The oldest version this build reads.
inline constexpr std::uint32_t oldest_version    = 1;
inline constexpr std::size_t block               = 4096;
inline constexpr std::size_t header_prefix       = 32;
/// The largest header payload a reader accepts (a model with millions of tensors fits).
inline constexpr std::uint64_t max_payload = std::uint64_t{1} << 30;

[[nodiscard]] inline std::uint64_t checksum(void const* p, std::size_t n) noexcept { return XXH3_64bits(p, n); }
[[nodiscard]] constexpr std::uint64_t round_up(std::uint64_t n) noexcept { return (n + block - 1) / block * block; }
[[nodiscard]] constexpr std::uint64_t table_bytes(std::uint64_t chunks) noexcept { return round_up(8 + 8 + 8 * chunks + 8); }

static_assert(std::endian::native == std::endian::little,
              "tierstate's checkpoint format is little-endian; a big-endian reader is not written yet");

/// The header region (H bytes, zero-padded, checksummed), in the current version.
inline std::vector<std::byte> encode(header const& h)
{
  auto p = detail::encode_payload(h);
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
  if (version < oldest_version || version > format_version) {
    throw checkpoint_error(path, "format version " + std::to_string(version) + "; this build reads versions " +
                                   std::to_string(oldest_version) + " to " + std::to_string(format_version));
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
  std::uint32_t version;
  std::memcpy(&version, region.data() + 8, 4);
  detail::reader r(region.subspan(header_prefix, payload), path);
  header h;
  h.version = version;
  if (version == 1) {
    detail::decode_payload_v1(r, h, path);
  } else {
    detail::decode_payload(r, h, path);
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
