// SPDX-License-Identifier: Apache-2.0
// The device routes' events (core/trace.hpp): work queued on a device stream is timed by the
// stream itself. open() queues a mark (device::launch_host_func) that reads the clock when the
// stream reaches it, the work queued before it done; close() queues one that records the event
// when the work queued between the two is done. The times are the stream's, not the queuing
// thread's: an event spans the stream's work from the first copy or kernel queued after open()
// to the last before close(), and any gap while the host was still queuing them (open() right
// before the first, as the routes do, keeps that small).
//
// Cost. With no tracer attached (or TIERSTATE_TRACE=0), nothing is queued. With one, two host
// functions per event on the stream (a few microseconds each on CUDA, where the stream waits
// for them), and one small allocation that the closing mark frees. A stream that fails before
// its marks run (CUDA's sticky errors) may never run them: that event, and its allocation, are
// lost. The routes synchronize every stream they mark before a step returns or throws, so no
// mark outlives the step (and the tracer may go once it has).
#pragma once

#include <tierstate/core/device_runtime.hpp>
#include <tierstate/core/trace.hpp>

#include <cstdint>

namespace tierstate::inline TIERSTATE_ABI::detail {

class stream_span {
 public:
  /// An event of `phase` of `chunk` on stream `s`, on the stream's track; nothing is queued yet.
  stream_span(tracer* t, device::stream_view s, trace_phase phase, std::int64_t chunk,
              tracer::device_stream track) noexcept
    : t_(trace_compiled ? t : nullptr), s_(s), phase_(phase), chunk_(chunk), track_(tracer::device_track(track))
  {
  }
  stream_span(stream_span const&)            = delete;
  stream_span& operator=(stream_span const&) = delete;
  /// A span opened and never closed (a leg threw first) closes here, recording what ran.
  ~stream_span()
  {
    try {
      close(0);
    } catch (...) {  // the stream's failure is reported by whoever synchronizes with it
    }
  }

  /// Starts the event where the stream is now (at once before the first work of it is queued);
  /// again, nothing. No-op without a tracer.
  void open()
  {
    if (t_ == nullptr || p_ != nullptr) [[likely]] { return; }
    auto* const p = new pending{t_, phase_, chunk_, 0, track_, {}};
    try {
      device::launch_host_func(s_, &pending::opened, p);
    } catch (...) {
      delete p;  // (not queued)
      throw;
    }
    p_ = p;
  }

  /// Ends the event after the work queued on the stream so far; `bytes` it moved or updated.
  /// Nothing where it was never opened.
  void close(std::uint64_t bytes)
  {
    if (p_ == nullptr) [[likely]] { return; }
    pending* const p = p_;
    p_               = nullptr;
    p->bytes         = bytes;  // (written before the queuing, which orders it before the mark runs)
    device::launch_host_func(s_, &pending::closed, p);  // (if this throws, p is leaked: its open mark may still run)
  }

 private:
  struct pending {
    tracer* t;
    trace_phase phase;
    std::int64_t chunk;
    std::uint64_t bytes;
    std::uint32_t track;
    tracer::clock::time_point begin;

    static void opened(void* a) noexcept { static_cast<pending*>(a)->begin = tracer::clock::now(); }
    static void closed(void* a) noexcept
    {
      auto* const p = static_cast<pending*>(a);
      p->t->record(p->phase, p->chunk, p->bytes, p->begin, tracer::clock::now(), p->track);
      delete p;
    }
  };
  tracer* t_;
  device::stream_view s_;
  trace_phase phase_;
  std::int64_t chunk_;
  std::uint32_t track_;
  pending* p_ = nullptr;
};

}  // namespace tierstate::detail
