// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <map>
#include <mutex>
#include <string>
#include <system_error>
#include <utility>

#include <pthread.h>
#include <sched.h>

namespace tierstate::inline TIERSTATE_ABI {

inline std::size_t available_cpus() noexcept
{
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    int const n = CPU_COUNT(&set);
    if (n > 0) { return static_cast<std::size_t>(n); }
  }
  unsigned const hw = std::thread::hardware_concurrency();
  return hw > 0 ? hw : 1;
}

namespace detail {

/// The CPUs of the affinity mask, ascending (empty where it cannot be read).
inline std::vector<int> allowed_cpus()
{
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> out;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (CPU_ISSET(c, &set)) { out.push_back(c); }
    }
  }
  return out;
}

/// The order workers are bound in: one CPU per physical core first (physical_core_cpus), then
/// the cores' other CPUs (their SMT siblings), so a pool larger than the cores fills every
/// allowed CPU before any CPU gets two workers.
inline std::vector<int> binding_order()
{
  std::vector<int> order = physical_core_cpus();
  for (int c : allowed_cpus()) {
    if (std::find(order.begin(), order.end(), c) == order.end()) { order.push_back(c); }
  }
  return order;
}

}  // namespace detail

inline std::vector<int> physical_core_cpus()
{
  std::vector<int> const allowed = detail::allowed_cpus();
  if (allowed.empty()) { return {}; }
  // A core is the set of CPUs that share it (thread_siblings_list: unique per core, where
  // package and core ids repeat across the dies of some parts); an unreadable one is a core.
  auto siblings = [](int cpu) -> std::string {
    char path[112];
    std::snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu%d/topology/thread_siblings_list", cpu);
    std::FILE* f = std::fopen(path, "re");
    if (f == nullptr) { return "cpu" + std::to_string(cpu); }
    char text[256] = {};
    bool const ok  = std::fgets(text, sizeof text, f) != nullptr;
    std::fclose(f);
    return ok ? std::string(text) : "cpu" + std::to_string(cpu);
  };
  std::map<std::string, int> cores;
  for (int c : allowed) { cores.emplace(siblings(c), c); }  // (allowed is ascending: the first is the lowest)
  std::vector<int> out;
  for (auto const& [key, cpu] : cores) { out.push_back(cpu); }
  std::sort(out.begin(), out.end());
  return out;
}

struct thread_pool::state {
  std::size_t size = 1;
  std::vector<std::thread> workers;
  std::vector<int> cpus;  ///< each thread's CPU (-1: not bound); [0] the caller's

  std::mutex call_mutex;  // one job at a time

  std::mutex mutex;
  std::condition_variable start;
  std::condition_variable done;
  std::size_t generation = 0;
  std::size_t pending    = 0;
  bool stopping          = false;

  // The job being run (valid while pending > 0).
  std::function<void(std::size_t, std::size_t)> const* job = nullptr;
  std::size_t parts = 0;
  std::size_t n     = 0;
  std::size_t grain = 1;
  std::exception_ptr error;

  /// [begin, end) of part p of `parts`, boundaries rounded to the grain.
  [[nodiscard]] std::pair<std::size_t, std::size_t> range(std::size_t p) const noexcept
  {
    std::size_t const units = (n + grain - 1) / grain;
    std::size_t const b     = std::min(n, (units * p / parts) * grain);
    std::size_t const e     = std::min(n, (units * (p + 1) / parts) * grain);
    return {b, e};
  }

  void run_part(std::size_t p) noexcept
  {
    auto const [b, e] = range(p);
    if (b >= e) { return; }
    try {
      (*job)(b, e);
    } catch (...) {
      std::lock_guard lock(mutex);
      if (!error) { error = std::current_exception(); }
    }
  }

  void worker_loop(std::size_t index)
  {
    std::size_t seen = 0;
    for (;;) {
      {
        std::unique_lock lock(mutex);
        start.wait(lock, [&] { return stopping || generation != seen; });
        if (stopping) { return; }
        seen = generation;
      }
      if (index < parts) { run_part(index); }
      {
        std::lock_guard lock(mutex);
        if (--pending == 0) { done.notify_one(); }
      }
    }
  }
};

inline thread_pool::thread_pool(std::size_t threads, thread_binding binding) : state_(std::make_unique<state>())
{
  if (threads > 4096) {
    throw invalid_option("thread_pool.threads", detail::to_text(threads),
                         "at most 4096 threads (0 means the CPUs of the affinity mask)");
  }
  std::vector<int> const cores = binding == thread_binding::physical_cores ? detail::binding_order() : std::vector<int>{};
  std::size_t const physical   = binding == thread_binding::physical_cores ? physical_core_cpus().size() : 0;
  state_->size = threads != 0 ? threads : physical != 0 ? physical : available_cpus();
  state_->cpus.assign(state_->size, -1);
  state_->workers.reserve(state_->size - 1);
  try {
    for (std::size_t i = 1; i < state_->size; ++i) {
      state_->workers.emplace_back([s = state_.get(), i] { s->worker_loop(i); });
      if (!cores.empty()) {
        int const cpu = cores[i % cores.size()];
        cpu_set_t one;
        CPU_ZERO(&one);
        CPU_SET(cpu, &one);
        int const err = pthread_setaffinity_np(state_->workers.back().native_handle(), sizeof(one), &one);
        if (err != 0) {
          throw std::system_error(err, std::generic_category(),
                                  "tierstate: binding a worker thread to CPU " + std::to_string(cpu) +
                                    " (thread_binding::physical_cores)");
        }
        state_->cpus[i] = cpu;
      }
    }
  } catch (...) {
    {
      std::lock_guard lock(state_->mutex);
      state_->stopping = true;
    }
    state_->start.notify_all();
    for (auto& t : state_->workers) { t.join(); }
    throw;
  }
}

inline thread_pool::~thread_pool()
{
  {
    std::lock_guard lock(state_->mutex);
    state_->stopping = true;
  }
  state_->start.notify_all();
  for (auto& t : state_->workers) { t.join(); }
}

inline std::size_t thread_pool::size() const noexcept { return state_->size; }

inline std::vector<int> thread_pool::bound_cpus() const { return state_->cpus; }

inline void thread_pool::run(std::size_t parts, std::size_t n, std::size_t grain,
                             std::function<void(std::size_t, std::size_t)> const& job)
{
  std::lock_guard call(state_->call_mutex);
  state& s = *state_;
  {
    std::lock_guard lock(s.mutex);
    s.job     = &job;
    s.parts   = parts;
    s.n       = n;
    s.grain   = grain;
    s.error   = nullptr;
    s.pending = s.workers.size();
    ++s.generation;
  }
  if (!s.workers.empty()) { s.start.notify_all(); }
  s.run_part(0);
  std::exception_ptr error;
  {
    std::unique_lock lock(s.mutex);
    s.done.wait(lock, [&] { return s.pending == 0; });
    s.job = nullptr;
    error = std::exchange(s.error, nullptr);
  }
  if (error) { std::rethrow_exception(error); }
}

template <class F>
void thread_pool::parallel_for(std::size_t n, std::size_t grain, F&& f)
{
  TIERSTATE_EXPECTS(grain > 0, "thread_pool::parallel_for: grain must be > 0");
  if (n == 0) { return; }
  std::size_t const units = (n + grain - 1) / grain;
  std::size_t const parts = std::min(size(), units);
  if (parts <= 1) {
    f(std::size_t{0}, n);
    return;
  }
  std::function<void(std::size_t, std::size_t)> const job = std::ref(f);
  run(parts, n, grain, job);
}

}  // namespace tierstate
