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

/// One CPU per physical core of the affinity mask: for each core (the CPUs that share it,
/// /sys/devices/system/cpu/cpuN/topology/thread_siblings_list), the lowest CPU of it that the
/// process may run on; in CPU order. Where the topology cannot be read, every allowed CPU
/// counts as a core. Empty where the affinity mask cannot be read.
[[nodiscard]] std::vector<int> physical_core_cpus();

/// How a thread pool places its own threads (never the caller's).
enum class thread_binding : std::uint8_t {
  none,            ///< where the kernel puts them (the default)
  /// Worker i (1, 2, ...) on the i-th CPU of the order: one CPU per physical core
  /// (physical_core_cpus), then the cores' SMT siblings, then around again. With at most as
  /// many threads as cores, each has a core of its own and the first is left to the caller;
  /// threads = 0 means one per core. Every process binds alike: ranks that share a node
  /// should each get their own affinity mask (taskset, numactl, the launcher's binding).
  physical_cores,
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
