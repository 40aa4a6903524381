// SPDX-License-Identifier: Apache-2.0
// PinnedHost: optimizer state in host memory, the ZeRO-Offload placement.
//
// The memory is anonymous, page-aligned memory from mmap, in transparent huge pages where the
// kernel allows them and the size is at least one (aligned to it, the size rounded up to a
// whole one, advised MADV_HUGEPAGE), zero-filled and addressable. With CUDA enabled
// (TIERSTATE_ENABLE_CUDA) it is then page-locked with cudaHostRegister, so that copies to and
// from the GPU run at full PCIe speed. (Rather than cudaHostAlloc: on an H200, 2026-12-04,
// bench/pinned_alloc.cu found the copies as fast, 55 GB/s either way, and taking 1 GiB 5.9x
// faster, 0.079 s against 0.472 s: about a minute less at start-up for 100 GiB of state.
// Where the platform cannot register host memory, cudaHostAlloc it is.) Registered memory is
// advised MADV_DONTFORK: pinned private pages would otherwise be copied whole into every
// forked child (a DataLoader's workers), where cudaHostAlloc's are not; a child then has no
// PinnedHost memory, as it has no CUDA context.
//
// Neither is limited by RLIMIT_MEMLOCK (`ulimit -l`): without CUDA the memory is not locked,
// and the CUDA driver pins its pages itself, outside that limit. What can refuse it is
// the memory there is, and so, before any byte is taken, the need is compared with
//   - MemAvailable in /proc/meminfo (with SwapFree, for the pageable memory of mmap; a
//     page-locked allocation cannot be swapped);
//   - the memory limit of the process's cgroup, a container's (v2 memory.max and its
//     ancestors', v1 hierarchical_memory_limit), less what it uses but could reclaim;
//   - RLIMIT_AS (`ulimit -v`) and, for mmap, RLIMIT_DATA (`ulimit -d`), less what is in use.
// A need that does not fit is refused with std::system_error (ENOMEM) whose sentence gives
// the bytes needed, the limit that refuses them and what to change, never an opaque
// allocation failure now or an OOM kill in the middle of a step later; nothing is taken.
// Pageable memory that fits only with swap is granted and told once (steps will be slow).
// The estimate is the kernel's of this moment: other processes can still take the memory.
#pragma once

#include <tierstate/core/error.hpp>
#include <tierstate/core/notice.hpp>
#include <tierstate/tiers/detail/numa.hpp>
#include <tierstate/tiers/tier.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>

#include <sys/mman.h>
#include <sys/resource.h>

#if defined(TIERSTATE_ENABLE_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace tierstate::inline TIERSTATE_ABI {

