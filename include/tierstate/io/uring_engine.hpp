// SPDX-License-Identifier: Apache-2.0
// The io_uring backend (see io/engine.hpp for the contract). Each of `rings` rings keeps
// up to queue_depth pieces in flight; with several rings, each is driven by its own thread
// during a batch, the pieces dealt out round-robin. Inside the rings results are -errno
// values; exceptions leave only through submit(), after every ring has drained.
#pragma once

#include <tierstate/core/thread_pool.hpp>
#include <tierstate/io/detail/pieces.hpp>
#include <tierstate/io/request.hpp>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include <liburing.h>
#include <sys/uio.h>

namespace tierstate::io {

class uring_engine {
 public:
  /// Throws tierstate::invalid_option for bad options, and io_error (operation
  /// "io_uring_queue_init") where io_uring is unavailable.
  explicit uring_engine(engine_options const& o = {})
    : opts_((o.validate(), o)), rings_(o.rings), pool_(o.rings)
  {
    for (unsigned i = 0; i < o.rings; ++i) {
      int const r = io_uring_queue_init(o.queue_depth, &rings_[i].ring, 0);
      if (r < 0) {
        for (unsigned j = 0; j < i; ++j) { io_uring_queue_exit(&rings_[j].ring); }
        throw io_error(-r, "an io_uring of " + std::to_string(o.queue_depth) + " entries",
                       "io_uring_queue_init", 0, 0,
                       std::string(r == -ENOSYS  ? "io_uring is not in this kernel"
                                   : r == -EPERM ? "io_uring is forbidden here, by a seccomp filter "
                                                   "or kernel.io_uring_disabled"
                                                 : "io_uring is unavailable") +
                         "; engine_options::backend = psync uses pread/pwrite instead");
      }
    }
  }
  ~uring_engine()
  {
    for (auto& r : rings_) { io_uring_queue_exit(&r.ring); }
  }
  uring_engine(uring_engine const&)            = delete;
  uring_engine& operator=(uring_engine const&) = delete;

  [[nodiscard]] engine_options const& options() const noexcept { return opts_; }

  /// Registers one region as fixed buffer 0 of every ring (replacing any earlier one).
  /// Returns 0 or the refusing errno (ENOMEM: over RLIMIT_MEMLOCK); on refusal nothing
  /// stays registered and transfers go on unregistered.
  int register_buffer(std::span<std::byte> region)
  {
    unregister();
    if (region.empty()) { return 0; }
    iovec const v{region.data(), region.size()};
    for (std::size_t i = 0; i < rings_.size(); ++i) {
      int const r = io_uring_register_buffers(&rings_[i].ring, &v, 1);
      if (r < 0) {
        for (std::size_t j = 0; j < i; ++j) { io_uring_unregister_buffers(&rings_[j].ring); }
        return -r;
      }
    }
    registered_ = region;
    return 0;
  }
  [[nodiscard]] std::span<std::byte> registered() const noexcept { return registered_; }

  void submit(std::span<request const> requests)
  {
    std::vector<detail::piece> const pieces = detail::cut(requests, opts_.block_size);
    if (pieces.empty()) { return; }
    std::mutex m;
    detail::first_failure failure;
    std::size_t const used = std::min<std::size_t>(rings_.size(), pieces.size());
    pool_.parallel_for(used, 1, [&](std::size_t b, std::size_t e) {
      for (std::size_t i = b; i < e; ++i) {
        std::deque<detail::piece> todo;
        for (std::size_t p = i; p < pieces.size(); p += used) { todo.push_back(pieces[p]); }
        detail::first_failure f = drive(rings_[i].ring, requests, std::move(todo));
        if (f.error != 0) {
          std::scoped_lock lock(m);
          failure.note(f.error, f.where);
        }
      }
    });
    failure.rethrow(requests);
  }

 private:
  struct ring_holder {
    io_uring ring{};
  };

