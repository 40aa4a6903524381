// SPDX-License-Identifier: Apache-2.0
// The psync backend: pread and pwrite on a pool of queue_depth threads, for machines where
// io_uring is forbidden. Chosen by the user (engine_options::backend), never silently.
#pragma once

#include <tierstate/core/thread_pool.hpp>
#include <tierstate/io/detail/pieces.hpp>
#include <tierstate/io/request.hpp>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <mutex>
#include <span>
#include <vector>

#include <unistd.h>

namespace tierstate::io {

class psync_engine {
 public:
  explicit psync_engine(engine_options const& o = {}) : opts_((o.validate(), o)), pool_(o.queue_depth) {}

  [[nodiscard]] engine_options const& options() const noexcept { return opts_; }

  void submit(std::span<request const> requests)
  {
    std::vector<detail::piece> const pieces = detail::cut(requests, opts_.block_size);
    std::atomic<std::size_t> next{0};
    std::atomic<bool> failed{false};
    std::mutex m;
    detail::first_failure failure;
    pool_.parallel_for(std::min<std::size_t>(pool_.size(), pieces.size()), 1, [&](std::size_t, std::size_t) {
      for (std::size_t i; !failed.load(std::memory_order_relaxed) && (i = next++) < pieces.size();) {
        detail::piece p = pieces[i];
        int const err   = transfer(requests[p.request], p);
        if (err != 0) {
          std::scoped_lock lock(m);
          failure.note(err, p);
          failed = true;
        }
      }
    });
    failure.rethrow(requests);
  }

 private:
  /// One piece, short transfers continued; 0, or an errno with `p` left as the part that failed.
  int transfer(request const& r, detail::piece& p)
  {
    while (p.length > 0) {
      std::size_t n = p.length;
      if (opts_.faults) {
        auto const d = opts_.faults->next(r.write ? op::write : op::read, n);
        if (d.error != 0) { return d.error; }
        n = d.length;
      }
      ssize_t const got = r.write ? ::pwrite(r.fd, p.data, n, static_cast<off_t>(p.offset))
                                  : ::pread(r.fd, p.data, n, static_cast<off_t>(p.offset));
      if (got < 0) {
        if (errno == EINTR || errno == EAGAIN) { continue; }
        return errno;
      }
      if (got == 0) { return detail::no_progress_error(r.write); }
      auto const k = static_cast<std::size_t>(got);
      p.offset += k;
      p.data += k;
      p.length -= k;
    }
    return 0;
  }

  engine_options opts_;
  thread_pool pool_;
};

}  // namespace tierstate::io
