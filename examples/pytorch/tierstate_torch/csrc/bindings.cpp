// SPDX-License-Identifier: Apache-2.0
// Python bindings: tierstate_torch._C.Shard, one OffloadedOptimizer over the parameters of
// one dtype on one device. The Python optimizer (tierstate_torch/optim.py) owns the param groups and
// turns torch.optim's conventions into calls on its shards.
//
// The GIL is released while the optimizer works: its threads never call into Python, and
// autograd's threads may hand over gradients (grad_ready) meanwhile.
#include "param_store.hpp"
#include "shard.hpp"

#include <tierstate/kernels/host/finite.hpp>
#include <tierstate/plan/plan.hpp>
#include <tierstate/ranks/partition.hpp>

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>

#include <cmath>
#include <cstring>
#include <memory>
#include <span>
#include <stdexcept>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace tierstate_torch {
namespace {

[[nodiscard]] dtype to_dtype(at::ScalarType t, char const* what)
{
  switch (t) {
    case at::kFloat: return dtype::f32;
    case at::kBFloat16: return dtype::bf16;
    case at::kHalf: return dtype::f16;
    default:
      throw std::invalid_argument(std::string("tierstate_torch: ") + what +
                                  " must be float32, bfloat16 or float16, not " +
                                  std::string(c10::toString(t)));
  }
}

/// state_dtype: float32, bfloat16, or int8 (8-bit blockwise moments).
[[nodiscard]] dtype to_state_dtype(at::ScalarType t)
{
  if (t == at::kChar) { return dtype::i8; }
  if (t == at::kFloat || t == at::kBFloat16) { return to_dtype(t, "state_dtype"); }
  throw std::invalid_argument("tierstate_torch: state_dtype must be float32, bfloat16 or int8, not " +
                              std::string(c10::toString(t)));
}

[[nodiscard]] at::ScalarType to_scalar(dtype d)
{
  return d == dtype::f32 ? at::kFloat : d == dtype::bf16 ? at::kBFloat16 : at::kHalf;
}

[[nodiscard]] py::dict to_dict(result const& r)
{
  py::dict d;
  d["found_nonfinite"]    = r.found_nonfinite;
  d["skipped"]            = r.skipped;
  d["deferred"]           = r.deferred;
  d["step"]               = r.step;
  d["grad_norm"]          = r.grad_norm;
  d["tier_bytes_read"]    = r.tier_bytes_read;
  d["tier_bytes_written"] = r.tier_bytes_written;
  d["check_seconds"]      = r.check_seconds;
  d["compute_seconds"]    = r.compute_seconds;
  d["wait_seconds"]       = r.wait_seconds;
  d["grad_wait_seconds"]  = r.grad_wait_seconds;
  d["total_seconds"]      = r.total_seconds;
  return d;
}

/// tierstate_torch._C.ParamStore: offloaded_params for offload_parameters (_offload.py),
/// which copies a layer's tensors into the params' own storage at each fetch.
class py_param_store {
 public:
  explicit py_param_store(store_config c) : dtype_(c.param), store_(make_param_store(c)) {}

  std::size_t add_layer(std::string const& name) { return store_->add_layer(name); }
  std::size_t add_tensor(std::size_t layer, std::string const& name, std::size_t count)
  {
    return store_->add_tensor(layer, name, count);
  }
  void materialize()
  {
    py::gil_scoped_release nogil;
    store_->materialize();
  }

  /// Acquires `layer` and copies its tensors into `into` (one per tensor, in order, each of
  /// the tensor's elements and the store's dtype, on the buffers' device), in work queued on
  /// the current stream (`stream`, which a failure's release names); the layer stays
  /// acquired until release().
  void fetch(std::size_t layer, std::vector<at::Tensor> const& into, std::uintptr_t stream)
  {
    for (auto const& t : into) {
      if (t.scalar_type() != to_scalar(dtype_) || !t.is_contiguous()) {
        throw std::invalid_argument("tierstate_torch: ParamStore.fetch: a destination of " +
                                    std::string(c10::toString(t.scalar_type())) +
                                    (t.is_contiguous() ? "" : ", not contiguous,") + " for a store of " +
                                    std::string(c10::toString(to_scalar(dtype_))));
      }
    }
    py::gil_scoped_release nogil;
    auto const spans = store_->acquire(layer);
    try {
      if (spans.size() != into.size()) {
        throw std::invalid_argument("tierstate_torch: ParamStore.fetch: layer " + std::to_string(layer) + " has " +
                                    std::to_string(spans.size()) + " tensors, and " + std::to_string(into.size()) +
                                    " destinations were given");
      }
      for (std::size_t i = 0; i < spans.size(); ++i) {
        auto const n = static_cast<std::int64_t>(spans[i].size() / into[i].element_size());
        if (n != into[i].numel()) {
          throw std::invalid_argument("tierstate_torch: ParamStore.fetch: tensor " + std::to_string(i) + " of layer " +
                                      std::to_string(layer) + " has " + std::to_string(n) +
                                      " elements, its destination " + std::to_string(into[i].numel()));
        }
        // (from_blob: the buffer's memory, read by the copy queued now, before release)
        auto const from = torch::from_blob(const_cast<std::byte*>(spans[i].data()), {n}, into[i].options());
        into[i].view({n}).copy_(from);
      }
    } catch (...) {
      store_->release(layer, stream);
      throw;
    }
  }