namespace detail {

/// The value of `key` (a line "key value [kB]") in a /proc or cgroup file, in bytes (kB
/// scaled); nullopt where the file or the key is missing.
inline std::optional<std::uint64_t> read_key(std::string const& file, std::string_view key)
{
  std::ifstream in(file);
  std::string line;
  while (std::getline(in, line)) {
    if (line.size() > key.size() && line.compare(0, key.size(), key) == 0 &&
        (line[key.size()] == ' ' || line[key.size()] == ':' || line[key.size()] == '\t')) {
      std::uint64_t v = 0;
      std::size_t i   = key.size() + 1;
      while (i < line.size() && (line[i] == ' ' || line[i] == '\t')) { ++i; }
      if (i == line.size() || line[i] < '0' || line[i] > '9') { return std::nullopt; }
      for (; i < line.size() && line[i] >= '0' && line[i] <= '9'; ++i) { v = v * 10 + static_cast<unsigned>(line[i] - '0'); }
      return line.find("kB", i) != std::string::npos ? v * 1024 : v;
    }
  }
  return std::nullopt;
}

/// The single number in a cgroup file ("max": nullopt, as a missing file).
inline std::optional<std::uint64_t> read_number(std::string const& file)
{
  std::ifstream in(file);
  std::string text;
  if (!(in >> text) || text.empty() || text[0] < '0' || text[0] > '9') { return std::nullopt; }
  return std::stoull(text);
}

/// What one limit leaves: `room` bytes, and the words that explain and fix a refusal.
struct memory_room {
  std::uint64_t room = 0;
  std::string limit;  ///< "RLIMIT_DATA (a limit of N bytes, M in use)" and the like
  std::string fix;    ///< what raises it
};

/// The tightest limit on taking `bytes` more bytes of host memory now (see pinned_host.hpp's
/// file comment); `locked`: the memory is page-locked (cudaHostRegister), so swap does not count.
inline std::optional<memory_room> tightest_memory_limit(bool locked)
{
  std::optional<memory_room> best;
  auto const consider = [&](std::uint64_t room, std::string limit, std::string fix) {
    if (!best || room < best->room) { best = memory_room{room, std::move(limit), std::move(fix)}; }
  };
  constexpr std::uint64_t unlimited = std::uint64_t{1} << 62;  // cgroup v1's "no limit" is near 2^63

  // The machine.
  auto const avail = read_key("/proc/meminfo", "MemAvailable");
  auto const swap  = locked ? std::optional<std::uint64_t>(0) : read_key("/proc/meminfo", "SwapFree");
  if (avail) {
    std::uint64_t const s = swap.value_or(0);
    consider(*avail + s,
             "the machine's available memory (MemAvailable " + std::to_string(*avail) + " bytes" +
               (locked ? std::string(" in /proc/meminfo; page-locked memory cannot be swapped)")
                       : ", SwapFree " + std::to_string(s) + " bytes in /proc/meminfo)"),
             "free memory on the machine (other processes, other ranks on this host)");
  }

  // The cgroup (a container, a batch job): v2, walking up through the ancestors' limits.
  std::string v2, v1;
  {
    std::ifstream in("/proc/self/cgroup");
    std::string line;
    while (std::getline(in, line)) {
      if (line.rfind("0::", 0) == 0) { v2 = line.substr(3); }
      auto const c = line.find(':');
      auto const d = c == std::string::npos ? std::string::npos : line.find(':', c + 1);
      if (d != std::string::npos) {
        std::string const controllers = "," + line.substr(c + 1, d - c - 1) + ",";
        if (controllers.find(",memory,") != std::string::npos) { v1 = line.substr(d + 1); }
      }
    }
  }
  auto const cgroup_room = [&](std::string const& dir, std::uint64_t max, std::uint64_t current, std::uint64_t file,
                               std::uint64_t shmem, char const* max_name) {
    std::uint64_t const reclaimable = file > shmem ? file - shmem : 0;
    std::uint64_t const used        = current > reclaimable ? current - reclaimable : 0;
    consider(max > used ? max - used : 0,
             "the memory limit of this process's cgroup (" + std::string(max_name) + " " + std::to_string(max) +
               " bytes in " + dir + ", " + std::to_string(used) + " in use beyond reclaimable cache)",
             "raise the container's or job's memory limit");
  };
  if (!v2.empty()) {
    for (std::string const base : {"/sys/fs/cgroup", "/sys/fs/cgroup/unified"}) {
      std::string path = v2;
      if (!std::ifstream(base + path + "/memory.current")) { path = "/"; }  // a cgroup namespace's root
      if (!std::ifstream(base + path + "/memory.current")) { continue; }
      for (;;) {
        std::string const dir = base + (path == "/" ? std::string() : path);
        auto const max        = read_number(dir + "/memory.max");
        auto const current    = read_number(dir + "/memory.current");
        if (max && current && *max < unlimited) {
          cgroup_room(dir, *max, *current, read_key(dir + "/memory.stat", "file").value_or(0),
                      read_key(dir + "/memory.stat", "shmem").value_or(0), "memory.max");
        }
        if (path == "/" || path.empty()) { break; }
        path = path.substr(0, path.rfind('/'));
        if (path.empty()) { path = "/"; }
      }
      break;
    }
  }
  if (!v1.empty()) {
    std::string const base = "/sys/fs/cgroup/memory";
    std::string dir        = base + (v1 == "/" ? std::string() : v1);
    if (!std::ifstream(dir + "/memory.stat")) { dir = base; }  // a cgroup namespace's root
    auto const max     = read_key(dir + "/memory.stat", "hierarchical_memory_limit");
    auto const current = read_number(dir + "/memory.usage_in_bytes");
    if (max && current && *max < unlimited) {
      cgroup_room(dir, *max, *current, read_key(dir + "/memory.stat", "total_cache").value_or(0),
                  read_key(dir + "/memory.stat", "total_shmem").value_or(0), "hierarchical_memory_limit");
    }
  }

  // The process's own limits.
  auto const rlimit_room = [&](int resource, char const* name, char const* status_key, char const* command) {
    rlimit lim{};
    if (::getrlimit(resource, &lim) != 0 || lim.rlim_cur == RLIM_INFINITY) { return; }
    std::uint64_t const used = read_key("/proc/self/status", status_key).value_or(0);
    std::uint64_t const cap  = lim.rlim_cur;
    consider(cap > used ? cap - used : 0,
             std::string(name) + " (a limit of " + std::to_string(cap) + " bytes, " + std::to_string(used) +
               " in use)",
             std::string("raise it (`") + command + "`, or the job's limits)");
  };
  rlimit_room(RLIMIT_AS, "RLIMIT_AS", "VmSize", "ulimit -v");
  rlimit_room(RLIMIT_DATA, "RLIMIT_DATA", "VmData", "ulimit -d");  // (the memory is mmap'ed, locked or not)
  return best;
}

/// The transparent huge page size to map `bytes` with, or 0 for base pages: THP is off
/// ("never" in /sys/kernel/mm/transparent_hugepage/enabled, or no such file), or `bytes` is
/// less than one huge page (rounding a small buffer up would waste most of a huge page).
inline std::size_t huge_page_bytes(std::size_t bytes)
{
  static std::size_t const size = [] {
    std::ifstream mode("/sys/kernel/mm/transparent_hugepage/enabled");
    std::string text;
    std::getline(mode, text);
    if (text.find("[never]") != std::string::npos || text.empty()) { return std::size_t{0}; }
    std::size_t h = 0;
    std::ifstream("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") >> h;
    return h >= 4096 && (h & (h - 1)) == 0 ? h : std::size_t{0};
  }();
  return size != 0 && bytes >= size ? size : 0;
}

/// `bytes` of zero-filled anonymous memory (null and errno set on failure). With `huge` > 0
/// (`bytes` a multiple of it), aligned to `huge` and advised MADV_HUGEPAGE, so that where THP
/// is "madvise" (Debian's default) as where it is "always", the kernel backs it with huge
/// pages: a step walks its state with a TLB entry per 2 MiB instead of per 4 KiB. Where the
/// advice is refused, the memory stays in base pages, as good as it would have been.
inline void* map_anonymous(std::size_t bytes, std::size_t huge) noexcept
{
  std::size_t const span = huge == 0 ? bytes : bytes + huge;  // room to align the start
  void* p                = ::mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) { return nullptr; }
  if (huge == 0) { return p; }
  auto const base    = reinterpret_cast<std::uintptr_t>(p);
  auto const aligned = (base + huge - 1) / huge * huge;
  std::size_t const head = aligned - base, tail = span - head - bytes;
  if (head > 0) { ::munmap(p, head); }
  if (tail > 0) { ::munmap(reinterpret_cast<void*>(aligned + bytes), tail); }
  (void)::madvise(reinterpret_cast<void*>(aligned), bytes, MADV_HUGEPAGE);
  return reinterpret_cast<void*>(aligned);
}


