// SPDX-License-Identifier: Apache-2.0
// The checkpoint header's fields: a little-endian writer, and a reader that checks each field
// against what is left (checkpoint/format.hpp uses both).
#pragma once

#include <tierstate/checkpoint/error.hpp>
#include <tierstate/core/config.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace tierstate::inline TIERSTATE_ABI::checkpoint::detail {

/// Appends little-endian fields.
class writer {
 public:
  template <class T>
  void put(T v)
  {
    static_assert(std::is_trivially_copyable_v<T>);
    auto const at = bytes_.size();
    bytes_.resize(at + sizeof(T));
    std::memcpy(bytes_.data() + at, &v, sizeof(T));
  }
  void put(std::string_view s)
  {
    put(static_cast<std::uint32_t>(s.size()));
    auto const at = bytes_.size();
    bytes_.resize(at + s.size());
    std::memcpy(bytes_.data() + at, s.data(), s.size());
  }
  void append(writer const& w) { bytes_.insert(bytes_.end(), w.bytes_.begin(), w.bytes_.end()); }
  [[nodiscard]] std::size_t size() const noexcept { return bytes_.size(); }
  [[nodiscard]] std::vector<std::byte>& bytes() noexcept { return bytes_; }

 private:
  std::vector<std::byte> bytes_;
};

/// Reads little-endian fields, each checked against what is left.
class reader {
 public:
  reader(std::span<std::byte const> bytes, std::string const& path) : bytes_(bytes), path_(path) {}

  template <class T>
  T get(char const* field)
  {
    static_assert(std::is_trivially_copyable_v<T>);
    need(sizeof(T), field);
    T v;
    std::memcpy(&v, bytes_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::string str(char const* field)
  {
    auto const n = get<std::uint32_t>(field);
    need(n, field);
    std::string s(reinterpret_cast<char const*>(bytes_.data() + pos_), n);
    pos_ += n;
    return s;
  }
  /// A count of entries of at least `min_entry_bytes` each: bounded by what is left.
  std::uint64_t count(char const* field, std::size_t min_entry_bytes)
  {
    auto const n = get<std::uint64_t>(field);
    if (n > (bytes_.size() - pos_) / min_entry_bytes) {
      throw checkpoint_error(path_, std::string("header field ") + field + " = " + std::to_string(n) +
                                      " does not fit in the header's " + std::to_string(bytes_.size()) +
                                      " bytes (corrupt)");
    }
    return n;
  }
  [[nodiscard]] std::size_t left() const noexcept { return bytes_.size() - pos_; }
  /// The next n bytes, as a reader of their own (a section's body); this one moves past them.
  reader part(std::uint64_t n, char const* field)
  {
    need(n, field);
    reader r(bytes_.subspan(pos_, n), path_);
    pos_ += n;
    return r;
  }

 private:
  void need(std::size_t n, char const* field) const
  {
    if (n > bytes_.size() - pos_) {
      throw checkpoint_error(path_, std::string("the header ends inside field ") + field + " (corrupt or truncated)");
    }
  }
  std::span<std::byte const> bytes_;
  std::string const& path_;
  std::size_t pos_ = 0;
};

}  // namespace tierstate::checkpoint::detail

