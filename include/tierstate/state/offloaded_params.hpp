// SPDX-License-Identifier: Apache-2.0
// offloaded_params: model weights that rest in a tier (PinnedHost, NvmeFile, a user's) and
// are brought, a few layers at a time, into a bounded window of buffers where the model
// computes with them.
//
// The trainer registers its tensors grouped by layer, in layer order, then each iteration
// (forward, backward, the optimizer's step) asks for each layer as it needs it:
//
//   offloaded_params<bf16, NvmeFile> w(opts);         // opts.tier.directory, opts.window
//   auto l0 = w.add_layer("block0");
//   auto q  = w.add_tensor(l0, "block0.q", d * d);    // ... every tensor, every layer
//   w.write(q, 0, initial_q);                         // initial values (or load a checkpoint)
//   for (;;) {
//     for (l = 0..L-1)  { auto v = w.acquire(l); forward(v.tensor(0), ...); w.release(l); }
//     for (l = L-1..0)  { auto v = w.acquire(l); backward(...);            w.release(l); }
//     update: w.write(t, offset, new_values) for the params that changed
//     w.end_iteration();
//   }
//
// Read-ahead: while the trainer uses one layer, the next `window` layers it is expected to
// ask for are read into free buffers by the object's I/O thread. The expected order is, for
// the first iteration, every layer forward and then every layer in reverse (backward), and
// from the second on exactly the order of acquires in the previous iteration (the calls
// between two end_iteration()s, gradient accumulation's several passes included). A layer
// asked for out of that order is read on demand (stats: on_demand, out_of_order): slower,
// never wrong. A layer released stays in its buffer until the buffer is needed, so backward
// takes the last layer of forward without reading it again.
//
// Memory: up to write_behind_bytes of writes not yet in the tier (counted in the tier's whole
// blocks: a 4-byte write on NVMe takes 4 KiB), as much again of gradients (write_grad, on a
// thread of their own, into a second tier; at most two of the largest layer's), and (window +
// 1) buffers
// of the largest layer's bytes (4 KiB-aligned), allocated once,
// from `options::buffers` (std::pmr; aligned operator new by default), whatever the model's
// size; tensors under `persistence_threshold` elements (norms, biases) are kept in host
// memory instead, as ZeRO-3's param_persistence_threshold does, and need no buffer (with
// device buffers, one more allocation from `buffers` holds their device copies). The
// tier holds every other tensor, each layer's contiguous and 4 KiB-aligned, so a layer is
// one read.
//
// Writes: write() is the only way params change (written behind, up to write_behind_bytes:
// flush() waits for them; reads of the layer wait too), and it keeps every copy honest: a layer's
// buffer that holds older values is dropped (at release() where the layer is acquired, so
// the trainer's view does not change under it), and a read that was in flight when the
// write began is thrown away and done again. So the next acquire always sees the last
// write. A view shows the values of its acquire until release, however they are written
// meanwhile (a resident tensor's view is a copy made at acquire).
//
// Failures: a read ahead that failed is done again by the acquire() of its layer (counted:
// failed_reads, retried); a read that an acquire() waits for and that fails (an io_error from
// the tier) is thrown by it, which then holds nothing; the next acquire() reads again. A write
// that fails is thrown by flush() (by write() itself with write_behind_bytes = 0), and that
// layer's next acquire reads whatever the tier holds. Misuse (a layer
// acquired twice, released without acquire, unknown ids, registering after the tier was
// made, more layers acquired at once than there are buffers: all of them acquired, or read
// for an acquire that waits) throws tierstate::logic_error naming the layer, and changes
// nothing.
//
// Thread safety: registration (add_layer, add_tensor) belongs to one thread, before anything
// else; from then on every member may be called from any thread, acquire and release of one
// layer by one thread at a time.
#pragma once

#include <tierstate/core/config.hpp>
#include <tierstate/core/device_runtime.hpp>
#include <tierstate/core/error.hpp>
#include <tierstate/core/param_source.hpp>
#include <tierstate/core/tensor.hpp>
#include <tierstate/tiers/pinned_host.hpp>
#include <tierstate/tiers/tier.hpp>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <memory_resource>
#include <mutex>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

