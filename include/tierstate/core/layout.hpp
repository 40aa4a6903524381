// SPDX-License-Identifier: Apache-2.0
// The layout: all registered tensors packed, in registration order, into fixed-size chunks.
//
// Element e of the concatenation of all tensors belongs to chunk e / chunk_elements. A chunk
// holds, one after the other, an array of chunk_elements values per slot (the fp32 master
// first when the precision keeps one, then the rule's slots in their order), each array
// stored with the slot's codec (codecs/codec.hpp) and rounded up to a multiple of 4 KiB, so
// every chunk is one contiguous, O_DIRECT-aligned transfer. The last chunk is padded to full
// size. A chunk may span tensors; a tensor may span chunks. Where a slot has a block codec,
// each tensor starts on a multiple of the largest block (the elements before it are padding
// that belongs to no tensor), so no block holds two tensors' elements nor straddles a chunk.
//
// The layout depends only on the tensors (names and counts, in order), the chunk size, the
// precision and the rule's slots: never on the tier, the transfer or the compute. State saved
// from one tier therefore means the same thing in another.
#pragma once

#include <tierstate/core/concepts.hpp>
#include <tierstate/core/error.hpp>

#include <algorithm>
#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace tierstate::inline TIERSTATE_ABI {

/// One registered tensor's place in the layout.
struct tensor_extent {
  std::string name;
  std::size_t offset = 0;  ///< first element, in the concatenation of all tensors
  std::size_t count  = 0;
};

/// How one slot array is stored: blocks of `block` elements (a power of two that divides
/// 2048), each `block_bytes` bytes; an element codec has blocks of one element.
struct slot_format {
  std::size_t block       = 1;
  std::size_t block_bytes = 4;
  std::string_view codec  = "fp32";  ///< the codec's name (checkpoints record it)
};

class layout {
 public:
  /// Every slot array in a chunk is a multiple of 4 KiB: chunk_elements must be a multiple of
  /// this (2048 two-byte or 1024 four-byte values make 4 KiB).
  static constexpr std::size_t element_granularity = 2048;
  static constexpr std::size_t alignment           = 4096;
  /// The chunk when none is asked for (optimizer_options::chunk_elements 0): 2^20 elements,
  /// 12 MiB of Bf16Mixed AdamW's master, m and v.
  static constexpr std::size_t default_chunk_elements = std::size_t{1} << 20;

  layout() = default;

  /// `formats[i]` is how slot i is stored.
  layout(std::vector<tensor_extent> tensors, std::size_t chunk_elements,
         std::vector<slot> slots, std::vector<slot_format> formats);

  [[nodiscard]] std::size_t chunk_elements() const noexcept { return chunk_elements_; }
  [[nodiscard]] std::size_t chunk_count() const noexcept { return chunk_count_; }
  [[nodiscard]] std::size_t chunk_bytes() const noexcept { return chunk_bytes_; }
  [[nodiscard]] std::size_t total_elements() const noexcept { return total_elements_; }
  [[nodiscard]] std::size_t total_bytes() const noexcept { return chunk_bytes_ * chunk_count_; }
  [[nodiscard]] std::vector<tensor_extent> const& tensors() const noexcept { return tensors_; }
  [[nodiscard]] std::vector<slot> const& slots() const noexcept { return slots_; }

  /// Elements of chunk k that hold data (the last chunk may be partly padding).
  [[nodiscard]] std::size_t chunk_size(std::size_t k) const noexcept;
  /// Index of `s` in slots(); throws tierstate::logic_error when the layout has no such slot.
  [[nodiscard]] std::size_t slot_index(slot s) const;
  /// Byte offset, from the chunk's start, of slot i's array.
  [[nodiscard]] std::size_t slot_offset(std::size_t i) const noexcept { return slot_offsets_[i]; }
  [[nodiscard]] slot_format const& slot_format_of(std::size_t i) const noexcept { return formats_[i]; }
  /// Bytes of one block of slot i (of one element, for an element codec).
  [[nodiscard]] std::size_t slot_block_bytes(std::size_t i) const noexcept { return formats_[i].block_bytes; }
  /// The largest block of any slot: every tensor starts on a multiple of it.
  [[nodiscard]] std::size_t tensor_alignment() const noexcept { return alignment_elements_; }
  /// Byte offset in the tier of element e of slot i (e on a block boundary of slot i).
  [[nodiscard]] std::size_t byte_offset(std::size_t i, std::size_t e) const noexcept
  {
    return (e / chunk_elements_) * chunk_bytes_ + slot_offsets_[i] +
           (e % chunk_elements_) / formats_[i].block * formats_[i].block_bytes;
  }

 private:
  std::vector<tensor_extent> tensors_;
  std::size_t chunk_elements_ = 0;
  std::vector<slot> slots_;
  std::vector<slot_format> formats_;
  std::vector<std::size_t> slot_offsets_;
  std::size_t alignment_elements_ = 1;
  std::size_t chunk_bytes_    = 0;
  std::size_t chunk_count_    = 0;
  std::size_t total_elements_ = 0;
};

inline layout::layout(std::vector<tensor_extent> tensors, std::size_t chunk_elements,
                      std::vector<slot> slots, std::vector<slot_format> formats)
  : tensors_(std::move(tensors)),
    chunk_elements_(chunk_elements),
    slots_(std::move(slots)),
    formats_(std::move(formats))
{
  if (chunk_elements_ == 0 || chunk_elements_ % element_granularity != 0) {
    throw invalid_option("chunk_elements", detail::to_text(chunk_elements_),
                         "must be a positive multiple of 2048, so every slot array of a chunk "
                         "is a whole number of 4 KiB blocks");
  }
  TIERSTATE_EXPECTS(slots_.size() == formats_.size(), "layout: one format per slot");
  for (auto const& f : formats_) {
    TIERSTATE_EXPECTS(f.block > 0 && (f.block & (f.block - 1)) == 0 && element_granularity % f.block == 0 &&
                        f.block_bytes > 0,
                      "layout: a slot's block is a power of two that divides 2048");
    alignment_elements_ = std::max(alignment_elements_, f.block);
  }
  std::size_t offset = 0;
  for (auto& t : tensors_) {
    offset   = (offset + alignment_elements_ - 1) / alignment_elements_ * alignment_elements_;
    t.offset = offset;
    offset += t.count;
  }
  total_elements_ = offset;
  for (auto const& f : formats_) {
    slot_offsets_.push_back(chunk_bytes_);
    std::size_t const bytes = chunk_elements_ / f.block * f.block_bytes;
    chunk_bytes_ += (bytes + alignment - 1) / alignment * alignment;
  }
  chunk_count_ = (total_elements_ + chunk_elements_ - 1) / chunk_elements_;
}

inline std::size_t layout::chunk_size(std::size_t k) const noexcept
{
  std::size_t const begin = k * chunk_elements_;
  return begin >= total_elements_ ? 0 : std::min(chunk_elements_, total_elements_ - begin);
}

inline std::size_t layout::slot_index(slot s) const
{
  for (std::size_t i = 0; i < slots_.size(); ++i) {
    if (slots_[i] == s) { return i; }
  }
  throw logic_error("layout has no slot " + std::string(slot_name(s)));
}

}  // namespace tierstate
