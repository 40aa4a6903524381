// SPDX-License-Identifier: Apache-2.0
// A user's tier with no read(): the `tier` concept names the missing expression.
// expect: ct.read(offset, to)
#include <tierstate/tierstate.hpp>

struct NoRead {
  static constexpr char const* name = "no_read";
  struct options {};
  NoRead(std::size_t, options const&) {}
  [[nodiscard]] std::size_t size() const { return 0; }
  void write(std::size_t, std::span<std::byte const>) {}
};

using Opt = tierstate::OffloadedOptimizer<tierstate::AdamW, tierstate::Bf16Mixed, NoRead>;
static_assert(sizeof(Opt) > 0);