namespace tierstate::inline TIERSTATE_ABI {

template <class TierOptions>
struct offloaded_params_options {
  /// The tier's own options (NvmeFile: its directory, naming and engine).
  TierOptions tier{};
  /// Layers read ahead of the one in use: 1..64. The buffers are window + 1.
  unsigned window = 2;
  /// Tensors of fewer elements stay in host memory, never in the tier or a buffer (0: none).
  std::size_t persistence_threshold = 0;
  /// write() copies up to this many bytes (the whole tier blocks a write touches: 4 KiB
  /// ones on NVMe) and returns, the I/O thread writing them behind (flush() waits for them
  /// and throws a failure); a write beyond it waits for room. write_grad as much again (at
  /// most two of the largest layer's), on a thread of its own. 0: every write is done before
  /// write() (write_grad) returns.
  std::size_t write_behind_bytes = std::size_t{64} << 20;
  /// Where the buffers are: host memory (the model computes on the CPU), or device memory
  /// (a GPU, or the emulated device without CUDA): the views are then device pointers, the
  /// resident tensors' too (their values rest in host memory, copied up at each acquire).
  location where = location::host;
  /// Gradients: the optimizer's streaming step (OnHost compute) hands each offloaded
  /// tensor's final gradient to write_grad (ZeRO-3's order), kept in a
  /// second tier of the same kind, as large as the params' (made at the first write_grad, with
  /// `tier`'s options; a file_name gets ".grads" appended; resident tensors' in host memory),
  /// so the trainer may free it at once: with NvmeFile, host memory stays flat in the model's
  /// size. false: the trainer keeps its gradients until finish_step, and nothing is written.
  bool keep_grads = true;
  /// Where the window's buffers come from (host or device memory, as `where` says); null:
  /// std::pmr::new_delete_resource() on the host, device_memory_resource() on the device.
  std::pmr::memory_resource* buffers = nullptr;
};

/// Device memory (device::allocate_async, ready when it returns) as a std::pmr resource: the
/// default for device buffers, and a base for counting or pooling ones of your own.
class device_memory_resource : public std::pmr::memory_resource {
 private:
  void* do_allocate(std::size_t bytes, std::size_t) override
  {
    void* p = device::allocate_async(bytes, {});
    device::stream_view{}.synchronize();
    return p;
  }
  void do_deallocate(void* p, std::size_t, std::size_t) override
  {
    device::stream_view{}.synchronize();  // (no copy still reads or writes it)
    device::deallocate_async(p, {});
    device::stream_view{}.synchronize();
  }
  [[nodiscard]] bool do_is_equal(memory_resource const& o) const noexcept override { return this == &o; }
};

/// The process's device_memory_resource.
inline device_memory_resource& default_device_memory_resource()
{
  static device_memory_resource r;
  return r;
}

/// What the window did since it was made.
struct offload_stats {
  std::uint64_t acquires      = 0;  ///< acquire() calls that returned a layer with tier bytes
  std::uint64_t ready         = 0;  ///< ...whose layer was in a buffer already (read ahead, or kept)
  std::uint64_t waited        = 0;  ///< ...whose read-ahead was in flight: acquire waited for it
  std::uint64_t on_demand     = 0;  ///< ...whose read acquire had to start (not read ahead)
  std::uint64_t out_of_order  = 0;  ///< acquires that were not the next expected layer
  std::uint64_t reads         = 0;  ///< layers read from the tier
  std::uint64_t discarded     = 0;  ///< reads thrown away: the layer was written meanwhile
  std::uint64_t failed_reads  = 0;  ///< reads the tier failed
  std::uint64_t retried       = 0;  ///< acquires that read again a layer whose read ahead had failed
  std::uint64_t evicted       = 0;  ///< layers read ahead or kept, dropped for another
  std::uint64_t bytes_read    = 0;  ///< by the window's reads
  std::uint64_t bytes_written = 0;  ///< by write()
  std::uint64_t grad_bytes_written = 0;  ///< by write_grad()
  std::uint64_t grad_bytes_read    = 0;  ///< by read_grad()
  double wait_seconds         = 0;  ///< acquire() waiting for reads
};

template <class Param, tier Tier>
class offloaded_params final : public param_source<Param> {
 public:
  using param_type = Param;
  using tier_type  = Tier;
  using options    = offloaded_params_options<typename Tier::options>;
  using layer_id   = std::size_t;
  using tensor_id  = std::size_t;