/// Throws std::system_error (ENOMEM) with a sentence where `bytes` do not fit the tightest
/// limit; tells once where pageable memory fits only with swap.
inline void check_host_memory(std::size_t bytes, bool locked)
{
  auto const room = tightest_memory_limit(locked);
  if (room && bytes > room->room) {
    throw std::system_error(
      ENOMEM, std::generic_category(),
      "PinnedHost: " + std::to_string(bytes) + " bytes of " + (locked ? "page-locked " : "") +
        "host memory are needed, but " + room->limit + " leaves " + std::to_string(room->room) + ": " + room->fix +
        ", or need less: keep the optimizer's state in NvmeFile instead of PinnedHost, or spread it over more "
        "ranks; for staging buffers, a smaller chunk_elements or Pipelined depth. Nothing was allocated");
  }
  if (!locked) {
    auto const avail = read_key("/proc/meminfo", "MemAvailable");
    if (avail && bytes > *avail) {
      notify_once("PinnedHost.swap",
                  "PinnedHost: " + std::to_string(bytes) + " bytes of host memory exceed the " + std::to_string(*avail) +
                    " bytes available (MemAvailable): part of them will be swapped out, and steps that touch "
                    "them will be slow; NvmeFile keeps state on disk on purpose");
    }
  }
}

}  // namespace detail


/// PinnedHost::options (outside the class: a default member initializer of a nested class
/// cannot serve its enclosing class's default arguments).
struct pinned_host_options {
  /// The NUMA node whose memory backs it (-1: the kernel's choice, where the thread that
  /// first touches a page runs). Needs a build with libnuma (TIERSTATE_WITH_NUMA defined,
  /// -lnuma linked; Debian's libnuma-dev): without it, or on a kernel without NUMA, the
  /// request is told once (core/notice.hpp) and the memory is placed as by default. A node
  /// the machine does not have is refused (tierstate::invalid_option).
  int numa_node = -1;
};

class PinnedHost {
 public:
  using options = pinned_host_options;
  static constexpr std::string_view name = "PinnedHost";

