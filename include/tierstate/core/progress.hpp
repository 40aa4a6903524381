// SPDX-License-Identifier: Apache-2.0
// Progress of the long operations: making the state of a large model (its first step, or
// the first call that needs the state), saving and loading a checkpoint. An optional
// callback hears (what, bytes done, bytes total) after each chunk, so a trainer can draw a
// bar over a 70B model's minutes of I/O (tierstate_torch draws one with tqdm).
#pragma once

#include <tierstate/core/config.hpp>

#include <cstdint>
#include <functional>
#include <string_view>

namespace tierstate::inline TIERSTATE_ABI {

/// What is making progress.
enum class progress_phase : std::uint8_t {
  make_state,  ///< the state made: each chunk's master filled from the params and written
  save,        ///< a checkpoint written (every byte of the file)
  verify,      ///< a checkpoint's chunks read and checked before a load changes anything
  load,        ///< a checkpoint's chunks read into the state
};

[[nodiscard]] constexpr std::string_view to_string(progress_phase p) noexcept
{
  constexpr std::string_view names[] = {"make_state", "save", "verify", "load"};
  return names[static_cast<std::size_t>(p)];
}

/// Called on the thread doing the work, after each chunk (done < total), and once with done ==
/// total at the end of each phase. It should return quickly. An exception it throws ends the
/// operation as a failed I/O would at that point: a save leaves no file, the state is not
/// made, a load's verify pass changes nothing; in a load's second pass the state is lost.
using progress_callback = std::function<void(progress_phase phase, std::uint64_t done, std::uint64_t total)>;

}  // namespace tierstate
