// SPDX-License-Identifier: Apache-2.0
// tracer's definitions: the event ring, the JSON writer, the file.
#pragma once

#include <tierstate/io/error.hpp>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <map>
#include <ostream>
#include <sstream>
#include <string>

#include <fcntl.h>
#include <unistd.h>

namespace tierstate::inline TIERSTATE_ABI {

inline tracer::tracer(std::size_t capacity, clock::time_point origin) : capacity_(capacity), origin_(origin)
{
  if (capacity == 0 || capacity > (std::size_t{1} << 28)) {
    throw invalid_option("tracer.capacity", std::to_string(capacity),
                         "a tracer holds 1 to 2^28 events (40 bytes each), allocated when it is made");
  }
  events_ = std::make_unique<trace_event[]>(capacity);
}

inline void tracer::record(trace_phase phase, std::int64_t chunk, std::uint64_t bytes, clock::time_point begin,
                           clock::time_point end, std::uint32_t track) noexcept
{
  std::uint64_t const i = next_.fetch_add(1, std::memory_order_relaxed);
  if (i >= capacity_) { return; }  // full: counted by dropped()
  auto const ns = [&](clock::time_point t) {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(t - origin_).count();
  };
  events_[i] = {ns(begin), ns(end), bytes, chunk, track, phase};
}

inline std::uint32_t tracer::this_thread_track() noexcept
{
  thread_local std::uint32_t const track = static_cast<std::uint32_t>(::gettid());
  return track;
}

inline std::span<trace_event const> tracer::events() const noexcept
{
  auto const n = std::min<std::uint64_t>(next_.load(std::memory_order_acquire), capacity_);
  return {events_.get(), static_cast<std::size_t>(n)};
}

inline std::uint64_t tracer::dropped() const noexcept
{
  auto const n = next_.load(std::memory_order_acquire);
  return n > capacity_ ? n - capacity_ : 0;
}

inline void tracer::clear() noexcept { next_.store(0, std::memory_order_release); }

inline void tracer::write_chrome_json(std::ostream& out) const
{
  auto const evs = events();
  // Each track's name: an I/O staging buffer; the thread that ran steps; a worker.
  std::map<std::uint32_t, bool> tracks;  // track -> ran a step
  for (auto const& e : evs) { tracks[e.track] = tracks[e.track] || e.phase == trace_phase::step; }
  char line[320];
  auto const us = [](std::int64_t ns) { return static_cast<double>(ns) / 1000.0; };
  out << "{\"displayTimeUnit\":\"ms\",\"otherData\":{\"library\":\"tierstate " TIERSTATE_VERSION_STRING
         "\",\"dropped_events\":"
      << dropped() << "},\"traceEvents\":[\n";
  out << R"({"name":"process_name","ph":"M","pid":1,"tid":0,"args":{"name":"tierstate optimizer"}})";
  for (auto const& [track, stepped] : tracks) {
    // (Appended: GCC 12 warns falsely, -Wrestrict, on "literal" + string.)
    std::string name;
    unsigned sort = 0;  // the step's thread first, then workers, the I/O buffers, the device's streams
    if (track >= device_track_base) {
      constexpr char const* streams[] = {"device stream: to device", "device stream: from device", "device stream: compute"};
      name = track - device_track_base < 3 ? streams[track - device_track_base] : "device stream";
      sort = (3u << 22) + (track - device_track_base);
    } else if (track >= io_track_base) {
      name = "I/O, staging buffer ";
      name.append(std::to_string(track - io_track_base));
      sort = (2u << 22) + (track - io_track_base);
    } else {
      name = stepped ? "step thread " : "worker thread ";
      name.append(std::to_string(track));
      sort = (stepped ? 0u : 1u << 22) + track;
    }
    std::snprintf(line, sizeof line,
                  ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":1,\"tid\":%" PRIu32
                  ",\"args\":{\"name\":\"%s\"}},\n{\"name\":\"thread_sort_index\",\"ph\":\"M\",\"pid\":1,\"tid\":%" PRIu32
                  ",\"args\":{\"sort_index\":%u}}",
                  track, name.c_str(), track, sort);
    out << line;
  }
  for (auto const& e : evs) {
    auto const cat = e.phase == trace_phase::read || e.phase == trace_phase::write ? "io"
                     : e.track >= device_track_base                                   ? "device"
                     : e.chunk >= 0                                                   ? "chunk"
                                                                                      : "step";
    std::snprintf(line, sizeof line,
                  ",\n{\"name\":\"%.*s\",\"cat\":\"%s\",\"ph\":\"X\",\"pid\":1,\"tid\":%" PRIu32
                  ",\"ts\":%.3f,\"dur\":%.3f,\"args\":{\"chunk\":%" PRId64 ",\"bytes\":%" PRIu64 "}}",
                  static_cast<int>(to_string(e.phase).size()), to_string(e.phase).data(), cat, e.track,
                  us(e.begin_ns), us(std::max<std::int64_t>(e.end_ns - e.begin_ns, 0)), e.chunk, e.bytes);
    out << line;
  }
  out << "\n]}\n";
}

inline void tracer::save(std::filesystem::path const& path) const
{
  std::ostringstream text;
  write_chrome_json(text);
  std::string const s = text.str();
  // Written beside `path` under a temporary name, then renamed over it: a failure leaves
  // whatever was at `path` as it was, and no temporary.
  std::string const temp = path.string() + ".tmp" + std::to_string(::getpid());
  int const fd           = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) { throw io_error(errno, path.string(), "open for the trace"); }
  auto fail = [&](int err, char const* what, std::uint64_t offset = 0, std::uint64_t length = 0) {
    ::unlink(temp.c_str());
    throw io_error(err, path.string(), what, offset, length);
  };
  std::size_t done = 0;
  while (done < s.size()) {
    ssize_t const n = ::write(fd, s.data() + done, s.size() - done);
    if (n < 0 && errno == EINTR) { continue; }
    if (n <= 0) {
      int const err = n < 0 ? errno : EIO;
      ::close(fd);
      fail(err, "write of the trace", done, s.size() - done);
    }
    done += static_cast<std::size_t>(n);
  }
  if (::close(fd) != 0) { fail(errno, "close of the trace"); }
  if (::rename(temp.c_str(), path.c_str()) != 0) { fail(errno, "rename of the trace"); }
}

}  // namespace tierstate