  /// Zero-filled, page-aligned memory of `bytes` bytes. Throws std::system_error (ENOMEM
  /// and the like) with a sentence naming the size, the limit that refuses it and what to
  /// change, before taking any memory, where the memory cannot be had (see the file
  /// comment); nothing is allocated then.
  explicit PinnedHost(std::size_t bytes, options const& o = {}) : size_(bytes)
  {
    bool const numa = detail::check_numa_node(o.numa_node);
    if (bytes == 0) { return; }
#if defined(TIERSTATE_ENABLE_CUDA)
    constexpr bool locked = true;
#else
    constexpr bool locked = false;
#endif
    std::size_t const huge = detail::huge_page_bytes(bytes);
    mapped_                = huge == 0 ? bytes : (bytes + huge - 1) / huge * huge;
    detail::check_host_memory(mapped_, locked);
    void* p = detail::map_anonymous(mapped_, huge);
    if (p == nullptr) {
      throw std::system_error(errno, std::generic_category(),
                              "PinnedHost: cannot allocate " + std::to_string(bytes) +
                                " bytes of host memory (mmap; keep the state in NvmeFile, or use a "
                                "smaller chunk_elements for staging buffers)");
    }
    if (numa) { detail::place_on_node(p, mapped_, o.numa_node); }  // (before any page is touched)
#if defined(TIERSTATE_ENABLE_CUDA)
    (void)::madvise(p, mapped_, MADV_DONTFORK);
    cudaError_t e = cudaHostRegister(p, mapped_, cudaHostRegisterDefault);
    if (e == cudaErrorNotSupported) {  // (some Tegra and virtualized platforms)
      (void)cudaGetLastError();
      ::munmap(p, std::exchange(mapped_, 0));  // mapped_ 0: cudaHostAlloc's
      p = nullptr;
      e = cudaHostAlloc(&p, bytes, cudaHostAllocDefault);
      if (e == cudaSuccess) { std::memset(p, 0, bytes); }
    }
    if (e != cudaSuccess) {
      (void)cudaGetLastError();  // clear it: the next CUDA call must not see it
      if (mapped_ != 0) { ::munmap(p, std::exchange(mapped_, 0)); }
      throw std::system_error(ENOMEM, std::generic_category(),
                              "PinnedHost: page-locking " + std::to_string(bytes) +
                                " bytes of host memory failed (cudaHostRegister, or cudaHostAlloc where "
                                "registering is not supported): " + cudaGetErrorString(e) +
                                " (keep the state in NvmeFile, or use a smaller chunk_elements for staging buffers)");
    }
#endif
    data_ = static_cast<std::byte*>(p);
  }
  ~PinnedHost() { release(); }
  PinnedHost(PinnedHost&& o) noexcept
    : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)), mapped_(std::exchange(o.mapped_, 0))
  {
  }
  PinnedHost& operator=(PinnedHost&& o) noexcept
  {
    if (this != &o) {
      release();
      data_   = std::exchange(o.data_, nullptr);
      size_   = std::exchange(o.size_, 0);
      mapped_ = std::exchange(o.mapped_, 0);
    }
    return *this;
  }
  PinnedHost(PinnedHost const&)            = delete;
  PinnedHost& operator=(PinnedHost const&) = delete;

  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] std::byte* data() noexcept { return data_; }

  /// Forgets the memory without freeing it: for memory that an I/O the kernel never
  /// answered may still read or write (io::engine::held()). It is leaked on purpose, so that
  /// no later allocation can be handed the same pages while a late transfer lands in them.
  void abandon() noexcept
  {
    data_   = nullptr;
    size_   = 0;
    mapped_ = 0;
  }

  void read(std::size_t offset, std::span<std::byte> to) const
  {
    check(offset, to.size());
    if (!to.empty()) { std::memcpy(to.data(), data_ + offset, to.size()); }
  }
  void write(std::size_t offset, std::span<std::byte const> from)
  {
    check(offset, from.size());
    if (!from.empty()) { std::memcpy(data_ + offset, from.data(), from.size()); }
  }

 private:
  void release() noexcept
  {
    if (data_ == nullptr) { return; }
#if defined(TIERSTATE_ENABLE_CUDA)
    if (mapped_ == 0) {
      cudaFreeHost(data_);
      data_ = nullptr;
      return;
    }
    (void)cudaHostUnregister(data_);
#endif
    ::munmap(data_, mapped_);
    data_ = nullptr;
  }

  void check(std::size_t offset, std::size_t n) const
  {
    TIERSTATE_EXPECTS(offset <= size_ && n <= size_ - offset,
                      "PinnedHost: bytes [" + std::to_string(offset) + ", " +
                        std::to_string(offset + n) + ") are outside its " +
                        std::to_string(size_) + " bytes");
  }

  std::byte* data_    = nullptr;
  std::size_t size_   = 0;
  std::size_t mapped_ = 0;  ///< bytes mapped: size_ rounded up to the huge page (0: cudaHostAlloc's)
};

static_assert(addressable_tier<PinnedHost>);

}  // namespace tierstate
