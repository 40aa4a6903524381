// SPDX-License-Identifier: Apache-2.0
// ranks::mpi: the communicator (ranks/communicator.hpp) over an MPI communicator, for
// ranks::sharded. Only a trainer that includes this header needs MPI (<mpi.h>, and its
// library at link: Meson's dependency('mpi', language: 'cpp'), CMake's MPI::MPI_CXX,
// pkg-config's ompi-cxx / mpich).
//
//   MPI_Init(&argc, &argv);
//   {
//     tierstate::ranks::mpi world(MPI_COMM_WORLD);
//     tierstate::ranks::sharded<Opt, tierstate::ranks::mpi> opt(world, {.lr = 1e-3}, o);
//     ...                                   // destroyed before MPI_Finalize
//   }
//   MPI_Finalize();
//
// Host memory only (MPI without CUDA awareness). Counts above 2^31 - 1 elements are split
// into several calls. bf16 and fp16 sums are each rank's pair of values widened to float,
// added and rounded back (MPI has no 16-bit float types): one rounding per addition, in the
// order the MPI library reduces in, which is fixed for a given library, rank count and size.
// The communicator's error handler is left as the user set it: by default MPI aborts the job
// on an error, which is never a hang; with MPI_ERRORS_RETURN, a failed call throws.
#pragma once

#include <tierstate/core/numeric.hpp>
#include <tierstate/ranks/communicator.hpp>