  void release(std::size_t layer, std::uintptr_t stream)
  {
    py::gil_scoped_release nogil;
    store_->release(layer, stream);
  }
  void end_iteration() { store_->end_iteration(); }

  /// Replaces tensor `t`'s values with `value`'s (its elements, any shape and device).
  void write(std::size_t t, at::Tensor const& value)
  {
    at::Tensor const v = host_values(t, value, "write");
    py::gil_scoped_release nogil;
    store_->write(t, 0, {static_cast<std::byte const*>(v.data_ptr()), static_cast<std::size_t>(v.nbytes())});
  }
  /// Tensor `t`'s values, as a 1-D CPU tensor.
  at::Tensor read(std::size_t t)
  {
    auto out = at::empty({static_cast<std::int64_t>(store_->tensor_size(t))}, to_scalar(dtype_));
    py::gil_scoped_release nogil;
    store_->read(t, 0, {static_cast<std::byte*>(out.data_ptr()), static_cast<std::size_t>(out.nbytes())});
    return out;
  }
  void flush()
  {
    py::gil_scoped_release nogil;
    store_->flush();
  }
  [[nodiscard]] bool resident(std::size_t t) const { return store_->resident(t); }
  [[nodiscard]] py::dict stats() const
  {
    auto const s = store_->stats();
    py::dict d;
    d["acquires"]           = s.acquires;
    d["ready"]              = s.ready;
    d["waited"]             = s.waited;
    d["on_demand"]          = s.on_demand;
    d["out_of_order"]       = s.out_of_order;
    d["reads"]              = s.reads;
    d["bytes_read"]         = s.bytes_read;
    d["bytes_written"]      = s.bytes_written;
    d["grad_bytes_written"] = s.grad_bytes_written;
    d["grad_bytes_read"]    = s.grad_bytes_read;
    d["wait_seconds"]       = s.wait_seconds;
    d["buffer_bytes"]       = s.buffer_bytes;
    d["buffer_count"]       = s.buffer_count;
    d["tier_bytes"]         = s.tier_bytes;
    d["resident_bytes"]     = s.resident_bytes;
    return d;
  }
  [[nodiscard]] param_store& store() noexcept { return *store_; }
  [[nodiscard]] dtype param_dtype() const noexcept { return dtype_; }

 private:
  at::Tensor host_values(std::size_t t, at::Tensor const& value, char const* call) const
  {
    std::size_t const n = store_->tensor_size(t);
    if (static_cast<std::size_t>(value.numel()) != n) {
      throw std::invalid_argument("tierstate_torch: ParamStore." + std::string(call) + ": tensor " + std::to_string(t) +
                                  " has " + std::to_string(n) + " elements, the value " +
                                  std::to_string(value.numel()));
    }
    return value.detach().to(at::kCPU, to_scalar(dtype_)).contiguous();
  }

  dtype dtype_;
  std::unique_ptr<param_store> store_;
};

class py_shard {
 public:
  explicit py_shard(config c) : dtype_(c.param), device_params_(c.device_params), shard_(make_shard(with_progress(c))) {}
  /// Python frees a shard with the GIL held; its driver thread, joined here, may be waiting
  /// for the GIL (an across-ranks hook of a streaming step abandoned by an exception).
  ~py_shard()
  {
    py::gil_scoped_release nogil;
    shard_.reset();
  }
  py_shard(py_shard const&)            = delete;
  py_shard& operator=(py_shard const&) = delete;

  std::size_t add_tensor(std::string const& name, at::Tensor const& p)
  {
    check_param(name, p);
    std::vector<std::size_t> dims;
    for (auto const d : p.sizes()) { dims.push_back(static_cast<std::size_t>(d)); }
    std::size_t const t = shard_->add_tensor(name, p.data_ptr(), dims);
    tensors_.push_back({name, p.data_ptr(), static_cast<std::size_t>(p.numel())});
    live_.emplace_back();
    return t;
  }

  /// Tensor `id` of `store` (offload_parameters), updated through the store.
  std::size_t add_offloaded(std::string const& name, py_param_store& store, std::size_t id)
  {
    if (store.param_dtype() != dtype_) {
      throw std::invalid_argument("tierstate_torch: offloaded parameter '" + name + "' is " +
                                  std::string(c10::toString(to_scalar(store.param_dtype()))) + "; this shard holds " +
                                  std::string(c10::toString(to_scalar(dtype_))));
    }
    std::size_t const count = store.store().tensor_size(id);
    std::size_t const t     = shard_->add_offloaded(name, store.store(), id);
    tensors_.push_back({name, nullptr, count});
    live_.emplace_back();
    return t;
  }

