// SPDX-License-Identifier: Apache-2.0
// Worker threads: the host kernels' and the I/O engines'.
#pragma once

#include <tierstate/core/error.hpp>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

namespace tierstate::inline TIERSTATE_ABI {

/// The CPUs this process may run on (its affinity mask), at least 1.
[[nodiscard]] std::size_t available_cpus() noexcept;

/// One CPU per physical core of the affinity mask: for each core (a package's core_id, from
/// /sys/devices/system/cpu/cpuN/topology), the lowest CPU of it that the process may run on;
/// in CPU order. Where the topology cannot be read, every allowed CPU counts as a core.
[[nodiscard]] std::vector<int> physical_core_cpus();

/// How a thread pool places its own threads (never the caller's).
enum class thread_binding : std::uint8_t {
  none,            ///< where the kernel puts them (the default)
  physical_cores,  ///< worker i on physical_core_cpus()[i % cores]: one per physical core,
                   ///< the first core left to the caller; threads = 0 then means one per core
};

/// A fixed set of std::threads that run one range-splitting job at a time.
///
/// `parallel_for` is safe to call from several threads at once: calls are serialized, and
/// each blocks until its whole range is done. The calling thread runs the first part
/// itself, so a pool of size 1 starts no thread at all.
class thread_pool {
 public:
  /// `threads` workers in all, the caller included; 0 means available_cpus() (one per
  /// physical core with thread_binding::physical_cores). Throws tierstate::invalid_option
  /// above 4096; a binding the kernel refuses (a CPU taken away since) throws
  /// std::system_error naming the CPU, before any thread is left running.
  explicit thread_pool(std::size_t threads = 0, thread_binding binding = thread_binding::none);
  ~thread_pool();

  thread_pool(thread_pool const&)            = delete;
  thread_pool& operator=(thread_pool const&) = delete;

  /// Threads that work on a job, the caller included.
  [[nodiscard]] std::size_t size() const noexcept;
  /// The CPU each thread is bound to, the caller's first (always -1: never bound); -1 for
  /// a thread left to the kernel.
  [[nodiscard]] std::vector<int> bound_cpus() const;

  /// Calls f(begin, end) on disjoint parts that cover [0, n), in parallel, and returns when
  /// all are done. Every boundary between parts is a multiple of `grain` (> 0), so each
  /// part starts at a chosen alignment. Fewer parts than threads are used when n is small.
  /// The first exception thrown by f is rethrown here, after every part has finished.
  template <class F>
  void parallel_for(std::size_t n, std::size_t grain, F&& f);

 private:
  struct state;
  void run(std::size_t parts, std::size_t n, std::size_t grain,
           std::function<void(std::size_t, std::size_t)> const& job);

  std::unique_ptr<state> state_;
};

}  // namespace tierstate

#include <tierstate/core/detail/thread_pool.inl>
