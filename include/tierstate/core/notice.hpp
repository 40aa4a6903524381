// SPDX-License-Identifier: Apache-2.0
// Notices: things the library tells its user once, without failing (a fallback it took).
//
// By default a notice is written to stderr as "tierstate: <text>". A program that has its
// own log (a trainer, a PyTorch extension) installs a handler instead. Each notice has a
// key, and a key is told once per process: a fallback taken by a thousand tiers is one line.
//
// Thread safety: all functions may be called from any thread.
#pragma once

#include <tierstate/core/config.hpp>

#include <cstdio>
#include <functional>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <utility>

namespace tierstate::inline TIERSTATE_ABI {

using notice_handler = std::function<void(std::string_view key, std::string_view text)>;

namespace detail {

struct notice_registry {
  std::mutex mutex;
  std::set<std::string, std::less<>> told;
  notice_handler handler;
};

inline notice_registry& notices()
{
  static notice_registry r;
  return r;
}

}  // namespace detail

/// Replaces the handler (an empty one restores stderr); returns the previous one.
inline notice_handler set_notice_handler(notice_handler h)
{
  auto& r = detail::notices();
  std::scoped_lock lock(r.mutex);
  return std::exchange(r.handler, std::move(h));
}

/// Tells `text` unless a notice with this key was told before. Returns whether it was told.
inline bool notify_once(std::string_view key, std::string const& text)
{
  auto& r = detail::notices();
  std::scoped_lock lock(r.mutex);
  if (!r.told.emplace(key).second) { return false; }
  if (r.handler) {
    r.handler(key, text);
  } else {
    std::fprintf(stderr, "tierstate: %s\n", text.c_str());
  }
  return true;
}

/// Forgets which keys were told (for tests that check a notice appears).
inline void reset_notices()
{
  auto& r = detail::notices();
  std::scoped_lock lock(r.mutex);
  r.told.clear();
}

}  // namespace tierstate