  std::size_t add_group(hyper const& h, std::vector<std::string> const& names)
  {
    return shard_->add_group(h, names);
  }
  void set_hyperparameters(std::size_t g, hyper const& h) { shard_->set_hyperparameters(g, h); }

  py::dict step(std::vector<std::optional<at::Tensor>> const& grads, double grad_scale, std::uintptr_t stream)
  {
    if (grads.size() != tensors_.size()) {
      throw std::invalid_argument("tierstate_torch: step() got " + std::to_string(grads.size()) +
                                  " gradients for " + std::to_string(tensors_.size()) + " tensors");
    }
    std::vector<grad_in> in(grads.size());
    std::vector<at::Tensor> held(grads.size());  // alive until the step returns
    for (std::size_t t = 0; t < grads.size(); ++t) {
      if (grads[t]) { in[t] = checked_grad(t, *grads[t], held[t]); }
    }
    result r;
    {
      py::gil_scoped_release nogil;
      r = shard_->step(in, grad_scale, stream);
    }
    return to_dict(r);
  }

  void begin_step(double grad_scale, unsigned micro_batches)
  {
    py::gil_scoped_release nogil;
    shard_->begin_step(grad_scale, micro_batches);
  }

  void grad_ready(std::size_t t, at::Tensor const& g, std::uintptr_t stream)
  {
    if (t >= tensors_.size()) {
      throw std::invalid_argument("tierstate_torch: grad_ready: no tensor " + std::to_string(t));
    }
    at::Tensor held;
    grad_in in = checked_grad(t, g, held);
    in.stream  = stream;
    {
      py::gil_scoped_release nogil;
      shard_->grad_ready(t, in);
    }
    // Kept from now until the step ends: the optimizer reads it after this returns. Only
    // once handed over: a refused call must not drop the gradient an earlier call handed
    // over, which the step still reads.
    std::lock_guard lock(live_mutex_);
    live_[t] = std::move(held);
  }

  /// After the final grad_ready of an offloaded tensor whose source keeps its gradient: the
  /// gradient is no longer held for the step, and true. A host one was kept before that call
  /// returned; a CUDA one's copy down is queued on the call's stream, which torch's
  /// allocator orders its memory's next use after (the caller records that stream on it).
  /// Otherwise (params not offloaded; the emulated device, whose streams are threads that
  /// torch's allocator knows nothing of) false: held until the step ends.
  bool drop_grad(std::size_t t)
  {
    if (t >= tensors_.size() || (device_params_ && device_is_emulated()) || !shard_->keeps_gradient(t)) {
      return false;
    }
    std::lock_guard lock(live_mutex_);
    live_[t].reset();
    return true;
  }

  py::dict finish_step()
  {
    struct release_at_exit {
      py_shard& s;
      ~release_at_exit() { s.release_grads(); }  // the step is over, even when it failed
    } const release{*this};
    result r;
    {
      py::gil_scoped_release nogil;
      r = shard_->finish_step();
    }
    return to_dict(r);
  }

  py::dict flush()
  {
    result r;
    {
      py::gil_scoped_release nogil;
      r = shard_->flush();
    }
    return to_dict(r);
  }

  void save(std::string const& path)
  {
    py::gil_scoped_release nogil;
    shard_->save(path);
  }

  /// The checkpoint as one uint8 CPU tensor (no file: OffloadedOptimizer::save_to).
  at::Tensor save_bytes()
  {
    std::vector<std::byte> bytes;
    {
      py::gil_scoped_release nogil;
      shard_->save_to([&](std::span<std::byte const> piece) { bytes.insert(bytes.end(), piece.begin(), piece.end()); });
    }
    auto out = at::empty({static_cast<std::int64_t>(bytes.size())}, at::kByte);
    std::memcpy(out.data_ptr(), bytes.data(), bytes.size());
    return out;
  }

  /// Loads a checkpoint from a uint8 tensor (save_bytes()'s; any device).
  void load_bytes(at::Tensor const& data)
  {
    if (data.scalar_type() != at::kByte || data.dim() != 1) {
      throw std::invalid_argument("tierstate_torch: a checkpoint is a 1-D uint8 tensor, not a " +
                                  std::to_string(data.dim()) + "-D " + std::string(c10::toString(data.scalar_type())) +
                                  " one");
    }
    at::Tensor const bytes = data.to(at::kCPU).contiguous();
    auto const* base       = static_cast<std::byte const*>(bytes.data_ptr());
    py::gil_scoped_release nogil;
    shard_->load_from(static_cast<std::uint64_t>(bytes.numel()), [base](std::uint64_t offset, std::span<std::byte> to) {
      std::memcpy(to.data(), base + offset, to.size());
    });
  }
  void load(std::string const& path)
  {
    py::gil_scoped_release nogil;
    shard_->load(path);
  }

