// SPDX-License-Identifier: Apache-2.0
// The once-per-run notice that a step mostly waits for its state's I/O: after a few steps
// of warm-up, when waiting for the tier (reads not yet landed, the last writes) has been over
// half of each of several steps in a row, the optimizer says so once per process
// (core/notice.hpp, key "io_bound"), with the numbers and what helps. Waiting is what a step
// over NvmeFile is expected to do on a slow disk; the notice is for the user who did not know.
#pragma once

#include <tierstate/core/notice.hpp>
#include <tierstate/core/stats.hpp>

#include <cstdio>
#include <string>

namespace tierstate::inline TIERSTATE_ABI::detail {

class io_watch {
 public:
  static constexpr int warm_up = 3;       ///< steps not judged (the first reads, page faults)
  static constexpr int in_a_row = 8;      ///< steps over the share before the notice
  static constexpr double share = 0.5;    ///< of the step's time, waiting

  /// One step's stats (a step that moved no tier bytes, or was skipped, is not judged).
  /// Never throws: the step it judges is done (a notice that cannot be told is dropped).
  void observe(step_stats const& s, std::string_view tier_name) noexcept
  {
    try {
      judge(s, tier_name);
    } catch (...) {
      told_ = true;
    }
  }

 private:
  void judge(step_stats const& s, std::string_view tier_name)
  {
    if (told_ || s.total_seconds <= 0 || s.tier_bytes_read + s.tier_bytes_written == 0) { return; }
    if (++seen_ <= warm_up) { return; }
    if (s.wait_seconds <= share * s.total_seconds) {
      run_  = 0;
      wait_ = total_ = bytes_ = 0;
      return;
    }
    wait_ += s.wait_seconds;
    total_ += s.total_seconds;
    bytes_ += static_cast<double>(s.tier_bytes_read + s.tier_bytes_written);
    if (++run_ < in_a_row) { return; }
    char text[512];
    std::snprintf(text, sizeof text,
                  "the optimizer step waits for its state's I/O (%s) %.0f%% of the time (%d steps in a row, "
                  "%.2f GB/s moved while stepping): the step is I/O-bound. A faster disk or several (a RAID 0), "
                  "a deeper Pipelined<Depth>, 8-bit state (fewer bytes), or the state in host memory "
                  "(PinnedHost) where it fits would help; a trace (core/trace.hpp) shows where it waits",
                  std::string(tier_name).c_str(), 100.0 * wait_ / total_, run_, bytes_ / total_ / 1e9);
    told_ = true;
    (void)notify_once("io_bound", text);
  }

  int seen_     = 0;
  int run_      = 0;
  double wait_  = 0;
  double total_ = 0;
  double bytes_ = 0;
  bool told_    = false;
};

}  // namespace tierstate::detail
