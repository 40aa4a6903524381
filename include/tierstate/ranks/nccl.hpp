// SPDX-License-Identifier: Apache-2.0
// ranks::nccl: the communicator (ranks/communicator.hpp) over an NCCL communicator, for
// ranks::sharded with params and gradients in device memory (an optimizer that takes device
// params: CudaOverlapped or OnDevice). Only a trainer that includes this header needs NCCL
// (<nccl.h> and libnccl, the CUDA runtime, and TIERSTATE_ENABLE_CUDA).
//
//   ncclComm_t comm;  ncclCommInitRank(&comm, ranks, id, rank);   // one GPU per rank
//   tierstate::ranks::nccl world(comm, stream);
//   tierstate::ranks::sharded<Opt, tierstate::ranks::nccl> opt(world, {.lr = 1e-3}, o);
//
// Every call is queued on `stream` and waited for before it returns (the sharded step reads
// its results on the host next). The gradients must be complete when a step begins: where
// backward ran on another stream, make `stream` wait for it (an event) or synchronize first. NCCL has no variable-count reduce-scatter or all-gather:
// each is a group of one reduction, or one broadcast, per rank that owns elements. The small
// host words (flags, counts, block sums) go through a device buffer of this object's. NCCL
// refuses two ranks on one GPU: on a single-GPU machine only one rank runs.
#pragma once

#ifndef TIERSTATE_ENABLE_CUDA
#error "tierstate/ranks/nccl.hpp needs TIERSTATE_ENABLE_CUDA (and the CUDA runtime)"
#endif

#include <tierstate/core/device_runtime.hpp>
#include <tierstate/core/numeric.hpp>
#include <tierstate/ranks/communicator.hpp>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace tierstate::inline TIERSTATE_ABI::ranks {

class nccl {
 public:
  static constexpr location memory = location::device;

  /// `comm` and `stream` must stay valid while this lives.
  nccl(ncclComm_t comm, cudaStream_t stream) : comm_(comm), stream_(stream)
  {
    int r = 0;
    int n = 0;
    check(ncclCommUserRank(comm_, &r), "ncclCommUserRank");
    check(ncclCommCount(comm_, &n), "ncclCommCount");
    rank_ = static_cast<std::size_t>(r);
    size_ = static_cast<std::size_t>(n);
  }
  ~nccl()
  {
    if (scratch_ != nullptr) { cudaFree(scratch_); }
  }
  nccl(nccl const&)            = delete;
  nccl& operator=(nccl const&) = delete;

  [[nodiscard]] std::size_t rank() const noexcept { return rank_; }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }

  void max(std::span<std::uint64_t> words)
  {
    auto* d = scratch<std::uint64_t>(words.size());
    to_device(d, words.data(), words.size());
    check(ncclAllReduce(d, d, words.size(), ncclUint64, ncclMax, comm_, stream_), "ncclAllReduce");
    to_host(words.data(), d, words.size());
  }
  void gather(std::uint64_t mine, std::span<std::uint64_t> all)
  {
    auto* d = scratch<std::uint64_t>(all.size());
    to_device(d + rank_, &mine, 1);
    check(ncclAllGather(d + rank_, d, 1, ncclUint64, comm_, stream_), "ncclAllGather");
    to_host(all.data(), d, all.size());
  }
  void gather(std::span<double const> mine, std::span<double> all, std::span<std::size_t const> counts)
  {
    auto* d = scratch<double>(all.size());
    std::size_t at = 0;
    for (std::size_t r = 0; r < rank_; ++r) { at += counts[r]; }
    to_device(d + at, mine.data(), mine.size());
    broadcast_each(d, counts, ncclFloat64);
    to_host(all.data(), d, all.size());
  }
  template <class T>
  void reduce_scatter(std::span<T const> send, std::span<T> mine, std::span<std::size_t const> counts)
  {
    check(ncclGroupStart(), "ncclGroupStart");
    std::size_t at = 0;
    for (std::size_t r = 0; r < counts.size(); at += counts[r], ++r) {
      if (counts[r] == 0) { continue; }
      check(ncclReduce(send.data() + at, r == rank_ ? mine.data() : nullptr, counts[r], type<T>(), ncclSum,
                       static_cast<int>(r), comm_, stream_),
            "ncclReduce", true);
    }
    check(ncclGroupEnd(), "ncclGroupEnd");
    synchronize();
  }
  template <class T>
  void all_gather(T* buffer, std::span<std::size_t const> counts)
  {
    broadcast_each(buffer, counts, type<T>());
    synchronize();
  }

 private:
  static void check(ncclResult_t rc, char const* call, bool in_group = false)
  {
    if (rc == ncclSuccess) { return; }
    if (in_group) { ncclGroupEnd(); }  // (never left open)
    throw std::runtime_error(std::string(call) + " failed: " + ncclGetErrorString(rc));
  }
  template <class T>
  static ncclDataType_t type()
  {
    if constexpr (std::is_same_v<T, float>) { return ncclFloat32; }
    else if constexpr (std::is_same_v<T, double>) { return ncclFloat64; }
    else if constexpr (std::is_same_v<T, fp16>) { return ncclFloat16; }
    else {
      static_assert(std::is_same_v<T, bf16>, "ranks::nccl: float, double, bf16 or fp16");
      return ncclBfloat16;
    }
  }
  /// In place: rank r's counts[r] elements, after ranks 0..r-1's, broadcast from it.
  template <class T>
  void broadcast_each(T* buffer, std::span<std::size_t const> counts, ncclDataType_t t)
  {
    check(ncclGroupStart(), "ncclGroupStart");
    std::size_t at = 0;
    for (std::size_t r = 0; r < counts.size(); at += counts[r], ++r) {
      if (counts[r] == 0) { continue; }
      check(ncclBroadcast(buffer + at, buffer + at, counts[r], t, static_cast<int>(r), comm_, stream_),
            "ncclBroadcast", true);
    }
    check(ncclGroupEnd(), "ncclGroupEnd");
  }
  /// This object's device buffer, grown to n elements of T.
  template <class T>
  T* scratch(std::size_t n)
  {
    std::size_t const bytes = std::max<std::size_t>(n, 1) * sizeof(T);
    if (bytes > scratch_bytes_) {
      synchronize();
      if (scratch_ != nullptr) { cudaFree(scratch_); }
      scratch_       = nullptr;
      scratch_bytes_ = 0;
      TIERSTATE_CUDA_TRY(cudaMalloc(&scratch_, bytes));
      scratch_bytes_ = bytes;
    }
    return static_cast<T*>(scratch_);
  }
  template <class T>
  void to_device(T* d, T const* h, std::size_t n)
  {
    TIERSTATE_CUDA_TRY(cudaMemcpyAsync(d, h, n * sizeof(T), cudaMemcpyHostToDevice, stream_));
  }
  template <class T>
  void to_host(T* h, T const* d, std::size_t n)
  {
    TIERSTATE_CUDA_TRY(cudaMemcpyAsync(h, d, n * sizeof(T), cudaMemcpyDeviceToHost, stream_));
    synchronize();
  }
  void synchronize() { TIERSTATE_CUDA_TRY(cudaStreamSynchronize(stream_)); }

  ncclComm_t comm_;
  cudaStream_t stream_;
  std::size_t rank_ = 0;
  std::size_t size_ = 1;
  void* scratch_    = nullptr;
  std::size_t scratch_bytes_ = 0;
};

}  // namespace tierstate::ranks