  /// What acquire() hands the trainer: the layer's tensors, in the order they were added,
  /// valid until release().
  class layer_view {
   public:
    [[nodiscard]] layer_id layer() const noexcept { return layer_; }
    [[nodiscard]] std::size_t size() const noexcept { return tensors_.size(); }
    [[nodiscard]] std::span<Param const> tensor(std::size_t i) const
    {
      TIERSTATE_EXPECTS(i < tensors_.size(), "offloaded_params::layer_view::tensor(" + std::to_string(i) +
                                               "): the layer has " + std::to_string(tensors_.size()) + " tensors");
      return tensors_[i];
    }

   private:
    friend class offloaded_params;
    layer_id layer_ = 0;
    std::span<std::span<Param const> const> tensors_;
  };

  /// Checks the options (invalid_option names a bad one) and, for a tier with a preflight,
  /// the tier's; makes nothing yet.
  explicit offloaded_params(options const& o = {});
  /// Writes everything still behind, then stops the I/O thread (a write failing then is
  /// lost: call flush() first to hear of it).
  ~offloaded_params() override;
  offloaded_params(offloaded_params const&)            = delete;
  offloaded_params& operator=(offloaded_params const&) = delete;

  /// Registration, before the tier is made: layers in the order the model runs them, each
  /// tensor in a layer (in the order the layer's view lists them).
  layer_id add_layer(std::string name);
  tensor_id add_tensor(layer_id layer, std::string name, std::size_t count);

  /// Makes the tier (zero-filled: every param 0), the buffers and the I/O thread, from the
  /// tensors added so far; the first acquire, read or write does it too. From then on the
  /// set of tensors is fixed. A failure leaves nothing made.
  void materialize();
  [[nodiscard]] bool made() const
  {
    std::lock_guard lk(mu_);
    return made_;
  }

  /// Blocks until `layer`'s params are in a buffer and returns them; starts the reads of the
  /// layers expected next.
  [[nodiscard]] layer_view acquire(layer_id layer);
  /// The trainer is done with `layer` for now; its buffer may be reused. With device buffers,
  /// once the work queued on `done` so far (the stream that read the view) has finished.
  void release(layer_id layer, device::stream_view done = {});
  /// Ends an iteration: the acquires since the last call become the order expected next,
  /// and the reads of its first layers start. Refused while a layer is acquired.
  void end_iteration();

  /// Reads or writes elements [offset, offset + n) of a tensor, wherever it rests, with no
  /// buffer of the window's: initial values, checkpoints, export, the optimizer's update.
  void read(tensor_id t, std::size_t offset, std::span<Param> to) override;
  void write(tensor_id t, std::size_t offset, std::span<Param const> from) override;
  /// Waits for every params' write behind and throws the first that failed (io_error; the tier then
  /// holds some of the values, and the params' next readers see what it holds). The
  /// optimizer calls it at the end of each step.
  void flush() override;
  /// Keeps tensor t's whole gradient (from.size() its size; the caller's memory is free when
  /// this returns): copied and written behind (write_behind_bytes), or written before it
  /// returns (0). read_grad reads back what the last write_grad kept, once written; one that
  /// failed (io_error) keeps none, and is wait_grad's and read_grad's error for t until the
  /// next write_grad. Refused (logic_error) with keep_grads false.
  [[nodiscard]] bool keeps_grads() const noexcept override { return opts_.keep_grads; }
  void write_grad(tensor_id t, std::span<Param const> from) override;
  void read_grad(tensor_id t, std::size_t offset, std::span<Param> to) override;
  void wait_grad(tensor_id t) override;

