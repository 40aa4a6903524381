// SPDX-License-Identifier: Apache-2.0
// pinned_alloc: how page-locked host memory for PinnedHost should be had on a CUDA machine.
// PinnedHost takes cudaHostAlloc's memory (4 KiB pages, as far as the driver says); without
// CUDA it maps anonymous memory advised MADV_HUGEPAGE. Which is better with CUDA: cudaHostAlloc,
// or an mmap'ed region in transparent huge pages registered with cudaHostRegister?
//
// For each way, --bytes (default 1 GiB) are had, then --reps rounds (default 7), the ways
// interleaved within each round, each time:
//   h2d_gb_s, d2h_gb_s  a cudaMemcpyAsync of the whole buffer to device memory, then back
//   host_gb_s           a pass of all threads over the buffer as floats, read and written
//                       (x = x * a + b), the memory pattern of the host step: where the
//                       TLB costs, huge pages show here
// and once: alloc_seconds (the allocation or mmap, the first touch that zero-fills it, and the
// registration: what a PinnedHost constructor would spend) and huge_page_bytes (AnonHugePages
// of the mapping, from /proc/self/smaps). One JSON line per way, medians, with the ratio of
// each median to cudaHostAlloc's of the same rounds.
//
//   pinned_alloc [--bytes N] [--reps R]
#include <cuda_runtime.h>

#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

using clock_type = std::chrono::steady_clock;
double since(clock_type::time_point t0) { return std::chrono::duration<double>(clock_type::now() - t0).count(); }

