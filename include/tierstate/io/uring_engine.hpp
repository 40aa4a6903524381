// SPDX-License-Identifier: Apache-2.0
// The I/O engine on liburing: batched reads and writes of large, aligned ranges.
//
// A batch of requests is cut into block_size pieces and kept queue_depth deep in one ring;
// a short read or write is requeued for its remainder until done (a read that reaches the
// end of the file fails with ENODATA: state files are preallocated); the first failure becomes a
// tierstate::io_error naming path, offset, length, operation and errno, after every piece
// in flight has completed, so no buffer is still in use by the kernel when it is thrown.
// Inside the ring results are -errno values; exceptions only leave through submit().
//
// Thread safety: one thread at a time per engine.
#pragma once

#include <tierstate/core/error.hpp>
#include <tierstate/io/error.hpp>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <span>
#include <string>
#include <vector>

#include <liburing.h>

namespace tierstate::io {

struct engine_options {
  unsigned queue_depth   = 32;               ///< pieces in flight at once, 1..4096
  std::size_t block_size = std::size_t{1} << 20;  ///< largest piece, a multiple of 4096
};

/// One range of one file to read into or write from memory.
struct request {
  int fd                = -1;
  std::uint64_t offset  = 0;
  std::byte* data       = nullptr;
  std::size_t length    = 0;
  bool write            = false;
  std::string const* path = nullptr;  ///< for error messages
};

class uring_engine {
 public:
  /// Throws tierstate::invalid_option for bad options, and io_error (operation
  /// "io_uring_queue_init") where io_uring is unavailable: ENOSYS on kernels without it,
  /// EPERM where a seccomp filter or sysctl forbids it.
  explicit uring_engine(engine_options const& o = {}) : opts_(o)
  {
    if (o.queue_depth == 0 || o.queue_depth > 4096) {
      throw invalid_option("queue_depth", detail::to_text(o.queue_depth), "must be in 1..4096");
    }
    if (o.block_size == 0 || o.block_size % 4096 != 0) {
      throw invalid_option("block_size", detail::to_text(o.block_size),
                           "must be a positive multiple of 4096");
    }
    int const r = io_uring_queue_init(o.queue_depth, &ring_, 0);
    if (r < 0) {
      // ENOSYS: no kernel support; EPERM: forbidden (seccomp, kernel.io_uring_disabled).
      throw io_error(-r, "an io_uring of " + std::to_string(o.queue_depth) + " entries",
                     "io_uring_queue_init");
    }
  }
  ~uring_engine() { io_uring_queue_exit(&ring_); }
  uring_engine(uring_engine const&)            = delete;
  uring_engine& operator=(uring_engine const&) = delete;

  [[nodiscard]] engine_options const& options() const noexcept { return opts_; }

  /// Runs every request to completion; returns when all are done. On failure throws the
  /// first io_error, after all pieces in flight have completed.
  void submit(std::span<request const> requests)
  {
    struct piece {
      std::size_t request;
      std::uint64_t offset;
      std::byte* data;
      std::size_t length;
    };
    std::deque<piece> todo;
    for (std::size_t i = 0; i < requests.size(); ++i) {
      auto const& r = requests[i];
      for (std::size_t done = 0; done < r.length; done += opts_.block_size) {
        std::size_t const n = std::min(opts_.block_size, r.length - done);
        todo.push_back({i, r.offset + done, r.data + done, n});
      }
    }
    std::vector<piece> slots(opts_.queue_depth);
    std::vector<unsigned> free_slots;
    for (unsigned s = opts_.queue_depth; s-- > 0;) { free_slots.push_back(s); }
    unsigned in_flight = 0;
    int first_error    = 0;
    piece failed{};

    while ((!todo.empty() && first_error == 0) || in_flight > 0) {
      // Fill the ring (no new work once something failed).
      unsigned queued = 0;
      while (first_error == 0 && !todo.empty() && !free_slots.empty()) {
        io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
        if (sqe == nullptr) { break; }
        unsigned const s = free_slots.back();
        free_slots.pop_back();
        slots[s]        = todo.front();
        todo.pop_front();
        auto const& r = requests[slots[s].request];
        if (r.write) {
          io_uring_prep_write(sqe, r.fd, slots[s].data, static_cast<unsigned>(slots[s].length), slots[s].offset);
        } else {
          io_uring_prep_read(sqe, r.fd, slots[s].data, static_cast<unsigned>(slots[s].length), slots[s].offset);
        }
        io_uring_sqe_set_data64(sqe, s);
        ++queued;
      }
      in_flight += queued;
      int const w = io_uring_submit_and_wait(&ring_, in_flight > 0 ? 1 : 0);
      if (w < 0 && w != -EINTR && w != -EAGAIN) {
        // The ring itself failed: nothing more can be waited for reliably.
        throw io_error(-w, "the io_uring", "io_uring_submit_and_wait");
      }
      io_uring_cqe* cqe = nullptr;
      while (io_uring_peek_cqe(&ring_, &cqe) == 0 && cqe != nullptr) {
        auto const s   = static_cast<unsigned>(io_uring_cqe_get_data64(cqe));
        int const res  = cqe->res;
        io_uring_cqe_seen(&ring_, cqe);
        --in_flight;
        piece p = slots[s];
        free_slots.push_back(s);
        if (res < 0 || (res == 0 && p.length > 0)) {
          if (first_error == 0) {
            first_error = res < 0 ? -res : ENODATA;  // 0 bytes: past the end of the file
            failed      = p;
          }
        } else if (static_cast<std::size_t>(res) < p.length) {
          // Short transfer: requeue the remainder, first.
          auto const n = static_cast<std::size_t>(res);
          todo.push_front({p.request, p.offset + n, p.data + n, p.length - n});
        }
      }
    }
    if (first_error != 0) {
      auto const& r = requests[failed.request];
      throw io_error(first_error, r.path != nullptr ? *r.path : std::string("(fd ") + std::to_string(r.fd) + ")",
                     r.write ? "write" : "read", failed.offset, failed.length);
    }
  }

 private:
  engine_options opts_;
  io_uring ring_{};
};

}  // namespace tierstate::io
