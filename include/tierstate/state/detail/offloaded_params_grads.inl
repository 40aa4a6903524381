// SPDX-License-Identifier: Apache-2.0
// offloaded_params' gradients (state/offloaded_params.hpp, keep_grads): write_grad (written
// behind on a thread of their own, or at once), the thread's loop, wait_grad and read_grad.
#pragma once

#include <algorithm>
#include <exception>
#include <thread>

namespace tierstate::inline TIERSTATE_ABI {

template <class Param, tier Tier>
void offloaded_params<Param, Tier>::write_grad(tensor_id t, std::span<Param const> from)
{
  auto const& e = tensor_at(t, "write_grad");
  TIERSTATE_EXPECTS(opts_.keep_grads, "offloaded_params::write_grad('" + e.name + "'): keep_grads is false");
  TIERSTATE_EXPECTS(from.size() == e.count, "offloaded_params::write_grad('" + e.name + "'): the gradient has " +
                                              std::to_string(from.size()) + " elements, the tensor " +
                                              std::to_string(e.count));
  std::unique_lock lk(mu_);
  if (!made_) { make_locked(); }
  auto& te = tensors_[t];
  if (te.resident || from.empty()) {
    std::copy_n(from.data(), from.size(), resident_grads_.data() + te.offset);
    te.grad_kept = true;
    return;
  }
  lk.unlock();
  {
    std::lock_guard mk(grad_make_mu_);  // (not grad_mu_, which a write behind holds while it writes)
    if (!grad_tier_) {
      // Made at the first gradient, with the params' options; a file the params' options name
      // gets ".grads" after that name. (On the caller's thread: a failure is this call's.)
      auto grad_options = opts_.tier;
      if constexpr (requires { grad_options.file_name.append(".grads"); }) {
        if (!grad_options.file_name.empty()) { grad_options.file_name.append(".grads"); }
      }
      grad_tier_ = std::make_unique<Tier>(tier_bytes_, grad_options);  // (a failure makes nothing)
    }
  }
  auto const bytes = std::as_bytes(from);
  if (opts_.write_behind_bytes > 0) {
    // Behind: room for it first (counted in whole blocks, as stage() takes them; at most two
    // of the largest layer's, so that backward's next layer overlaps the last one's write
    // and no more waits in memory), then a copy, queued for the gradients' own thread (in
    // order: a block two tensors share is read and written back by one thread).
    std::size_t const n     = staged_bytes(te.offset, bytes.size());
    std::size_t const bound = std::min(opts_.write_behind_bytes, 2 * buffer_bytes_);
    lk.lock();
    if (!grad_io_.joinable()) { grad_io_ = std::thread([this] { grad_loop(); }); }
    cv_.wait(lk, [&] { return grad_behind_bytes_ == 0 || grad_behind_bytes_ + n <= bound; });
    grad_behind_bytes_ += n;
    lk.unlock();
    staged_write w;
    try {
      w = stage(te.offset, bytes);
      lk.lock();
      grad_writes_.push_back({t, std::move(w)});
    } catch (...) {  // (no room taken, nothing queued)
      if (!lk.owns_lock()) { lk.lock(); }
      grad_behind_bytes_ -= n;
      cv_.notify_all();
      throw;
    }
    ++te.grad_pending;  // (nothing below throws)
    te.grad_kept    = false;  // until it is written
    te.grad_failure = nullptr;
    cv_.notify_all();
    return;
  }
  lk.lock();
  te.grad_kept = false;  // until it is all written
  lk.unlock();
  std::lock_guard gk(grad_mu_);  // (the gradients' tier has a lock of its own: the window's reads go on)
  if (te.offset % write_alignment == 0 && bytes.size() % write_alignment == 0 &&
      reinterpret_cast<std::uintptr_t>(from.data()) % write_alignment == 0) {
    grad_tier_->write(te.offset, bytes);
  } else {
    staged_write w = stage(te.offset, bytes);
    write_staged(*grad_tier_, w);
  }
  lk.lock();
  te.grad_kept = true;
  stats_.grad_bytes_written += bytes.size();
}

template <class Param, tier Tier>
void offloaded_params<Param, Tier>::grad_loop()
{
  std::unique_lock lk(mu_);
  for (;;) {
    cv_.wait(lk, [&] { return stopping_ || !grad_writes_.empty(); });
    if (grad_writes_.empty()) { return; }  // (stopping: what was behind is written)
    write_job w = std::move(grad_writes_.front());
    grad_writes_.pop_front();
    lk.unlock();
    std::exception_ptr failure;
    try {
      std::lock_guard gk(grad_mu_);
      write_staged(*grad_tier_, w.bytes);
    } catch (...) {
      failure = std::current_exception();
    }
    w.bytes.buffer.reset();  // (freed outside the lock)
    lk.lock();
    grad_behind_bytes_ -= w.bytes.n;
    auto& te = tensors_[w.id];
    --te.grad_pending;
    if (!failure) { stats_.grad_bytes_written += w.bytes.size; }
    te.grad_kept    = !failure;  // (in order: the last one done is the last write_grad once none is pending)
    te.grad_failure = failure;
    cv_.notify_all();
  }
}

template <class Param, tier Tier>
void offloaded_params<Param, Tier>::wait_grad(tensor_id t)
{
  (void)tensor_at(t, "wait_grad");
  std::unique_lock lk(mu_);
  auto const& e = tensors_[t];
  cv_.wait(lk, [&] { return e.grad_pending == 0; });
  if (e.grad_failure) { std::rethrow_exception(e.grad_failure); }
}

template <class Param, tier Tier>
void offloaded_params<Param, Tier>::read_grad(tensor_id t, std::size_t offset, std::span<Param> to)
{
  check_range(t, offset, to.size(), "read_grad");
  std::unique_lock lk(mu_);
  auto const& e = tensors_[t];
  cv_.wait(lk, [&] { return e.grad_pending == 0; });  // (its write behind is in the tier)
  if (e.grad_failure) { std::rethrow_exception(e.grad_failure); }
  TIERSTATE_EXPECTS(e.grad_kept, "offloaded_params::read_grad('" + e.name +
                                   "'): no gradient is kept for it (write_grad keeps one; one that failed keeps none)");
  if (e.resident || to.empty()) {
    std::copy_n(resident_grads_.data() + e.offset + offset, to.size(), to.data());
    return;
  }
  lk.unlock();
  {
    std::lock_guard gk(grad_mu_);
    grad_tier_->read(e.offset + offset * sizeof(Param), std::as_writable_bytes(to));
  }
  lk.lock();
  stats_.grad_bytes_read += to.size_bytes();
}

}  // namespace tierstate