  at::Tensor get_state(std::string const& name, std::string const& slot)
  {
    auto out = at::empty({static_cast<std::int64_t>(count_of(name))}, at::kFloat);
    py::gil_scoped_release nogil;
    shard_->copy_state(name, slot, std::span<float>(out.data_ptr<float>(), static_cast<std::size_t>(out.numel())));
    return out;
  }

  void set_state(std::string const& name, std::string const& slot, at::Tensor const& value)
  {
    std::size_t const n = count_of(name);
    if (value.numel() != static_cast<std::int64_t>(n)) {
      throw std::invalid_argument("tierstate_torch: state '" + slot + "' of '" + name + "' has " +
                                  std::to_string(value.numel()) + " elements; the tensor has " +
                                  std::to_string(n));
    }
    at::Tensor const v = value.detach().to(at::kCPU, at::kFloat).contiguous();
    py::gil_scoped_release nogil;
    shard_->write_state(name, slot, std::span<float const>(v.data_ptr<float>(), n));
  }

  /// A rule's per-tensor state (Adafactor's statistics), as float32 on the CPU.
  at::Tensor get_tensor_state(std::string const& name)
  {
    auto out = at::empty({static_cast<std::int64_t>(shard_->tensor_state_size(name))}, at::kFloat);
    py::gil_scoped_release nogil;
    shard_->copy_tensor_state(name, std::span<float>(out.data_ptr<float>(), static_cast<std::size_t>(out.numel())));
    return out;
  }
  void set_tensor_state(std::string const& name, at::Tensor const& value)
  {
    at::Tensor const v = value.detach().to(at::kCPU, at::kFloat).contiguous();
    py::gil_scoped_release nogil;  // (a size that is not the tensor's: logic_error, naming both)
    shard_->write_tensor_state(name, std::span<float const>(v.data_ptr<float>(), static_cast<std::size_t>(v.numel())));
  }

  /// Whether `p` is still the memory registered as tensor `t` (a model moved with .to() or
  /// re-materialized is not).
  [[nodiscard]] bool same_memory(std::size_t t, at::Tensor const& p) const
  {
    return t < tensors_.size() && p.data_ptr() == tensors_[t].data &&
           static_cast<std::size_t>(p.numel()) == tensors_[t].count;
  }

  [[nodiscard]] std::int64_t step_count() const { return shard_->step_count(); }
  void set_step_count(std::int64_t n) { shard_->set_step_count(n); }
  [[nodiscard]] std::int64_t tensor_step_count(std::string const& tensor) const
  {
    return shard_->tensor_step_count(tensor);
  }
  void set_tensor_step_count(std::string const& tensor, std::int64_t n) { shard_->set_tensor_step_count(tensor, n); }
  [[nodiscard]] std::vector<std::string> slot_names() const { return shard_->slot_names(); }
  [[nodiscard]] std::string composition() const { return shard_->composition(); }
  [[nodiscard]] bool in_step() const { return shard_->in_step(); }
  [[nodiscard]] bool state_lost() const { return shard_->state_lost(); }

  /// `f(phase, done, total)` hears the progress of making the state, save and load (None: nothing).
  void set_progress(py::object f)
  {
    progress_->set = !f.is_none();
    progress_->f   = std::move(f);
  }

  /// Records the timeline of what follows into a tracer of `capacity` events (tierstate/core/trace.hpp).
  void trace_start(std::size_t capacity)
  {
    py::gil_scoped_release nogil;  // (waits for a delayed update in flight)
    shard_->trace_start(capacity);
  }
  /// Stops; ([(phase, begin_ns, end_ns, bytes, chunk, track, io)], dropped), times in
  /// nanoseconds of the steady clock (time.monotonic_ns's on Linux).
  py::tuple trace_stop()
  {
    std::uint64_t dropped = 0;
    std::vector<trace_record> records;
    {
      py::gil_scoped_release nogil;
      records = shard_->trace_stop(dropped);
    }
    py::list out;
    for (auto const& r : records) {
      out.append(py::make_tuple(py::str(r.phase.data(), r.phase.size()), r.begin_ns, r.end_ns, r.bytes, r.chunk,
                                r.track, r.io));
    }
    return py::make_tuple(out, dropped);
  }

 private:
  struct registered {
    std::string name;
    void* data;
    std::size_t count;
  };

  void check_param(std::string const& name, at::Tensor const& p) const
  {
    auto const who = "tierstate_torch: parameter '" + name + "'";
    check_device(who, p);
    if (to_dtype(p.scalar_type(), "a parameter") != dtype_) {
      throw std::invalid_argument(who + " is " + std::string(c10::toString(p.scalar_type())) +
                                  "; this shard holds " + std::string(c10::toString(to_scalar(dtype_))));
    }
    if (!p.is_contiguous()) {
      throw std::invalid_argument(who + " is not contiguous: it is updated in place through its memory");
    }
    if (p.is_sparse()) { throw std::invalid_argument(who + " is sparse"); }
  }