#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1  // MPI's C interface only: its deprecated C++ bindings are not needed
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace tierstate::inline TIERSTATE_ABI::ranks {

class mpi {
 public:
  /// `comm` must stay valid while this lives; MPI must be initialized (MPI_Init), with a thread
  /// level that allows the calling thread's MPI calls (every call here is on the thread that
  /// calls ranks::sharded, or that runs its streaming step's driver: MPI_THREAD_SERIALIZED
  /// at least where that is not the main thread).
  explicit mpi(MPI_Comm comm = MPI_COMM_WORLD) : comm_(comm)
  {
    int init = 0;
    MPI_Initialized(&init);
    if (init == 0) { throw logic_error("ranks::mpi: MPI is not initialized (call MPI_Init first)"); }
    int r = 0;
    int n = 0;
    check(MPI_Comm_rank(comm_, &r), "MPI_Comm_rank");
    check(MPI_Comm_size(comm_, &n), "MPI_Comm_size");
    rank_ = static_cast<std::size_t>(r);
    size_ = static_cast<std::size_t>(n);
    check(MPI_Op_create(&sum16<bf16>, 1, &sum_bf16_), "MPI_Op_create");
    if (int const rc = MPI_Op_create(&sum16<fp16>, 1, &sum_fp16_); rc != MPI_SUCCESS) {
      MPI_Op_free(&sum_bf16_);
      check(rc, "MPI_Op_create");
    }
  }
  ~mpi()
  {
    int done = 0;
    MPI_Finalized(&done);
    if (done == 0) {
      MPI_Op_free(&sum_bf16_);
      MPI_Op_free(&sum_fp16_);
    }
  }
  mpi(mpi const&)            = delete;
  mpi& operator=(mpi const&) = delete;

  [[nodiscard]] std::size_t rank() const noexcept { return rank_; }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] MPI_Comm handle() const noexcept { return comm_; }

  void max(std::span<std::uint64_t> words)
  {
    check(MPI_Allreduce(MPI_IN_PLACE, words.data(), narrow(words.size()), MPI_UINT64_T, MPI_MAX, comm_),
          "MPI_Allreduce");
  }
  void gather(std::uint64_t mine, std::span<std::uint64_t> all)
  {
    check(MPI_Allgather(&mine, 1, MPI_UINT64_T, all.data(), 1, MPI_UINT64_T, comm_), "MPI_Allgather");
  }
  void gather(std::span<double const> mine, std::span<double> all, std::span<std::size_t const> counts)
  {
    std::vector<int> n(counts.size());
    std::vector<int> at(counts.size());
    std::size_t offset = 0;
    for (std::size_t r = 0; r < counts.size(); ++r) {
      n[r]  = narrow(counts[r]);
      at[r] = narrow(offset);
      offset += counts[r];
    }
    check(MPI_Allgatherv(mine.data(), narrow(mine.size()), MPI_DOUBLE, all.data(), n.data(), at.data(), MPI_DOUBLE,
                         comm_),
          "MPI_Allgatherv");
  }

  template <class T>
  void reduce_scatter(std::span<T const> send, std::span<T> mine, std::span<std::size_t const> counts)
  {
    if (fits(counts)) {
      std::vector<int> n(counts.begin(), counts.end());
      check(MPI_Reduce_scatter(send.data(), mine.data(), n.data(), type<T>(), sum<T>(), comm_), "MPI_Reduce_scatter");
      return;
    }
    // Each rank's elements as a reduction to it, in pieces of at most 2^30.
    std::size_t offset = 0;
    for (std::size_t r = 0; r < counts.size(); offset += counts[r], ++r) {
      for (std::size_t done = 0; done < counts[r]; done += piece) {
        int const n       = narrow(std::min(piece, counts[r] - done));
        T const* const in = send.data() + offset + done;
        if (r == rank_) {
          check(MPI_Reduce(in, mine.data() + done, n, type<T>(), sum<T>(), static_cast<int>(r), comm_), "MPI_Reduce");
        } else {
          check(MPI_Reduce(in, nullptr, n, type<T>(), sum<T>(), static_cast<int>(r), comm_), "MPI_Reduce");
        }
      }
    }
  }
  template <class T>
  void all_gather(T* buffer, std::span<std::size_t const> counts)
  {
    if (fits(counts)) {
      std::vector<int> n(counts.size());
      std::vector<int> at(counts.size());
      std::size_t offset = 0;
      for (std::size_t r = 0; r < counts.size(); ++r) {
        n[r]  = static_cast<int>(counts[r]);
        at[r] = static_cast<int>(offset);
        offset += counts[r];
      }
      check(MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buffer, n.data(), at.data(), type<T>(), comm_),
            "MPI_Allgatherv");
      return;
    }
    std::size_t offset = 0;
    for (std::size_t r = 0; r < counts.size(); offset += counts[r], ++r) {
      for (std::size_t done = 0; done < counts[r]; done += piece) {
        check(MPI_Bcast(buffer + offset + done, narrow(std::min(piece, counts[r] - done)), type<T>(),
                        static_cast<int>(r), comm_),
              "MPI_Bcast");
      }
    }
  }

 private:
  static constexpr std::size_t piece = std::size_t{1} << 30;

  /// Whether every count, and their sum (a displacement), fits MPI's int.
  static bool fits(std::span<std::size_t const> counts) noexcept
  {
    std::size_t total = 0;
    for (auto const c : counts) {
      if (c > static_cast<std::size_t>(INT_MAX) - total) { return false; }
      total += c;
    }
    return true;
  }
  static int narrow(std::size_t n)
  {
    if (n > static_cast<std::size_t>(INT_MAX)) {
      throw std::length_error(detail::cat("ranks::mpi: ", std::to_string(n), " elements in one call (MPI counts are int)"));
    }
    return static_cast<int>(n);
  }
  static void check(int rc, char const* call)
  {
    if (rc == MPI_SUCCESS) { return; }
    char text[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, text, &len);
    throw std::runtime_error(std::string(call) + " failed: " + std::string(text, static_cast<std::size_t>(len)));
  }

  template <class T>
  static MPI_Datatype type()
  {
    if constexpr (std::is_same_v<T, float>) { return MPI_FLOAT; }
    else if constexpr (std::is_same_v<T, double>) { return MPI_DOUBLE; }
    else {
      static_assert(std::is_same_v<T, bf16> || std::is_same_v<T, fp16>, "ranks::mpi: float, double, bf16 or fp16");
      return MPI_UINT16_T;
    }
  }
  template <class T>
  MPI_Op sum() const
  {
    if constexpr (std::is_same_v<T, bf16>) { return sum_bf16_; }
    else if constexpr (std::is_same_v<T, fp16>) { return sum_fp16_; }
    else { return MPI_SUM; }
  }
  /// inout[i] += in[i], for 16-bit floats (MPI_User_function).
  template <class T>
  static void sum16(void* in, void* inout, int* len, MPI_Datatype*)
  {
    auto const* a = static_cast<std::uint16_t const*>(in);
    auto* b       = static_cast<std::uint16_t*>(inout);
    for (int i = 0; i < *len; ++i) {
      b[i] = T(static_cast<float>(T::from_bits(a[i])) + static_cast<float>(T::from_bits(b[i]))).bits;
    }
  }

  MPI_Comm comm_;
  std::size_t rank_ = 0;
  std::size_t size_ = 1;
  MPI_Op sum_bf16_  = MPI_OP_NULL;
  MPI_Op sum_fp16_  = MPI_OP_NULL;
};

}  // namespace tierstate::ranks