  [[nodiscard]] std::size_t layer_count() const noexcept { return layers_.size(); }
  [[nodiscard]] std::size_t tensor_count() const noexcept { return tensors_.size(); }
  [[nodiscard]] std::string const& layer_name(layer_id l) const { return layer_at(l, "layer_name").name; }
  [[nodiscard]] std::string const& tensor_name(tensor_id t) const override { return tensor_at(t, "tensor_name").name; }
  [[nodiscard]] std::size_t tensor_size(tensor_id t) const override { return tensor_at(t, "tensor_size").count; }
  [[nodiscard]] layer_id layer_of(tensor_id t) const { return tensor_at(t, "layer_of").layer; }
  [[nodiscard]] std::optional<tensor_id> find_tensor(std::string_view name) const;
  /// Whether `t` is kept in host memory (under persistence_threshold).
  [[nodiscard]] bool resident(tensor_id t) const { return tensor_at(t, "resident").resident; }
  /// One buffer's bytes (the largest layer's tier bytes), and how many there are.
  [[nodiscard]] std::size_t buffer_bytes() const noexcept { return buffer_bytes_; }
  [[nodiscard]] std::size_t buffer_count() const noexcept { return opts_.window + 1; }
  /// The tier's bytes, and the host memory of the resident tensors (the values, with host
  /// buffers what a held view shows, and with keep_grads their gradients). Set when made.
  [[nodiscard]] std::size_t tier_bytes() const noexcept { return tier_bytes_; }
  [[nodiscard]] std::size_t resident_bytes() const noexcept
  {
    return (resident_.size() + resident_grads_.size()) * sizeof(Param);
  }
  /// The order the next acquires are expected in (layer ids).
  [[nodiscard]] std::vector<layer_id> expected_order() const;
  [[nodiscard]] offload_stats stats() const;
  /// The tier itself (writes behind may not be in it yet: flush() first).
  [[nodiscard]] Tier& param_tier();

 private:
  static constexpr std::size_t tier_alignment   = 4096;
  static constexpr std::size_t tensor_alignment = 64;

  struct tensor_entry {
    std::string name;
    layer_id layer     = 0;
    std::size_t count  = 0;
    bool resident      = false;
    std::size_t offset = 0;  ///< in the tier, or (resident) in resident_ elements
    bool grad_kept     = false;  ///< write_grad kept a gradient (at the same offset)
    unsigned grad_pending = 0;   ///< its write_grads behind not yet done
    std::exception_ptr grad_failure;  ///< the last one's, once done
  };
  struct layer_entry {
    std::string name;
    std::vector<tensor_id> tensors;
    std::size_t offset = 0;  ///< in the tier
    std::size_t bytes  = 0;  ///< tier bytes, a multiple of 4 KiB (0: every tensor resident)
    int buffer         = -1;  ///< the buffer holding it, reading or read
    std::uint64_t version = 0;  ///< bumped by every write of its tier bytes
    unsigned writers   = 0;     ///< writes in progress
    bool acquired      = false;
    bool wanted        = false;  ///< an acquire waits for it
    std::exception_ptr failure;  ///< its last read's, until an acquire throws it
    std::vector<std::span<Param const>> views;
    std::unique_ptr<device::event> resident_released;  ///< device buffers, resident tensors: at release
    bool resident_stale = true;  ///< device buffers: its resident values changed since their device copies
  };
  enum class buffer_state : std::uint8_t { free, reading, ready, acquired };
  struct buffer {
    std::byte* data    = nullptr;
    buffer_state state = buffer_state::free;
    layer_id layer     = 0;
    std::uint64_t version = 0;  ///< the layer's version its bytes were read at
    std::unique_ptr<device::event> released;  ///< device buffers: recorded at release on its stream
  };
  struct read_job {
    layer_id layer;
    int buffer;
  };
  /// The tier's alignment (NvmeFile's O_DIRECT blocks), or 1.
  static constexpr std::size_t write_alignment = [] {
    if constexpr (requires { Tier::alignment; }) { return std::size_t{Tier::alignment}; }
    return std::size_t{1};
  }();
  static constexpr std::size_t buffer_alignment = std::max(write_alignment, alignof(std::max_align_t));
  struct aligned_delete {
    void operator()(std::byte* p) const noexcept { ::operator delete(p, std::align_val_t{buffer_alignment}); }
  };
  /// Values on their way to the tier at byte `at`, `size` bytes, copied once into an aligned
  /// buffer of whole blocks [lo, lo + n) at their place in it: written from there as is
  /// once the blocks' other bytes (the first and last block's) are read in.
  struct staged_write {
    std::size_t at = 0, size = 0, lo = 0, n = 0;
    std::unique_ptr<std::byte, aligned_delete> buffer;
  };
  struct write_job {
    std::size_t id;  ///< a layer (params), or a tensor (gradients)
    staged_write bytes;
  };