  /// Host params are CPU tensors; device params are CUDA tensors (CPU tensors on the
  /// emulated device of a build without CUDA).
  void check_device(std::string const& who, at::Tensor const& x) const
  {
    bool const want_cuda = device_params_ && !device_is_emulated();
    if (want_cuda ? x.device().is_cuda() : x.device().is_cpu()) { return; }
    throw std::invalid_argument(who + " is on " + x.device().str() + "; this optimizer's " +
                                (device_params_ ? "device" : "host") + " params are on " +
                                (want_cuda ? "cuda" : device_params_ ? "cpu (the emulated device)" : "cpu"));
  }

  std::size_t count_of(std::string const& name) const
  {
    for (auto const& r : tensors_) {
      if (r.name == name) { return r.count; }
    }
    throw std::invalid_argument("tierstate_torch: no tensor named '" + name + "'");
  }

  /// Checks a gradient; `held` becomes the tensor the optimizer reads (`g`, or a contiguous
  /// copy), which the caller keeps alive for as long as the optimizer may read it.
  grad_in checked_grad(std::size_t t, at::Tensor const& g, at::Tensor& held) const
  {
    auto const& r   = tensors_[t];
    auto const who  = "tierstate_torch: the gradient of '" + r.name + "'";
    if (g.is_sparse()) { throw std::invalid_argument(who + " is sparse; sparse gradients are not supported"); }
    check_device(who, g);
    if (static_cast<std::size_t>(g.numel()) != r.count) {
      throw std::invalid_argument(who + " has " + std::to_string(g.numel()) + " elements; the parameter has " +
                                  std::to_string(r.count));
    }
    if (to_dtype(g.scalar_type(), "a gradient") != dtype_) {
      throw std::invalid_argument(who + " is " + std::string(c10::toString(g.scalar_type())) +
                                  "; the parameter is " + std::string(c10::toString(to_scalar(dtype_))));
    }
    held = g.detach().contiguous();
    return {held.data_ptr(), r.count, 0};
  }

  void release_grads()
  {
    std::lock_guard lock(live_mutex_);
    for (auto& g : live_) { g.reset(); }
  }

  /// The shard's progress callback calls the Python callable set_progress gave (the GIL
  /// taken), if any. Declared before shard_, which holds copies of the pointer: the last
  /// reference dies with the py_shard, the GIL held.
  config& with_progress(config& c)
  {
    c.progress = [held = progress_](std::string_view phase, std::uint64_t done, std::uint64_t total) {
      if (!held->set.load(std::memory_order_acquire)) { return; }  // (no GIL taken for nothing)
      py::gil_scoped_acquire gil;
      if (!held->f.is_none()) { held->f(py::str(phase.data(), phase.size()), done, total); }
    };
    return c;
  }

  struct progress_hook {
    std::atomic<bool> set{false};
    py::object f = py::none();
  };
  std::shared_ptr<progress_hook> progress_ = std::make_shared<progress_hook>();
  dtype dtype_;
  bool device_params_;
  std::unique_ptr<shard> shard_;
  std::vector<registered> tensors_;
  std::mutex live_mutex_;
  std::vector<at::Tensor> live_;
};

/// The across_ranks hooks (optimizer_options.hpp) of a Python object with methods
/// any_nonfinite(bool) -> bool and norm(float64 tensor of block sums) -> float: called from
/// the optimizer's threads with the GIL, a Python error turned into a C++ one that keeps its
/// message (the step then fails with it).
void set_ranks(config& c, py::object ranks)
{
  if (ranks.is_none()) { return; }
  std::shared_ptr<py::object> const held(new py::object(std::move(ranks)), [](py::object* o) {
    py::gil_scoped_acquire gil;
    delete o;
  });
  auto call = [held](char const* what, auto&& make_args, auto&& cast) {
    py::gil_scoped_acquire gil;
    try {
      return cast(held->attr(what)(make_args()));
    } catch (std::exception const& e) {
      throw std::runtime_error(std::string("tierstate_torch: across ranks, ") + what + ": " + e.what());
    }
  };
  c.any_nonfinite = [call](bool found) {
    return call("any_nonfinite", [found] { return py::bool_(found); }, [](py::object o) { return o.cast<bool>(); });
  };
  c.norm = [call](std::span<double const> sums) {
    return call(
      "norm",
      [sums] {
        return torch::from_blob(const_cast<double*>(sums.data()), {static_cast<std::int64_t>(sums.size())},
                                torch::kDouble).clone();
      },
      [](py::object o) { return o.cast<double>(); });
  };
}

/// One tensor's squares, as the gradient norm sums them (step/checks.hpp: each element as a
/// float, squared and added in double, in element order), for a rank that holds a slice of
/// it beginning `offset` elements into the tensor: the sums of the 4096-element blocks that
/// begin in the slice (the last one maybe cut by the slice's end), after its first
/// (4096 - offset % 4096) % 4096 elements, which end a block another rank began
/// (fold_squares). FSDP2's shards: their norm is one process's, bit for bit.
torch::Tensor block_sums(torch::Tensor const& t, std::int64_t offset)
{
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && offset >= 0, "block_sums: a contiguous CPU tensor");
  constexpr std::int64_t block = 4096;
  auto const x      = t.to(torch::kFloat);
  float const* p    = x.data_ptr<float>();
  std::int64_t const n    = x.numel();
  std::int64_t const head = std::min(n, (block - offset % block) % block);
  auto out = torch::zeros({(n - head + block - 1) / block}, torch::kDouble);
  double* o = out.data_ptr<double>();
  py::gil_scoped_release release;
  for (std::int64_t b = 0; b < out.numel(); ++b) {
    double s = 0.0;
    for (std::int64_t i = head + b * block, e = std::min(n, head + (b + 1) * block); i < e; ++i) {
      double const v = static_cast<double>(p[i]);
      s += v * v;
    }
    o[b] = s;
  }
  return out;
}

