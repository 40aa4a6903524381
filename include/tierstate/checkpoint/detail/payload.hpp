// SPDX-License-Identifier: Apache-2.0
// A checkpoint header's contents (checkpoint::header) and its payload, as written (version
// 2: a table of sections) and as read (versions 1 and 2). checkpoint/format.hpp describes
// the bytes; this is their code.
#pragma once

#include <tierstate/checkpoint/detail/fields.hpp>
#include <tierstate/checkpoint/error.hpp>
#include <tierstate/core/config.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

namespace tierstate::inline TIERSTATE_ABI::checkpoint {

/// A header's contents. Fields marked v2 are empty or 0 when read from a version-1 file.
struct header {
  std::uint32_t version = 2;  ///< as read
  std::string rule, precision;
  std::vector<std::string> hyperparameter_names;  ///< the rule's table, in order (v2)
  std::int64_t step = 0;
  std::uint64_t chunk_elements = 0, chunk_bytes = 0, chunk_count = 0, total_elements = 0;
  struct slot_entry {
    std::uint32_t id = 0, element_bytes = 0;  ///< element_bytes: the bytes of one block
    std::string name, codec;                  ///< (v2)
    std::uint32_t block = 0;                  ///< elements per block (v2)
  };
  std::vector<slot_entry> slots;
  struct tensor_entry {
    std::string name;
    std::uint64_t offset = 0, count = 0, group = 0;
    std::int64_t step = 0;                 ///< its own count (a v1 file: the file's)
    std::uint64_t rows = 1, columns = 0;   ///< its shape, rows counting every batch's (a v1 file: 1 x count,
                                           ///< unless tensor_states has it)
    std::uint64_t batches = 1;             ///< (section "dims"; 1 without it)
    bool vector = false;                   ///< (section "dims"; false without it)
  };
  std::vector<tensor_entry> tensors;
  std::uint32_t values_per_group = 0;
  std::vector<std::vector<double>> groups;
  /// A rule with a tensor phase: each tensor's own state, in tensor order.
  struct tensor_state_entry {
    std::vector<float> values;
  };
  std::vector<tensor_state_entry> tensor_states;
  /// Whether the tensors' shapes were recorded (every v2 file; a v1 file of a tensor phase).
  bool shapes_recorded = true;
  /// Whether their batches and vector flags were (a v2 file with section "dims").
  bool dims_recorded = true;
  /// Section "parm": the tensors whose params the file holds (offloaded params), ascending,
  /// and the bytes of one param element; none without it.
  std::uint32_t param_bytes = 0;
  std::vector<std::uint64_t> param_tensors;
};

namespace detail {

/// A section's tag: its four characters as a little-endian u32.
[[nodiscard]] constexpr std::uint32_t tag(char const (&s)[5]) noexcept
{
  return static_cast<std::uint32_t>(static_cast<unsigned char>(s[0])) |
         static_cast<std::uint32_t>(static_cast<unsigned char>(s[1])) << 8 |
         static_cast<std::uint32_t>(static_cast<unsigned char>(s[2])) << 16 |
         static_cast<std::uint32_t>(static_cast<unsigned char>(s[3])) << 24;
}
[[nodiscard]] inline std::string tag_text(std::uint32_t t)
{
  std::string s;
  for (int i = 0; i < 4; ++i) {
    auto const c = static_cast<char>((t >> (8 * i)) & 0xff);
    s += (c >= 0x20 && c < 0x7f) ? c : '?';
  }
  return s;
}
inline constexpr std::uint32_t required_section = 1;

/// The sections this build knows; the first six are in every version-2 file.
inline constexpr std::array<std::uint32_t, 9> known_sections = {
  tag("rule"), tag("prec"), tag("layt"), tag("step"), tag("tens"), tag("grps"), tag("tphs"), tag("dims"), tag("parm")};
inline constexpr std::size_t always_there = 6;

inline void put_section(writer& p, char const (&name)[5], writer const& body, bool required = true)
{
  p.put(tag(name));
  p.put(required ? required_section : std::uint32_t{0});
  p.put(static_cast<std::uint64_t>(body.size()));
  p.append(body);
}

/// Version 2's payload.
inline writer encode_payload(header const& h)
{
  writer p;
  std::uint32_t const sections = 7 + (h.tensor_states.empty() ? 0 : 1) + (h.param_tensors.empty() ? 0 : 1);
  p.put(sections);
  writer b;
  b.put(std::string_view(h.rule));
  b.put(static_cast<std::uint32_t>(h.hyperparameter_names.size()));
  for (auto const& n : h.hyperparameter_names) { b.put(std::string_view(n)); }
  put_section(p, "rule", b);
  b = {};
  b.put(std::string_view(h.precision));
  b.put(static_cast<std::uint32_t>(h.slots.size()));
  for (auto const& s : h.slots) {
    b.put(s.id);
    b.put(std::string_view(s.name));
    b.put(std::string_view(s.codec));
    b.put(s.block);
    b.put(s.element_bytes);
  }
  put_section(p, "prec", b);
  b = {};
  for (std::uint64_t const v : {h.chunk_elements, h.chunk_bytes, h.chunk_count, h.total_elements}) { b.put(v); }
  put_section(p, "layt", b);
  b = {};
  b.put(h.step);
  put_section(p, "step", b);
  b = {};
  b.put(static_cast<std::uint64_t>(h.tensors.size()));
  for (auto const& t : h.tensors) {
    b.put(std::string_view(t.name));
    for (std::uint64_t const v : {t.offset, t.count, t.group}) { b.put(v); }
    b.put(t.step);
    b.put(t.rows * t.batches);
    b.put(t.columns);
  }
  put_section(p, "tens", b);
  // Optional: without it a reader sees each tensor as (batches x rows) x columns, which is
  // what a rule that does not look at batches sees anyway.
  b = {};
  b.put(static_cast<std::uint64_t>(h.tensors.size()));
  for (auto const& t : h.tensors) {
    b.put(t.batches);
    b.put(static_cast<std::uint8_t>(t.vector ? 1 : 0));
  }
  put_section(p, "dims", b, false);
  b = {};
  b.put(static_cast<std::uint64_t>(h.groups.size()));
  b.put(h.values_per_group);
  for (auto const& g : h.groups) {
    for (double const v : g) { b.put(v); }
  }
  put_section(p, "grps", b);
  if (!h.tensor_states.empty()) {
    b = {};
    b.put(static_cast<std::uint64_t>(h.tensor_states.size()));
    for (auto const& t : h.tensor_states) {
      b.put(static_cast<std::uint64_t>(t.values.size()));
      for (float const v : t.values) { b.put(v); }
    }
    put_section(p, "tphs", b);
  }
  if (!h.param_tensors.empty()) {
    b = {};
    b.put(h.param_bytes);
    b.put(static_cast<std::uint64_t>(h.param_tensors.size()));
    for (std::uint64_t const t : h.param_tensors) { b.put(t); }
    put_section(p, "parm", b);
  }
  return p;
}

/// "grps": also version 1's fields, in the same order.
inline void read_groups(reader& r, header& h, std::string const& path)
{
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
}

inline void read_layout(reader& r, header& h)
{
  h.chunk_elements = r.get<std::uint64_t>("chunk_elements");
  h.chunk_bytes    = r.get<std::uint64_t>("chunk_bytes");
  h.chunk_count    = r.get<std::uint64_t>("chunk_count");
  h.total_elements = r.get<std::uint64_t>("total_elements");
}

/// A tensor's name, offset, count and group (both versions start its entry so).
inline header::tensor_entry read_tensor(reader& r)
{
  header::tensor_entry t;
  t.name   = r.str("tensor name");
  t.offset = r.get<std::uint64_t>("tensor offset");
  t.count  = r.get<std::uint64_t>("tensor count");
  t.group  = r.get<std::uint64_t>("tensor group");
  return t;
}

inline std::vector<float> read_floats(reader& r)
{
  auto const m = r.count("tensor state floats", 4);
  std::vector<float> values;
  values.reserve(m);
  for (std::uint64_t i = 0; i < m; ++i) { values.push_back(r.get<float>("tensor state value")); }
  return values;
}

/// Version 1's payload.
inline void decode_payload_v1(reader& r, header& h, std::string const& path)
{
  h.rule      = r.str("rule");
  h.precision = r.str("precision");
  h.step      = r.get<std::int64_t>("step");
  read_layout(r, h);
  auto const nslots = r.get<std::uint32_t>("slot count");
  if (nslots > r.left() / 8) {
    throw checkpoint_error(path, "header field slot count = " + std::to_string(nslots) + " is too large (corrupt)");
  }
  for (std::uint32_t i = 0; i < nslots; ++i) {
    header::slot_entry s;
    s.id            = r.get<std::uint32_t>("slot id");
    s.element_bytes = r.get<std::uint32_t>("slot element bytes");
    h.slots.push_back(std::move(s));
  }
  auto const ntensors = r.count("tensor count", 4 + 24);
  h.tensors.reserve(ntensors);
  for (std::uint64_t i = 0; i < ntensors; ++i) {
    header::tensor_entry t = read_tensor(r);
    t.step    = h.step;
    t.columns = t.count;
    h.tensors.push_back(std::move(t));
  }
  read_groups(r, h, path);
  h.shapes_recorded = r.left() != 0;
  h.dims_recorded   = false;
  if (r.left() != 0) {  // the tensor phase's state, with each tensor's shape
    auto const n = r.count("tensor state count", 24);
    for (std::uint64_t t = 0; t < n; ++t) {
      auto const rows    = r.get<std::uint64_t>("tensor state rows");
      auto const columns = r.get<std::uint64_t>("tensor state columns");
      if (t < h.tensors.size()) {
        h.tensors[t].rows    = rows;
        h.tensors[t].columns = columns;
      }
      h.tensor_states.push_back({read_floats(r)});
    }
  }
}

/// Version 2's payload: its sections, each checked to be read to its end.
inline void decode_payload(reader& r, header& h, std::string const& path)
{
  auto const count = r.get<std::uint32_t>("section count");
  std::vector<std::pair<std::uint64_t, bool>> dims;  // section "dims": each tensor's batches and vector flag
  std::array<bool, known_sections.size()> seen{};
  for (std::uint32_t i = 0; i < count; ++i) {
    auto const t     = r.get<std::uint32_t>("section tag");
    auto const flags = r.get<std::uint32_t>("section flags");
    auto const n     = r.get<std::uint64_t>("section length");
    reader s         = r.part(n, "section body");
    std::size_t k    = 0;
    while (k < known_sections.size() && known_sections[k] != t) { ++k; }
    if (k == known_sections.size()) {
      if ((flags & required_section) != 0) {
        throw checkpoint_error(path, "needs section \"" + tag_text(t) +
                                       "\", which this build does not know (saved by a newer tierstate)");
      }
      continue;  // an optional section of a later version
    }
    if (seen[k]) { throw checkpoint_error(path, "has section \"" + tag_text(t) + "\" twice (corrupt)"); }
    seen[k] = true;
    if (t == tag("rule")) {
      h.rule = s.str("rule");
      auto const m = s.get<std::uint32_t>("hyper-parameter count");
      if (m > s.left() / 4) { throw checkpoint_error(path, "header field hyper-parameter count is too large (corrupt)"); }
      for (std::uint32_t j = 0; j < m; ++j) { h.hyperparameter_names.push_back(s.str("hyper-parameter name")); }
    } else if (t == tag("prec")) {
      h.precision       = s.str("precision");
      auto const nslots = s.get<std::uint32_t>("slot count");
      if (nslots > s.left() / 20) {
        throw checkpoint_error(path, "header field slot count = " + std::to_string(nslots) + " is too large (corrupt)");
      }
      for (std::uint32_t j = 0; j < nslots; ++j) {
        header::slot_entry e;
        e.id            = s.get<std::uint32_t>("slot id");
        e.name          = s.str("slot name");
        e.codec         = s.str("slot codec");
        e.block         = s.get<std::uint32_t>("slot block elements");
        e.element_bytes = s.get<std::uint32_t>("slot block bytes");
        h.slots.push_back(std::move(e));
      }
    } else if (t == tag("layt")) {
      read_layout(s, h);
    } else if (t == tag("step")) {
      h.step = s.get<std::int64_t>("step");
    } else if (t == tag("tens")) {
      auto const ntensors = s.count("tensor count", 4 + 48);
      h.tensors.reserve(ntensors);
      for (std::uint64_t j = 0; j < ntensors; ++j) {
        header::tensor_entry e = read_tensor(s);
        e.step    = s.get<std::int64_t>("tensor step");
        e.rows    = s.get<std::uint64_t>("tensor rows");
        e.columns = s.get<std::uint64_t>("tensor columns");
        h.tensors.push_back(std::move(e));
      }
    } else if (t == tag("grps")) {
      read_groups(s, h, path);
    } else if (t == tag("dims")) {
      auto const n = s.count("dims tensor count", 9);
      for (std::uint64_t j = 0; j < n; ++j) {  // (applied once "tens", wherever it is, has been read)
        auto const batches = s.get<std::uint64_t>("tensor batches");
        auto const vector  = s.get<std::uint8_t>("tensor vector flag");
        if (vector > 1) { throw checkpoint_error(path, "a tensor's vector flag is " + std::to_string(vector) + " (corrupt)"); }
        dims.emplace_back(batches, vector != 0);
      }
    } else if (t == tag("parm")) {
      h.param_bytes = s.get<std::uint32_t>("param element bytes");
      auto const n  = s.count("param tensor count", 8);
      if (n == 0 || (h.param_bytes != 2 && h.param_bytes != 4)) {
        throw checkpoint_error(path, "section \"parm\" names " + std::to_string(n) + " tensors of " +
                                       std::to_string(h.param_bytes) + "-byte params (corrupt)");
      }
      for (std::uint64_t j = 0; j < n; ++j) {
        auto const tensor = s.get<std::uint64_t>("param tensor");
        if (!h.param_tensors.empty() && tensor <= h.param_tensors.back()) {
          throw checkpoint_error(path, "section \"parm\"'s tensors are not in ascending order (corrupt)");
        }
        h.param_tensors.push_back(tensor);
      }
    } else {  // "tphs"
      auto const ntensors = s.count("tensor state count", 8);
      for (std::uint64_t j = 0; j < ntensors; ++j) { h.tensor_states.push_back({read_floats(s)}); }
    }
    if (s.left() != 0) {
      throw checkpoint_error(path, std::to_string(s.left()) + " bytes follow the last field of section \"" +
                                     tag_text(t) + "\" (corrupt)");
    }
  }
  for (std::size_t k = 0; k < always_there; ++k) {
    if (!seen[k]) { throw checkpoint_error(path, "has no section \"" + tag_text(known_sections[k]) + "\" (corrupt)"); }
  }
  h.dims_recorded = seen[7];
  if (!h.param_tensors.empty() && h.param_tensors.back() >= h.tensors.size()) {
    throw checkpoint_error(path, "section \"parm\" names tensor " + std::to_string(h.param_tensors.back()) +
                                   " of " + std::to_string(h.tensors.size()) + " (corrupt)");
  }
  if (h.dims_recorded) {  // "tens" counted every batch's rows
    if (dims.size() != h.tensors.size()) {
      throw checkpoint_error(path, "section \"dims\" has " + std::to_string(dims.size()) + " tensors and section \"tens\" " +
                                     std::to_string(h.tensors.size()) + " (corrupt)");
    }
    for (std::size_t j = 0; j < dims.size(); ++j) {
      h.tensors[j].batches = dims[j].first;
      h.tensors[j].vector  = dims[j].second;
    }
    for (auto& e : h.tensors) {
      if (e.batches == 0 || e.rows % e.batches != 0) {  // (the optimizer checks the rest of a shape)
        throw checkpoint_error(path, "tensor '" + e.name + "' has " + std::to_string(e.rows) + " rows in " +
                                       std::to_string(e.batches) + " batches (corrupt)");
      }
      e.rows /= e.batches;
    }
  }
}

}  // namespace detail
}  // namespace tierstate::checkpoint