  layer_entry const& layer_at(layer_id l, char const* call) const;
  tensor_entry const& tensor_at(tensor_id t, char const* call) const;
  void check_range(tensor_id t, std::size_t offset, std::size_t n, char const* call) const;
  void make_locked();
  void io_loop();
  void grad_loop();  ///< the gradients' writes behind
  /// On the I/O thread: `bytes` bytes of the tier at `offset` into buffer `b`.
  void fill_buffer(buffer& b, std::size_t offset, std::size_t bytes);
  /// Under mu_: a buffer for a read: a free one, or one holding a layer not in `keep` (with
  /// `force`, any layer not acquired or being read), or -1.
  int take_buffer(std::vector<layer_id> const& keep, bool force);
  void start_read(layer_id l, int b, bool front);
  /// Under mu_: the next `window` distinct layers with tier bytes that are expected.
  [[nodiscard]] std::vector<layer_id> upcoming() const;
  void read_ahead();
  void drop(int b);
  void fill_views(layer_entry& l, std::byte const* data);
  /// Copies `from` (for byte `at` of the tier) into a staged write; writes it, under tier_mu_.
  [[nodiscard]] static staged_write stage(std::size_t at, std::span<std::byte const> from);
  /// The bytes stage() takes for `size` bytes at `at`: the whole blocks they touch.
  [[nodiscard]] static constexpr std::size_t staged_bytes(std::size_t at, std::size_t size) noexcept
  {
    return (at + size + write_alignment - 1) / write_alignment * write_alignment - at / write_alignment * write_alignment;
  }
  void write_staged(Tier& tier, staged_write& w);

  options opts_;
  std::vector<layer_entry> layers_;
  std::vector<tensor_entry> tensors_;
  std::unordered_map<std::string, tensor_id> index_;
  std::size_t tier_bytes_ = 0, buffer_bytes_ = 0, resident_count_ = 0;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::mutex tier_mu_;  ///< one tier call at a time (the tier concept's thread safety)
  std::unique_ptr<Tier> tier_;
  std::pmr::memory_resource* resource_ = nullptr;
  std::vector<buffer> buffers_;
  std::optional<device::stream> stream_;  ///< device buffers: the copies up
  std::unique_ptr<PinnedHost> staging_;    ///< device buffers, a tier not in host memory: one layer
  std::vector<Param> resident_;  ///< resident tensors' values, then (host buffers) the copies held views show
  Param* resident_device_ = nullptr;  ///< device buffers: the copies held views show, device memory
  std::mutex grad_mu_;                  ///< one call at a time into grad_tier_
  std::mutex grad_make_mu_;             ///< making it
  std::unique_ptr<Tier> grad_tier_;     ///< kept gradients, laid out as the params
  std::vector<Param> resident_grads_;   ///< resident tensors' kept gradients
  std::deque<write_job> grad_writes_;   ///< gradients written behind, in order (by grad_io_)
  std::size_t grad_behind_bytes_ = 0;
  std::deque<read_job> jobs_;
  std::deque<write_job> writes_;         ///< written behind, in order
  std::size_t behind_bytes_ = 0;         ///< theirs, the one being written included
  unsigned writing_         = 0;         ///< writes behind taken and not finished
  std::exception_ptr write_failure_;     ///< the first write behind that failed, for flush()
  std::vector<layer_id> expected_, recorded_;
  std::size_t cursor_ = 0;
  offload_stats stats_;
  bool made_     = false;
  bool stopping_ = false;
  std::thread io_, grad_io_;
};

}  // namespace tierstate

#include <tierstate/state/detail/offloaded_params.inl>
#include <tierstate/state/detail/offloaded_params_io.inl>
#include <tierstate/state/detail/offloaded_params_grads.inl>