/// `prefix` (a block's sum so far) with the squares of `t`'s elements added in order.
double fold_squares(double prefix, torch::Tensor const& t)
{
  auto const x = t.to(torch::kFloat).contiguous();
  float const* p = x.data_ptr<float>();
  for (std::int64_t i = 0; i < x.numel(); ++i) {
    double const v = static_cast<double>(p[i]);
    prefix += v * v;
  }
  return prefix;
}

/// Whether any of these contiguous CPU tensors (fp32, bf16, fp16) holds an infinity or a
/// NaN: tierstate's check (kernels/host/finite.hpp), one read of each, on torch's threads.
/// (torch.isfinite(g).all() writes a bool tensor as large as g first, then reads it: on a
/// 2-core machine it cost a step of 8-bit state more than the step itself.)
bool any_nonfinite(std::vector<torch::Tensor> const& tensors)
{
  for (auto const& t : tensors) {
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "any_nonfinite: contiguous CPU tensors only, not a ",
                t.is_contiguous() ? "" : "non-contiguous ", "tensor on ", t.device());
    TORCH_CHECK(t.scalar_type() == torch::kFloat || t.scalar_type() == torch::kBFloat16 ||
                  t.scalar_type() == torch::kHalf,
                "any_nonfinite: float32, bfloat16 or float16 tensors only, not ", t.scalar_type());
  }
  py::gil_scoped_release release;
  for (auto const& t : tensors) {
    std::atomic<bool> found{false};
    auto const scan = [&](auto const* p) {
      at::parallel_for(0, t.numel(), std::int64_t{1} << 16, [&](std::int64_t b, std::int64_t e) {
        if (!found.load(std::memory_order_relaxed) &&
            tierstate::host::any_nonfinite(p + b, static_cast<std::size_t>(e - b))) {
          found.store(true, std::memory_order_relaxed);
        }
      });
    };
    if (t.scalar_type() == torch::kFloat) {
      scan(t.data_ptr<float>());
    } else if (t.scalar_type() == torch::kBFloat16) {
      scan(static_cast<tierstate::bf16 const*>(t.data_ptr()));
    } else {
      scan(static_cast<tierstate::fp16 const*>(t.data_ptr()));
    }
    if (found.load()) { return true; }
  }
  return false;
}

}  // namespace

}  // namespace tierstate_torch

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)
{
  namespace tt = tierstate_torch;
  m.doc() = "tierstate's offloaded Adam/AdamW (see tierstate_torch.optim)";

  m.def("rule_names", &tt::rule_names, "The rules this build has compositions for");
  m.def(
    "rule_table",
    [](std::string const& rule) {
      auto const r = tt::rule_table(rule);
      py::dict d;
      d["name"]            = r.name;
      d["hyperparameters"] = r.hyperparameters;
      d["defaults"]        = r.defaults;
      d["slots"]           = r.slots;
      return d;
    },
    "A rule's hyper-parameter table (names in order, defaults) and slots");

  py::class_<tt::py_param_store>(m, "ParamStore")
    .def(py::init([](at::ScalarType param, std::string tier, std::string directory, unsigned window,
                     std::size_t persistence_threshold, std::size_t write_behind_bytes, bool device_buffers) {
           tt::store_config c;
           c.param                 = tt::to_dtype(param, "an offloaded parameter");
           c.tier                  = std::move(tier);
           c.directory             = std::move(directory);
           c.window                = window;
           c.persistence_threshold = persistence_threshold;
           c.write_behind_bytes    = write_behind_bytes;
           c.device_buffers        = device_buffers;
           return std::make_unique<tt::py_param_store>(std::move(c));
         }),
         py::arg("param_dtype"), py::arg("tier"), py::arg("directory"), py::arg("window"),
         py::arg("persistence_threshold"), py::arg("write_behind_bytes"), py::arg("device_buffers"))
    .def("add_layer", &tt::py_param_store::add_layer)
    .def("add_tensor", &tt::py_param_store::add_tensor)
    .def("materialize", &tt::py_param_store::materialize)
    .def("fetch", &tt::py_param_store::fetch)
    .def("release", &tt::py_param_store::release)
    .def("end_iteration", &tt::py_param_store::end_iteration)
    .def("write", &tt::py_param_store::write)
    .def("read", &tt::py_param_store::read)
    .def("flush", &tt::py_param_store::flush)
    .def("resident", &tt::py_param_store::resident)
    .def("stats", &tt::py_param_store::stats);
  py::class_<tt::py_shard>(m, "Shard")
    .def(py::init([](std::string rule, at::ScalarType param, at::ScalarType state, std::string master,
                     std::string tier, std::string compute, bool device_params, std::string directory,
                     std::size_t chunk_elements,
                     std::size_t threads, bool bind_threads, double max_grad_norm, std::string on_nonfinite,
                     bool delayed_update, int shadow_state, tt::hyper defaults, py::object ranks) {
           tt::config c;
           c.rule           = std::move(rule);
           c.param          = tt::to_dtype(param, "the parameter dtype");
           c.state          = tt::to_state_dtype(state);
           c.master         = std::move(master);
           c.tier           = std::move(tier);
           c.compute        = std::move(compute);
           c.device_params  = device_params;
           c.directory      = std::move(directory);
           c.chunk_elements = chunk_elements;
           c.threads        = threads;
           c.bind_threads   = bind_threads;
           c.max_grad_norm  = max_grad_norm;
           c.on_nonfinite   = std::move(on_nonfinite);
           c.delayed_update = delayed_update;
           c.shadow_state   = shadow_state;
           c.defaults       = defaults;
           tt::set_ranks(c, std::move(ranks));
           return std::make_unique<tt::py_shard>(std::move(c));
         }),
         py::arg("rule"), py::arg("param_dtype"), py::arg("state_dtype"), py::arg("master"),
         py::arg("tier"), py::arg("compute"), py::arg("device_params"), py::arg("directory"), py::arg("chunk_elements"), py::arg("threads"),
         py::arg("bind_threads"),
         py::arg("max_grad_norm"), py::arg("on_nonfinite"), py::arg("delayed_update"), py::arg("shadow_state"), py::arg("defaults"),
         py::arg("ranks") = py::none())
    .def("add_tensor", &tt::py_shard::add_tensor)
    .def("add_offloaded", &tt::py_shard::add_offloaded, py::keep_alive<1, 3>())  // (the store outlives the shard)
    .def("add_group", &tt::py_shard::add_group)
    .def("set_hyperparameters", &tt::py_shard::set_hyperparameters)
    .def("step", &tt::py_shard::step)
    .def("begin_step", &tt::py_shard::begin_step)
    .def("grad_ready", &tt::py_shard::grad_ready)
    .def("drop_grad", &tt::py_shard::drop_grad)
    .def("finish_step", &tt::py_shard::finish_step)
    .def("flush", &tt::py_shard::flush)
    .def("save", &tt::py_shard::save)
    .def("load", &tt::py_shard::load)
    .def("save_bytes", &tt::py_shard::save_bytes)
    .def("load_bytes", &tt::py_shard::load_bytes)
    .def("get_state", &tt::py_shard::get_state)
    .def("set_state", &tt::py_shard::set_state)
    .def("get_tensor_state", &tt::py_shard::get_tensor_state)
    .def("set_tensor_state", &tt::py_shard::set_tensor_state)
    .def("same_memory", &tt::py_shard::same_memory)
    .def("step_count", &tt::py_shard::step_count)
    .def("set_step_count", &tt::py_shard::set_step_count)
    .def("tensor_step_count", &tt::py_shard::tensor_step_count)
    .def("set_tensor_step_count", &tt::py_shard::set_tensor_step_count)
    .def("slot_names", &tt::py_shard::slot_names)
    .def("composition", &tt::py_shard::composition)
    .def("in_step", &tt::py_shard::in_step)
    .def("state_lost", &tt::py_shard::state_lost)
    .def("set_progress", &tt::py_shard::set_progress)
    .def("trace_start", &tt::py_shard::trace_start)
    .def("trace_stop", &tt::py_shard::trace_stop);
  m.def("device_is_emulated", &tt::device_is_emulated,
        "Whether device memory is host memory here (a build without CUDA)");
  m.def("has_device_params", &tt::has_device_params,
        "Whether the build has the compositions of params on a device (CUDA, or the emulated device)");
  m.def("any_nonfinite", &tt::any_nonfinite, py::arg("tensors"),
        "Whether any of these contiguous CPU tensors (float32, bfloat16, float16) holds an inf or a NaN");
  m.def(
    "partition_elements",
    [](std::vector<std::size_t> const& sizes, std::size_t ranks) {
      auto const p = tierstate::ranks::partition_elements(sizes, ranks);
      std::vector<std::vector<std::tuple<std::size_t, std::size_t, std::size_t>>> out(p.ranks());
      for (std::size_t r = 0; r < p.ranks(); ++r) {
        for (auto const& pc : p.pieces[r]) { out[r].emplace_back(pc.tensor, pc.begin, pc.count); }
      }
      return out;
    },
    py::arg("sizes"), py::arg("ranks"),
    "ZeRO-1's partition (tierstate/ranks/partition.hpp): per rank, its (tensor, begin, count) pieces");
  m.def("block_sums", &tt::block_sums, py::arg("tensor"), py::arg("offset"),
        "A slice's squares per 4096-element block of its tensor, the blocks that begin in it (the gradient norm's)");
  m.def("fold_squares", &tt::fold_squares, py::arg("prefix"), py::arg("tensor"),
        "prefix plus the squares of the tensor's elements, added in order (the gradient norm's)");
  m.def(
    "plan",
    [](double params, std::string param, std::string state, std::string master, std::string rule, int layers,
       std::size_t chunk_elements, double gpu_bytes, double host_bytes, std::string nvme, std::optional<double> nvme_free,
       double host_gb_s, double disk_gb_s, double pcie_gb_s, std::string pcie_source, bool probe, std::size_t scratch_bytes) {
      namespace plan = tierstate::plan;
      plan::job const j{.params = params, .param = std::move(param), .state = std::move(state), .master = std::move(master),
                        .rule = std::move(rule), .layers = layers, .chunk_elements = chunk_elements};
      plan::machine m{.gpu_bytes = gpu_bytes, .host_bytes = host_bytes, .nvme = std::move(nvme), .nvme_free = nvme_free,
                      .host_gb_s = host_gb_s, .disk_gb_s = disk_gb_s, .pcie_gb_s = pcie_gb_s};
      if (host_gb_s > 0) { m.host_source = "given"; }
      if (disk_gb_s > 0) { m.disk_source = "given"; }
      if (pcie_gb_s > 0) { m.pcie_source = std::move(pcie_source); }
      {
        py::gil_scoped_release const nogil;  // the probes take a second or two
        plan::measure(m, j, probe, scratch_bytes);
      }
      auto const rows = plan::compositions(j, m);
      py::list out;
      for (auto const& r : rows) {
        py::dict d;
        d["name"]            = r.name;
        d["fits"]            = r.fits;
        d["fits_text"]       = r.fits_text;
        d["gpu_bytes"]       = r.gpu_bytes;
        d["host_bytes"]      = r.host_bytes;
        d["nvme_bytes"]      = r.nvme_bytes;
        d["memlock_bytes"]   = r.memlock_bytes;
        d["step_seconds"]    = std::isfinite(r.step_seconds) ? py::object(py::float_(r.step_seconds)) : py::none();
        d["compute_seconds"] = r.compute_seconds;
        d["disk_seconds"]    = std::isfinite(r.disk_seconds) ? py::object(py::float_(r.disk_seconds)) : py::none();
        d["pcie_seconds"]    = r.pcie_seconds;
        d["bound"]           = r.bound;
        out.append(d);
      }
      py::dict mach;
      mach["gpu_bytes"]   = m.gpu_bytes;
      mach["host_bytes"]  = m.host_bytes;
      mach["nvme"]        = m.nvme.empty() ? py::object(py::none()) : py::object(py::str(m.nvme));
      mach["nvme_free"]   = m.nvme_free ? py::object(py::float_(*m.nvme_free)) : py::none();
      mach["host_gb_s"]   = m.host_gb_s;
      mach["host_source"] = m.host_source;
      mach["disk_gb_s"]   = m.disk_gb_s > 0 ? py::object(py::float_(m.disk_gb_s)) : py::none();
      mach["disk_source"] = m.disk_source;
      mach["pcie_gb_s"]   = m.pcie_gb_s;
      mach["pcie_source"] = m.pcie_source;
      return py::make_tuple(out, mach, plan::table(j, m, rows), plan::json_lines(j, m, rows));
    },
    py::arg("params"), py::arg("param"), py::arg("state"), py::arg("master"), py::arg("rule"), py::arg("layers"),
    py::arg("chunk_elements"), py::arg("gpu_bytes"), py::arg("host_bytes"), py::arg("nvme"), py::arg("nvme_free"),
    py::arg("host_gb_s"), py::arg("disk_gb_s"), py::arg("pcie_gb_s"), py::arg("pcie_source"), py::arg("probe"),
    py::arg("scratch_bytes"),
    "tierstate's planner (tierstate/plan/plan.hpp): (compositions, machine, table, JSON lines)");
  m.def("host_kernels", &tt::host_kernel_level,
        "The host kernels' level: the dispatched x86-64 level of a package build (TIERSTATE_ARCH forces one), or "
        "'native <arch>' for a build with its own -march");
}
