// SPDX-License-Identifier: Apache-2.0
// The step's timeline: an opt-in tracer that records each phase of each chunk (its state read
// from the tier, the wait for that read, its gradients gathered, its update on every thread,
// its state written back) and the step's own phases (the step, its checks and clipping, a
// rule's per-tensor reduce), with the bytes each moved, on the thread or staging buffer that
// did it; on the device routes, each chunk's copies and kernel on the device's streams, timed
// by the streams (core/detail/stream_trace.hpp). Written as Chrome trace-event JSON, which
// Perfetto (ui.perfetto.dev) and chrome://tracing open; bench/trace_png.py draws one step of
// it as a PNG.
//
// Cost. An optimizer with no tracer attached (the default) tests one pointer per leg and
// reads no clock it would not read anyway; a tracer attached costs one atomic increment and
// one 40-byte store per event (a device stream's event also two host functions on the stream
// and a small allocation). A build with TIERSTATE_TRACE defined to 0 compiles the tracing out
// altogether (and names its ABI namespace apart: core/config.hpp).
//
// Threads. record() may be called from any thread at once. events(), write_chrome_json()
// and clear() must not overlap a step that records into the same tracer: call them between
// steps (a step's return orders every event it recorded before it). A full tracer drops the
// events that do not fit and counts them (dropped()); it never allocates after construction.
#pragma once

#include <tierstate/core/config.hpp>
#include <tierstate/core/error.hpp>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <iosfwd>
#include <memory>
#include <span>
#include <string_view>

namespace tierstate::inline TIERSTATE_ABI {

/// Whether this build records traces at all (TIERSTATE_TRACE, 1 unless defined to 0).
inline constexpr bool trace_compiled = TIERSTATE_TRACE != 0;

/// What an event timed.
enum class trace_phase : std::uint8_t {
  step,        ///< one step() (or a delayed or streaming step's update), whole
  check,       ///< the gradients' non-finite check, norm and clipping
  reduce,      ///< a rule's per-tensor statistics before its update (Adafactor)
  read,        ///< a chunk's state read from its tier into a staging buffer
  read_wait,   ///< the step's thread waiting for that read
  grads,       ///< the chunk's gradients gathered (from a param source, or off the device)
  compute,     ///< the rule over the chunk, by every thread (on the step's thread)
  kernel,      ///< one thread's part of a chunk's update
  write,       ///< a chunk's state written back to its tier
  write_wait,  ///< the step's thread waiting for the last writes
  save,        ///< a checkpoint written
  load,        ///< a checkpoint read
  to_device,   ///< a chunk's copies host to device, on the device's stream (params, or state)
  from_device, ///< a chunk's copies device to host, on the device's stream (gradients, or state)
  device_compute,  ///< the rule over a chunk on the device, on its compute stream
};

/// The phase's name in the JSON ("read", "compute", ...).
[[nodiscard]] constexpr std::string_view to_string(trace_phase p) noexcept
{
  constexpr std::string_view names[] = {"step",    "check",     "reduce",     "read",        "read_wait",
                                        "grads",   "compute",   "kernel",     "write",       "write_wait",
                                        "save",    "load",      "to_device",  "from_device", "device_compute"};
  return names[static_cast<std::size_t>(p)];
}

/// One recorded interval. Times are nanoseconds from the tracer's construction.
struct trace_event {
  std::int64_t begin_ns = 0;
  std::int64_t end_ns   = 0;
  std::uint64_t bytes   = 0;   ///< bytes the phase moved or updated (0: none named)
  std::int64_t chunk    = -1;  ///< the chunk (-1: a phase of the whole step)
  std::uint32_t track   = 0;   ///< a thread (this_thread_track), a staging buffer (io_track) or a device stream (device_track)
  trace_phase phase     = trace_phase::step;
};

class tracer {
 public:
  using clock = std::chrono::steady_clock;

  /// Room for `capacity` events (40 bytes each), allocated now; times count from `origin`.
  /// Throws tierstate::invalid_option when capacity is 0 or above 2^28.
  explicit tracer(std::size_t capacity = std::size_t{1} << 20, clock::time_point origin = clock::now());