  void unregister() noexcept
  {
    if (registered_.empty()) { return; }
    for (auto& r : rings_) { io_uring_unregister_buffers(&r.ring); }
    registered_ = {};
  }

  [[nodiscard]] bool is_fixed(detail::piece const& p) const noexcept
  {
    return !registered_.empty() && p.data >= registered_.data() &&
           p.data + p.length <= registered_.data() + registered_.size();
  }

  /// Runs `todo` through one ring; returns its first failure (after draining).
  detail::first_failure drive(io_uring& ring, std::span<request const> requests,
                              std::deque<detail::piece> todo) noexcept
  {
    std::vector<detail::piece> slots(opts_.queue_depth);
    std::vector<unsigned> free_slots;
    for (unsigned s = opts_.queue_depth; s-- > 0;) { free_slots.push_back(s); }
    unsigned in_flight = 0;
    detail::first_failure failure;

    while ((!todo.empty() && failure.error == 0) || in_flight > 0) {
      // Fill the ring (no new work once something failed).
      while (failure.error == 0 && !todo.empty() && !free_slots.empty()) {
        detail::piece p = todo.front();
        auto const& r   = requests[p.request];
        std::size_t n   = p.length;
        if (opts_.faults) {
          auto const d = opts_.faults->next(r.write ? op::write : op::read, n);
          if (d.error != 0) {
            todo.pop_front();
            failure.note(d.error, p);
            break;
          }
          n = d.length;
        }
        io_uring_sqe* sqe = io_uring_get_sqe(&ring);
        if (sqe == nullptr) { break; }
        todo.pop_front();
        unsigned const s = free_slots.back();
        free_slots.pop_back();
        slots[s] = p;
        auto const len = static_cast<unsigned>(n);
        if (is_fixed(p)) {
          if (r.write) {
            io_uring_prep_write_fixed(sqe, r.fd, p.data, len, p.offset, 0);
          } else {
            io_uring_prep_read_fixed(sqe, r.fd, p.data, len, p.offset, 0);
          }
        } else if (r.write) {
          io_uring_prep_write(sqe, r.fd, p.data, len, p.offset);
        } else {
          io_uring_prep_read(sqe, r.fd, p.data, len, p.offset);
        }
        io_uring_sqe_set_data64(sqe, s);
        ++in_flight;
      }
      if (in_flight == 0) { continue; }
      int const w = io_uring_submit_and_wait(&ring, 1);
      if (w < 0 && w != -EINTR && w != -EAGAIN && w != -EBUSY) {
        // The ring itself failed. Pieces may still be in flight: wait for them without
        // submitting more, so no buffer is left in the kernel's hands.
        failure.note(-w, slots[0]);
        io_uring_cqe* cqe = nullptr;
        while (in_flight > 0 && io_uring_wait_cqe(&ring, &cqe) == 0) {
          io_uring_cqe_seen(&ring, cqe);
          --in_flight;
        }
        return failure;
      }
      io_uring_cqe* cqe = nullptr;
      while (io_uring_peek_cqe(&ring, &cqe) == 0 && cqe != nullptr) {
        auto const s  = static_cast<unsigned>(io_uring_cqe_get_data64(cqe));
        int const res = cqe->res;
        io_uring_cqe_seen(&ring, cqe);
        --in_flight;
        detail::piece const p = slots[s];
        free_slots.push_back(s);
        bool const write = requests[p.request].write;
        if (res < 0) {
          failure.note(-res, p);
        } else if (res == 0) {
          failure.note(detail::no_progress_error(write), p);
        } else if (static_cast<std::size_t>(res) < p.length) {
          // Short transfer: requeue the remainder, first.
          auto const n = static_cast<std::size_t>(res);
          todo.push_front({p.request, p.offset + n, p.data + n, p.length - n});
        }
      }
    }
    return failure;
  }

  engine_options opts_;
  std::vector<ring_holder> rings_;
  thread_pool pool_;
  std::span<std::byte> registered_;
};

}  // namespace tierstate::io