double median(std::vector<double> v)
{
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

void check(cudaError_t e, char const* what)
{
  if (e != cudaSuccess) {
    std::fprintf(stderr, "pinned_alloc: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

std::string first_line(char const* path)
{
  std::ifstream f(path);
  std::string s;
  std::getline(f, s);
  return s;
}

/// AnonHugePages of the mapping that contains p, in bytes (from /proc/self/smaps).
std::size_t huge_bytes_of(void const* p)
{
  std::ifstream f("/proc/self/smaps");
  std::string line;
  auto const a = reinterpret_cast<std::uintptr_t>(p);
  bool inside  = false;
  std::size_t total = 0;
  while (std::getline(f, line)) {
    unsigned long lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2 && line.find(' ') > line.find('-')) {
      inside = a >= lo && a < hi;
      continue;
    }
    if (inside && line.rfind("AnonHugePages:", 0) == 0) {
      std::istringstream in(line.substr(14));
      std::size_t kb = 0;
      in >> kb;
      total += kb * 1024;
    }
  }
  return total;
}

struct way {
  char const* name;
  void* host       = nullptr;
  void* mapped     = nullptr;  // the mmap'ed span (null: cudaHostAlloc's)
  std::size_t span = 0;
  double alloc_seconds = 0;
  std::vector<double> h2d, d2h, cpu;
};

void* map_aligned(std::size_t bytes, std::size_t align, void*& mapped, std::size_t& span)
{
  span    = bytes + align;
  void* p = ::mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    std::perror("pinned_alloc: mmap");
    std::exit(1);
  }
  mapped          = p;
  auto const base = reinterpret_cast<std::uintptr_t>(p);
  return reinterpret_cast<void*>((base + align - 1) / align * align);
}

void touch(void* p, std::size_t bytes, unsigned threads)
{
  std::vector<std::thread> t;
  for (unsigned i = 0; i < threads; ++i) {
    t.emplace_back([=] {
      std::size_t const lo = bytes / threads * i, hi = i + 1 == threads ? bytes : bytes / threads * (i + 1);
      std::memset(static_cast<char*>(p) + lo, 0, hi - lo);
    });
  }
  for (auto& x : t) { x.join(); }
}

double cpu_pass(void* p, std::size_t bytes, unsigned threads)
{
  auto* f              = static_cast<float*>(p);
  std::size_t const n  = bytes / sizeof(float);
  auto const t0        = clock_type::now();
  std::vector<std::thread> t;
  for (unsigned i = 0; i < threads; ++i) {
    t.emplace_back([=] {
      std::size_t const lo = n / threads * i, hi = i + 1 == threads ? n : n / threads * (i + 1);
      for (std::size_t j = lo; j < hi; ++j) { f[j] = f[j] * 0.999f + 1e-3f; }
    });
  }
  for (auto& x : t) { x.join(); }
  return since(t0);
}

}  // namespace

int main(int argc, char** argv)
{
  std::size_t bytes = std::size_t{1} << 30;
  int reps          = 7;
  for (int i = 1; i < argc; ++i) {
    std::string const a = argv[i];
    if (a == "--bytes" && i + 1 < argc) {
      bytes = std::strtoull(argv[++i], nullptr, 10);
    } else if (a == "--reps" && i + 1 < argc) {
      reps = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: %s [--bytes N] [--reps R]\n", argv[0]);
      return 2;
    }
  }
  std::size_t const huge = std::size_t{2} << 20;
  bytes                  = std::max(huge, (bytes + huge - 1) / huge * huge);
  if (reps < 1) { reps = 1; }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("SKIP: no CUDA device\n");
    return 77;
  }
  unsigned const threads = std::max(1u, std::thread::hardware_concurrency());
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  void* dev = nullptr;
  check(cudaMalloc(&dev, bytes), "cudaMalloc");
  cudaStream_t s;
  check(cudaStreamCreate(&s), "cudaStreamCreate");

  std::vector<way> ways = {{"cudaHostAlloc"}, {"mmap_thp_registered"}, {"mmap_4k_registered"}};
  for (auto& w : ways) {
    auto const t0 = clock_type::now();
    if (w.name == std::string("cudaHostAlloc")) {
      check(cudaHostAlloc(&w.host, bytes, cudaHostAllocDefault), "cudaHostAlloc");
      touch(w.host, bytes, threads);
    } else {
      bool const thp = w.name == std::string("mmap_thp_registered");
      w.host         = map_aligned(bytes, huge, w.mapped, w.span);
      (void)::madvise(w.host, bytes, thp ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
      touch(w.host, bytes, threads);
      check(cudaHostRegister(w.host, bytes, cudaHostRegisterDefault), "cudaHostRegister");
    }
    w.alloc_seconds = since(t0);
  }
  for (int r = 0; r < reps; ++r) {
    for (std::size_t k = 0; k < ways.size(); ++k) {
      auto& w       = ways[(k + r) % ways.size()];  // the order rotated each round
      auto t0       = clock_type::now();
      check(cudaMemcpyAsync(dev, w.host, bytes, cudaMemcpyHostToDevice, s), "H2D");
      check(cudaStreamSynchronize(s), "H2D sync");
      w.h2d.push_back(bytes / since(t0) / 1e9);
      t0 = clock_type::now();
      check(cudaMemcpyAsync(w.host, dev, bytes, cudaMemcpyDeviceToHost, s), "D2H");
      check(cudaStreamSynchronize(s), "D2H sync");
      w.d2h.push_back(bytes / since(t0) / 1e9);
      w.cpu.push_back(2.0 * bytes / cpu_pass(w.host, bytes, threads) / 1e9);
    }
  }
  auto const& base = ways[0];
  std::string const thp_mode = first_line("/sys/kernel/mm/transparent_hugepage/enabled");
  for (auto const& w : ways) {
    std::printf("{\"bench\":\"pinned_alloc\",\"way\":\"%s\",\"bytes\":%zu,\"reps\":%d,\"threads\":%u,"
                "\"alloc_seconds\":%.4f,\"huge_page_bytes\":%zu,\"h2d_gb_s\":%.2f,\"d2h_gb_s\":%.2f,"
                "\"host_gb_s\":%.2f,\"h2d_ratio\":%.3f,\"d2h_ratio\":%.3f,\"host_ratio\":%.3f,"
                "\"thp\":\"%s\",\"device\":\"%s\"}\n",
                w.name, bytes, reps, threads, w.alloc_seconds, huge_bytes_of(w.host), median(w.h2d), median(w.d2h),
                median(w.cpu), median(w.h2d) / median(base.h2d), median(w.d2h) / median(base.d2h),
                median(w.cpu) / median(base.cpu), thp_mode.c_str(), prop.name);
  }
  for (auto& w : ways) {
    if (w.mapped == nullptr) {
      cudaFreeHost(w.host);
    } else {
      cudaHostUnregister(w.host);
      ::munmap(w.mapped, w.span);
    }
  }
  cudaFree(dev);
  return 0;
}