  /// Records [begin, end) of `phase`. Thread-safe; never throws, never allocates.
  void record(trace_phase phase, std::int64_t chunk, std::uint64_t bytes, clock::time_point begin,
              clock::time_point end, std::uint32_t track) noexcept;
  void record(trace_phase phase, std::int64_t chunk, std::uint64_t bytes, clock::time_point begin,
              clock::time_point end) noexcept
  {
    record(phase, chunk, bytes, begin, end, this_thread_track());
  }

  /// The calling thread's track: its Linux thread id (gettid), as perf and Nsight name it.
  [[nodiscard]] static std::uint32_t this_thread_track() noexcept;
  /// The track of staging buffer `buffer`'s reads and writes, which the I/O thread runs
  /// several at once (one per buffer at a time); above every thread id (2^22 at most).
  [[nodiscard]] static constexpr std::uint32_t io_track(unsigned buffer) noexcept { return io_track_base + buffer; }
  static constexpr std::uint32_t io_track_base = 1u << 31;
  /// The device's streams, as the device routes use them: each its own track, the time its work
  /// ran (marked on the stream itself: core/detail/stream_trace.hpp).
  enum class device_stream : std::uint32_t { to_device, from_device, compute };
  [[nodiscard]] static constexpr std::uint32_t device_track(device_stream s) noexcept
  {
    return device_track_base + static_cast<std::uint32_t>(s);
  }
  static constexpr std::uint32_t device_track_base = io_track_base + (1u << 24);

  /// The events recorded so far, in the order their slots were taken (not sorted by time).
  [[nodiscard]] std::span<trace_event const> events() const noexcept;
  /// Events that did not fit.
  [[nodiscard]] std::uint64_t dropped() const noexcept;
  [[nodiscard]] std::size_t capacity() const noexcept { return capacity_; }
  /// The time the events' nanoseconds count from.
  [[nodiscard]] clock::time_point origin() const noexcept { return origin_; }
  /// Forgets every event (the time origin stays).
  void clear() noexcept;

  /// Writes the events as Chrome trace-event JSON: complete ("X") events in microseconds, a
  /// thread_name for each track (the step's thread, workers, I/O staging buffers), and
  /// "otherData" with the dropped count.
  void write_chrome_json(std::ostream& out) const;
  /// The same into the file `path` (written beside it, then renamed over it). Throws
  /// tierstate::io_error naming the path when it cannot be written; a failure leaves what was
  /// at `path` as it was, and nothing else.
  void save(std::filesystem::path const& path) const;

 private:
  std::size_t capacity_;
  std::unique_ptr<trace_event[]> events_;
  std::atomic<std::uint64_t> next_{0};
  clock::time_point origin_;
};

namespace detail {

/// Times one phase into a tracer, if there is one: the span from construction to destruction
/// (or to done()). With no tracer, it reads no clock.
class trace_scope {
 public:
  trace_scope(tracer* t, trace_phase phase, std::int64_t chunk = -1, std::uint64_t bytes = 0) noexcept
    : t_(trace_compiled ? t : nullptr), phase_(phase), chunk_(chunk), bytes_(bytes)
  {
    if (t_ != nullptr) [[unlikely]] { begin_ = tracer::clock::now(); }
  }
  ~trace_scope() { done(); }
  trace_scope(trace_scope const&)            = delete;
  trace_scope& operator=(trace_scope const&) = delete;

  void done() noexcept
  {
    if (t_ != nullptr) [[unlikely]] {
      t_->record(phase_, chunk_, bytes_, begin_, tracer::clock::now());
      t_ = nullptr;
    }
  }

 private:
  tracer* t_;
  trace_phase phase_;
  std::int64_t chunk_;
  std::uint64_t bytes_;
  tracer::clock::time_point begin_{};
};

/// `t`, or null in a build that compiles tracing out (so every `if (trace)` folds away).
[[nodiscard]] inline tracer* traced(tracer* t) noexcept
{
  if constexpr (trace_compiled) {
    return t;
  } else {
    (void)t;
    return nullptr;
  }
}

}  // namespace detail
}  // namespace tierstate

#include <tierstate/core/detail/trace.inl>
