// SPDX-License-Identifier: Apache-2.0
// checkpoint_error: what a checkpoint that cannot be used throws.
#pragma once

#include <tierstate/core/config.hpp>

#include <stdexcept>
#include <string>
#include <utility>

namespace tierstate::inline TIERSTATE_ABI {

/// A checkpoint that cannot be used: corrupt, truncated, of another format, or saved from a
/// different optimizer. what() names the file and what was wrong (which chunk, which field,
/// which difference).
class checkpoint_error : public std::runtime_error {
 public:
  checkpoint_error(std::string path, std::string const& what)
    : std::runtime_error(describe(path, what)), path_(std::move(path))
  {
  }
  [[nodiscard]] std::string const& path() const noexcept { return path_; }

 private:
  static std::string describe(std::string const& path, std::string const& what)
  {
    std::string text = "tierstate: checkpoint ";
    text.append(path).append(": ").append(what);
    return text;
  }
  std::string path_;
};

}  // namespace tierstate
