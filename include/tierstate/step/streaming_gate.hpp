// SPDX-License-Identifier: Apache-2.0
// The streaming gate: which chunk a step updates at each position of its order, and when a
// chunk may go. Closed (no streaming step), every gradient is ready and the order is the
// layout's: a plain step() passes it without waiting. Open (begin_step to finish_step),
// the gradients arrive tensor by tensor from any thread (hand_over), a chunk may go once
// every tensor in it has its final gradient, and the step runs on the gate's driver thread.
//
// The order of an open gate starts as the reverse of registration (backward's order) and
// then follows the order the previous step's chunks became ready. When the step's checks
// (non-finite, clipping) need every gradient, the first chunk waits for all of them and the
// checks run then, once; while it waits, each host gradient is looked at for infs and NaNs
// as it becomes final, so that by the last one only that one is left to look at. A late
// check (report, or skip_step on a shadowed state) waits for nothing: each chunk's gradients
// are looked at as it goes, and the check runs once every chunk has been updated.
#pragma once

#include <tierstate/core/device_runtime.hpp>
#include <tierstate/core/error.hpp>
#include <tierstate/core/layout.hpp>
#include <tierstate/core/stats.hpp>
#include <tierstate/core/tensor.hpp>
#include <tierstate/detail/optimizer/registry_parts.hpp>

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace tierstate::inline TIERSTATE_ABI::detail {

/// Thrown inside a streaming step's driver when the checks say skip; never leaves it.
struct skip_step_signal {};

/// `DeviceEvents`: gradients may be device memory, each final after the work queued on the
/// stream its grad_ready names (an event per tensor).
template <class Grad, class Coefficients, bool DeviceEvents>
class streaming_gate {
 public:
  streaming_gate() = default;
  /// Stops a driver still running (the optimizer destroyed mid-step): it leaves with an error.
  ~streaming_gate()
  {
    if (driver_.joinable()) {
      std::unique_lock lock(m_);
      abandoned_ = true;
      lock.unlock();
      cv_.notify_all();
      driver_.join();
    }
  }
  streaming_gate(streaming_gate const&)            = delete;
  streaming_gate& operator=(streaming_gate const&) = delete;

  /// Whether a streaming step is in progress; the chunk at position j of this step's order;
  /// the order the last streaming step's chunks became ready (empty before the first).
  [[nodiscard]] bool open() const noexcept { return open_; }
  [[nodiscard]] std::size_t chunk_at(std::size_t j) const noexcept { return open_ ? order_[j] : j; }
  [[nodiscard]] std::vector<std::size_t> const& next_order() const noexcept { return next_order_; }

  /// Opens the gate over `lay`'s chunks, chunk k holding `pending[k]` tensor pieces, and
  /// starts `drive` on the gate's thread. `checks`: the step's checks need every gradient;
  /// `late`: they run after the update (check_late), which looks at each chunk's as it goes.
  template <class Drive>
  void begin(layout const& lay, std::vector<std::size_t> pending, bool checks, bool late, unsigned micro_batches,
             double grad_scale, std::vector<Coefficients> coefficients, Drive&& drive)
  {
    std::size_t const n = lay.chunk_count();
    std::size_t const T = lay.tensors().size();
    lay_                = &lay;
    started_            = std::chrono::steady_clock::now();
    abandoned_          = false;
    checks_ = checks, checked_ = false, late_ = late && !checks;
    micro_batches_ = micro_batches, grad_scale_ = grad_scale;
    views_.assign(T, grad_view<Grad>{}), stashed_.assign(T, 0), sums_.assign(T, {}), looked_.assign(T, 0);
    late_found_.reset();
    kept_found_ = false, keep_error_ = nullptr, keeping_ = 0, finishing_ = false;
    arrivals_.assign(T, 0), final_.assign(T, 0);
    finals_ = 0;
    finished_.clear();
    finished_.reserve(T);  // (mark_final allocates nothing: a keep behind's ending cannot fail)
    pending_ = std::move(pending);
    ready_.assign(n, 0);
    arrival_.clear();
    arrival_.reserve(n);
    if (next_order_.size() == n) {
      order_ = next_order_;
    } else {  // backward's order: the last registered tensors' chunks first
      order_.resize(n);
      for (std::size_t j = 0; j < n; ++j) { order_[j] = n - 1 - j; }
    }
    if constexpr (DeviceEvents) {
      while (grad_events_.size() < T) { grad_events_.push_back(std::make_unique<device::event>()); }
    }
    coefficients_ = std::move(coefficients);
    result_       = step_result{};
    error_        = nullptr;
    for (std::size_t t = 0; t < T; ++t) {
      if (lay.tensors()[t].count == 0) {  // an empty tensor is final from the start
        final_[t] = 1;
        ++finals_;
      }
    }
    open_ = true;
    try {
      driver_ = std::thread(std::forward<Drive>(drive));
    } catch (...) {
      open_ = false;
      throw;
    }
  }

  /// grad_ready, after its argument checks: tensor t's gradient `g` (final at its
  /// micro_batches-th call). `who` names it in a refusal. With `stash`, a final gradient is
  /// handed to keep(g), outside the lock, which keeps it elsewhere (the tensor's param_source)
  /// and returns what the checks need of it (its non-finite look and its norm's block sums):
  /// the gate then holds no pointer to it. A keep that throws hands nothing over. A keep that
  /// returns nullopt keeps it behind, on another thread, which then calls kept_behind(t, ...)
  /// or keep_failed(t, ...): the tensor is final then, and finish() waits for it.
  template <class Keep>
  void hand_over(std::size_t t, grad_view<Grad> g, std::string const& who, device::stream_view ready, bool stash,
                 Keep&& keep)
  {
    {
      std::unique_lock lock(m_);
      if (!open_) { throw logic_error("grad_ready: no streaming step is in progress (call begin_step)"); }
      if (lay_->tensors()[t].count == 0) { return; }  // nothing to update: final from the start
      if (final_[t] != 0) {  // (3, kept behind: handed over, counted in arrivals_)
        throw logic_error(who + (final_[t] == 2 ? " is being handed over by another thread"
                                                : " was already handed over " + std::to_string(arrivals_[t]) +
                                                    " time(s), and micro_batches is " + std::to_string(micro_batches_)));
      }
      if (stash && arrivals_[t] + 1 == micro_batches_) {
        final_[t] = 2;  // (being kept: a second hand-over is refused meanwhile)
        ++arrivals_[t];
        keeping_ += 2;  // this call's share, and a keep behind's (kept_behind or keep_failed gives it back)
        lock.unlock();
        std::optional<kept> k;
        try {
          k = keep(g);
        } catch (...) {
          lock.lock();
          final_[t] = 0;
          --arrivals_[t];
          keeping_ -= 2;
          if (finishing_) {  // finish_step ran meanwhile: no gradient, as for any not handed over
            views_[t] = grad_view<Grad>{};
            mark_final(t);
          }
          cv_.notify_all();
          throw;
        }
        lock.lock();
        if (!k) {  // kept behind: final once kept_behind or keep_failed says so
          if (final_[t] == 2) { final_[t] = 3; }  // (unless that happened already)
          --keeping_;  // (finish() waits for this too: nothing here outlives the step)
          cv_.notify_all();  // (under the lock: once it is released, finish() may return and the gate go)
          return;
        }
        keeping_ -= 2;
        stash_kept(t, g.size, std::move(*k));
      } else {
        views_[t] = g;
        if constexpr (DeviceEvents) {
          // The gradient is final after the work queued on `ready` so far.
          if (g.where == location::device) { grad_events_[t]->record(ready); }
        } else {
          (void)ready;
        }
        if (++arrivals_[t] == micro_batches_) { mark_final(t); }
      }
      cv_.notify_all();
    }
  }

  /// What keep() found in a gradient it kept: an inf or a NaN (when the step looks for them),
  /// its norm's block sums (when the step clips).
  struct kept {
    bool nonfinite = false;
    std::vector<double> sums;
  };
  /// From the thread a keep went on to: tensor t's gradient, of n elements, is kept, and `k`
  /// is what the checks need of it. (Nothing here allocates: begin() reserved it.)
  void kept_behind(std::size_t t, std::size_t n, kept k) noexcept
  {
    std::lock_guard lock(m_);
    --keeping_;
    stash_kept(t, n, std::move(k));
    cv_.notify_all();  // (under the lock, as in hand_over)
  }
  /// ...or it could not be kept: the step fails with `failure` (before it changes anything,
  /// where the checks wait for every gradient; else at the next chunk it reaches).
  void keep_failed(std::size_t t, std::exception_ptr failure) noexcept
  {
    std::lock_guard lock(m_);
    --keeping_;
    if (!keep_error_) { keep_error_ = std::move(failure); }
    views_[t] = grad_view<Grad>{};
    mark_final(t);
    cv_.notify_all();
  }
  /// Whether tensor t's gradient was kept elsewhere (its view then has no data), in this step;
  /// whether any kept gradient held an inf or a NaN.
  [[nodiscard]] bool stashed(std::size_t t) const noexcept { return open_ && stashed_[t] != 0; }
  [[nodiscard]] bool kept_nonfinite() const noexcept { return open_ && kept_found_; }
  /// Per tensor, the kept gradients' block sums (empty for the others).
  [[nodiscard]] std::span<std::vector<double> const> kept_sums() const noexcept
  {
    return open_ ? std::span<std::vector<double> const>(sums_) : std::span<std::vector<double> const>();
  }

  /// Blocks until chunk k (whose pieces are `pieces`) may go; the first time, when the checks
  /// need every gradient, until all are in, and then runs check(views, grad_scale,
  /// coefficients, result, looked), which says false to skip the step. While it waits, each
  /// gradient is handed to look(view) as it becomes final (whether it holds an inf or a NaN,
  /// for a host gradient; nullopt where look looks at nothing): `looked` is then whether any
  /// did, so the check that needs them all is left with the last ones alone. A late check's
  /// chunk instead hands look its tensors' gradients not looked at yet, once it may go (their
  /// finds are check_late's `looked`). Before a device gradient is read, wait(event) orders
  /// the reading streams behind it.
  template <class Check, class Look, class Wait>
  void await(std::size_t k, std::span<chunk_piece const> pieces, step_stats& stats, Check&& check, Look&& look,
             Wait&& wait)
  {
    if (!open_) { return; }
    auto const t0 = std::chrono::steady_clock::now();
    std::unique_lock lock(m_);
    if (checks_ && !checked_) {
      // Looking, on this thread (and the pool it hands work to), at each gradient once it is
      // final, while backward makes the next ones; until every one is in and looked at.
      std::optional<bool> looked;
      double looking   = 0;
      std::size_t seen = 0;
      for (;;) {
        cv_.wait(lock, [&] { return abandoned_ || seen < finished_.size() || finals_ == views_.size(); });
        if (abandoned_) { throw logic_error("the optimizer was destroyed during a streaming step"); }
        if (seen == finished_.size()) { break; }
        std::vector<std::size_t> const batch(finished_.begin() + static_cast<std::ptrdiff_t>(seen), finished_.end());
        seen = finished_.size();
        lock.unlock();  // a final view changes no more: it is read without the lock
        auto const l0 = std::chrono::steady_clock::now();
        for (std::size_t const t : batch) {
          if (looked.value_or(false)) { break; }  // found already: the step is skipped anyway
          std::optional<bool> const f = look(views_[t]);
          if (f) { looked = looked.value_or(false) || *f; }
        }
        looking += seconds_since(l0);
        lock.lock();
      }
      if (keep_error_) { std::rethrow_exception(keep_error_); }  // (checks not run: the step can be taken again)
      checked_ = true;
      lock.unlock();
      stats.grad_wait_seconds += seconds_since(t0) - looking;
      if constexpr (DeviceEvents) {  // every gradient's device work first
        for (std::size_t t = 0; t < views_.size(); ++t) {
          if (views_[t].where == location::device && views_[t].data != nullptr) { wait(*grad_events_[t]); }
        }
      }
      bool const go = check(std::span<grad_view<Grad> const>(views_), grad_scale_, coefficients_, result_, looked);
      stats.check_seconds += looking;
      if (!go) { throw skip_step_signal{}; }
      return;
    }
    cv_.wait(lock, [&] { return abandoned_ || ready_[k] != 0; });
    if (abandoned_) { throw logic_error("the optimizer was destroyed during a streaming step"); }
    if (keep_error_) { std::rethrow_exception(keep_error_); }
    lock.unlock();
    stats.grad_wait_seconds += seconds_since(t0);
    if constexpr (DeviceEvents) {  // the device work that made these gradients comes first
      for (auto const& pc : pieces) {
        auto const& v = views_[pc.tensor];
        if (v.where == location::device && v.data != nullptr) { wait(*grad_events_[pc.tensor]); }
      }
    } else {
      (void)wait;
    }
    for (auto const& pc : pieces) {  // a late check's looks: each final gradient once, until one is found
      if (!late_ || std::exchange(looked_[pc.tensor], 1) != 0 || late_found_.value_or(false)) { continue; }
      if (std::optional<bool> const f = look(views_[pc.tensor])) { late_found_ = late_found_.value_or(false) || *f; }
    }
  }

  /// Whether this step's checks run late, and (the driver's, once every chunk went through
  /// await) running them: check(views, grad_scale, coefficients, result, looked), as await's.
  [[nodiscard]] bool late() const noexcept { return open_ && late_; }
  /// Per tensor: its gradient is final and present (what a step may have updated so far).
  [[nodiscard]] std::vector<char> final_with_gradient()
  {
    std::lock_guard lock(m_);
    std::vector<char> f(views_.size());
    for (std::size_t t = 0; t < f.size(); ++t) { f[t] = final_[t] == 1 && (views_[t].data != nullptr || stashed_[t] != 0); }
    return f;
  }
  template <class Check> bool check_late(Check&& check)
  {
    return check(std::span<grad_view<Grad> const>(views_), grad_scale_, coefficients_, result_, late_found_);
  }
  [[nodiscard]] bool ready_now(std::size_t k)  ///< whether chunk k may go without waiting
  {
    std::lock_guard lock(m_);
    return ready_[k] != 0 && (!checks_ || checked_);
  }

  // --- the driver's (between begin and finish) -------------------------------------------
  [[nodiscard]] std::span<grad_view<Grad> const> views() const noexcept { return views_; }
  [[nodiscard]] std::vector<Coefficients>& coefficients() noexcept { return coefficients_; }
  [[nodiscard]] step_result& result() noexcept { return result_; }
  void fail(std::exception_ptr e) noexcept { error_ = std::move(e); }

  /// finish_step: every tensor not handed over has no gradient; waits for the driver, closes
  /// the gate and returns the step's result, or rethrows the driver's failure.
  step_result finish()
  {
    {
      std::unique_lock lock(m_);
      finishing_ = true;  // (a gradient being kept now becomes final when its keep ends)
      for (std::size_t t = 0; t < views_.size(); ++t) {
        if (final_[t] != 0) { continue; }
        views_[t] = grad_view<Grad>{};
        mark_final(t);
      }
      cv_.notify_all();
      cv_.wait(lock, [&] { return keeping_ == 0; });  // (the driver may have left early: no keep outlives the step)
    }
    driver_.join();
    { std::lock_guard const lock(m_); open_ = false; }
    next_order_ = arrival_;  // the next step follows the order this one's chunks came in
    if (error_) { std::rethrow_exception(error_); }
    result_.stats.total_seconds = seconds_since(started_);
    return result_;
  }

 private:
  /// Tensor t's gradient (n elements) was kept elsewhere and is final. Under m_.
  void stash_kept(std::size_t t, std::size_t n, kept&& k) noexcept
  {
    views_[t]   = grad_view<Grad>{nullptr, n, location::host};
    stashed_[t] = 1;
    kept_found_ = kept_found_ || k.nonfinite;
    sums_[t]    = std::move(k.sums);
    mark_final(t);
  }
  /// Tensor t's gradient is final (or absent): its chunks may become ready. Under m_.
  void mark_final(std::size_t t) noexcept
  {
    final_[t] = 1;
    ++finals_;
    finished_.push_back(t);
    std::size_t const ce = lay_->chunk_elements();
    auto const& ext      = lay_->tensors()[t];
    for (std::size_t k = ext.offset / ce; k <= (ext.offset + ext.count - 1) / ce; ++k) {
      if (--pending_[k] == 0) {  // its last tensor: the chunk may go
        ready_[k] = 1;
        arrival_.push_back(k);
      }
    }
  }

  std::mutex m_;
  std::condition_variable cv_;
  layout const* lay_ = nullptr;
  bool open_ = false, abandoned_ = false;  ///< (abandoned: the optimizer is being destroyed mid-step)
  bool checks_ = false, checked_ = false;  ///< the checks wait for every gradient; they ran
  bool late_ = false;               ///< they run after the update (check_late)
  std::vector<char> looked_;        ///< per tensor: a late check looked at its gradient
  std::optional<bool> late_found_;  ///< what those looks found (nullopt: none looked at anything)
  unsigned micro_batches_ = 1;
  double grad_scale_ = 1.0;
  std::chrono::steady_clock::time_point started_;
  std::vector<grad_view<Grad>> views_;  ///< per tensor; {nullptr, 0}: no gradient
  std::vector<char> stashed_;           ///< per tensor: its gradient was kept elsewhere
  std::vector<std::vector<double>> sums_;  ///< per tensor: a kept gradient's norm block sums
  bool kept_found_ = false;             ///< a kept gradient held an inf or a NaN
  std::size_t keeping_ = 0;             ///< keeps not ended (on a grad_ready's thread, or behind)
  std::exception_ptr keep_error_;       ///< the first keep behind that failed: the step's error
  bool finishing_  = false;             ///< finish() has marked what was not handed over
  std::vector<unsigned> arrivals_;      ///< per tensor: grad_ready calls so far
  std::vector<char> final_;             ///< per tensor: gradient final (or absent); 2: being kept; 3: kept behind
  std::size_t finals_ = 0;
  std::vector<std::size_t> finished_;   ///< tensors in the order they became final
  std::vector<std::size_t> pending_;     ///< per chunk: its tensors not yet final
  std::vector<char> ready_;              ///< per chunk
  std::vector<std::size_t> arrival_;     ///< chunks in the order they became ready
  std::vector<std::size_t> order_;       ///< this step's chunk order
  std::vector<std::size_t> next_order_;  ///< the order the next streaming step starts with
  std::vector<std::unique_ptr<device::event>> grad_events_;  ///< per tensor: its gradient's readiness
  std::vector<Coefficients> coefficients_;
  step_result result_;
  std::exception_ptr error_;
  std::thread driver_;  ///< declared last
};

}  // namespace tierstate::detail
