// SPDX-License-Identifier: Apache-2.0
// The four compositions a GPU training loop asks for, on one small problem: bf16 weights
// and gradients in device memory, the gradient made by a Thrust kernel on the device (as
// backward would), and the optimizer state wherever the composition puts it.
//
//   1. state on the device, update on the device          (no offload: the baseline)
//   2. state in pinned host memory, update on the host    (ZeRO-Offload)
//   3. state on NVMe through pinned host, update on host  (ZeRO-Infinity's optimizer offload)
//   4. state on the host, streamed to the device, update on the device
//
// Built twice: with nvcc for the GPU (gpu_compositions_cuda, TIERSTATE_ENABLE_CUDA), and
// with a Thrust host backend for machines without one (gpu_compositions: the "device" is
// emulated on the host, which is how CI runs it). The four runs reach the same loss, to the
// bit: where the state lives never changes the numbers.
//
//   gpu_compositions [--elements N] [--steps N] [--path DIR] [--trace DIR]
//
// --trace DIR: each composition's last step traced (core/trace.hpp) into DIR/trace_<k>.json,
// its copies and kernels on the device's streams (Perfetto or chrome://tracing open them).
#include <tierstate/kernels/device/on_device.hpp>
#include <tierstate/tierstate.hpp>

#include <thrust/execution_policy.h>
#include <thrust/functional.h>
#include <thrust/transform.h>
#include <thrust/transform_reduce.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <unistd.h>

using namespace tierstate;

namespace {

/// The loss is |w - target|^2 / 2 over every element: its gradient is w - target.
struct gradient_of {
  TIERSTATE_HOST_DEVICE bf16 operator()(bf16 w, float target) const
  {
    return bf16(static_cast<float>(w) - target);
  }
};
struct squared_error {
  TIERSTATE_HOST_DEVICE double operator()(thrust::tuple<bf16, float> const& t) const
  {
    double const d = static_cast<double>(static_cast<float>(thrust::get<0>(t))) - thrust::get<1>(t);
    return 0.5 * d * d;
  }
};

#if defined(TIERSTATE_ENABLE_CUDA)
auto on(device::stream_view s) { return thrust::cuda::par.on(s.native()); }
#else
auto on(device::stream_view) { return thrust::device; }
#endif

/// Device memory for n values of T.
template <class T>
struct device_array {
  T* data = nullptr;
  std::size_t size;
  explicit device_array(std::size_t n) : size(n)
  {
    data = static_cast<T*>(device::allocate_async(n * sizeof(T), {}));
    device::stream_view{}.synchronize();
  }
  ~device_array() { device::deallocate_async(data, {}); }
  device_array(device_array const&)            = delete;
  device_array& operator=(device_array const&) = delete;
};

struct outcome {
  double loss    = 0;
  double seconds = 0;  ///< per step
  std::size_t staging = 0;
  std::size_t device_events = 0;  ///< of the traced step, on the device's streams
};

/// Trains with composition Opt: `steps` steps from the same start, gradients made on the
/// device each step, as a training loop would.
template <class Opt>
outcome train(typename Opt::options const& o, std::size_t n, int steps, std::string const& trace_file = {})
{
  // The weights (two tensors, as a model has several) and the targets, on the device.
  std::size_t const n0 = n / 3, n1 = n - n / 3;
  device_array<bf16> w(n), g(n);
  device_array<float> target(n);
  std::vector<bf16> w0(n);
  std::vector<float> t0(n);
  for (std::size_t i = 0; i < n; ++i) {
    w0[i] = bf16(static_cast<float>((i * 7919) % 1000) / 500.0f - 1.0f);
    t0[i] = static_cast<float>((i * 104729) % 1000) / 1000.0f;
  }
  device::copy(w.data, w0.data(), n * sizeof(bf16));
  device::copy(target.data, t0.data(), n * sizeof(float));

  Opt opt({.lr = 3e-2, .weight_decay = 0.0}, o);
  opt.add_tensor("layer0.weight", w.data, n0, location::device);
  opt.add_tensor("layer1.weight", w.data + n0, n1, location::device);
  std::vector<grad_view<bf16>> const grads = {{g.data, n0, location::device},
                                             {g.data + n0, n1, location::device}};
  device::stream backward;  // where this loop's "backward" runs
  tracer trace;
  auto const start = std::chrono::steady_clock::now();
  for (int step = 1; step <= steps; ++step) {
    thrust::transform(on(backward), w.data, w.data + n, target.data, g.data, gradient_of{});
    if (step == steps && !trace_file.empty()) { opt.trace(&trace); }
    opt.step(grads, 1.0, backward);  // reads the gradients after `backward`'s work
  }
  outcome r;
  if (!trace_file.empty()) {
    opt.trace(nullptr);
    trace.save(trace_file);
    for (auto const& e : trace.events()) { r.device_events += e.track >= tracer::device_track_base; }
  }
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / steps;
  auto const zip = thrust::make_zip_iterator(thrust::make_tuple(w.data, target.data));
  r.loss    = thrust::transform_reduce(on(backward), zip, zip + static_cast<std::ptrdiff_t>(n),
                                       squared_error{}, 0.0, thrust::plus<double>());
  r.staging = opt.staging_bytes() + opt.device_staging_bytes();
  return r;
}

}  // namespace

int main(int argc, char** argv)
{
  std::size_t n = 300'007;
  int steps     = 100;
  std::filesystem::path dir, trace_dir;
  for (int i = 1; i < argc; ++i) {
    std::string const a = argv[i];
    if (a == "--elements" && i + 1 < argc) {
      n = std::strtoull(argv[++i], nullptr, 10);
    } else if (a == "--steps" && i + 1 < argc) {
      steps = std::atoi(argv[++i]);
    } else if (a == "--path" && i + 1 < argc) {
      dir = argv[++i];
    } else if (a == "--trace" && i + 1 < argc) {
      trace_dir = argv[++i];
    } else {
      std::fprintf(stderr, "usage: %s [--elements N] [--steps N] [--path DIR] [--trace DIR]\n", argv[0]);
      return 2;
    }
  }
  if (n < 3 || steps < 1) {
    std::fprintf(stderr, "--elements must be >= 3 and --steps >= 1\n");
    return 2;
  }
  if (device::count() == 0) {
    std::printf("SKIP: %s\n", device::describe().c_str());
    return 77;
  }
  if (!trace_dir.empty()) { std::filesystem::create_directories(trace_dir); }
  bool const own_dir = dir.empty();
  if (own_dir) {
    std::string t = (std::filesystem::temp_directory_path() / "gpu_compositions-XXXXXX").string();
    if (::mkdtemp(t.data()) == nullptr) { std::perror("mkdtemp"); return 1; }
    dir = t;
  }
  std::printf("device: %s (Thrust system: %s); %zu elements, %d steps\n", device::describe().c_str(),
              device::system_name(), n, steps);

  constexpr std::size_t chunk = std::size_t{1} << 16;
  std::vector<std::pair<char const*, outcome>> runs;
  auto traced = [&](int k) {  // composition k's trace file, when asked for
    return trace_dir.empty() ? std::string() : (trace_dir / ("trace_" + std::to_string(k) + ".json")).string();
  };
  {  // 1. no offload
    using Opt = OffloadedOptimizer<AdamW, Bf16Mixed, Device, CudaOverlapped<2>, OnDevice>;
    runs.emplace_back("Device + OnDevice (no offload)", train<Opt>({.chunk_elements = chunk}, n, steps, traced(1)));
  }
  {  // 2. ZeRO-Offload
    using Opt = OffloadedOptimizer<AdamW, Bf16Mixed, PinnedHost, CudaOverlapped<2>, OnHost<>>;
    runs.emplace_back("PinnedHost + OnHost (ZeRO-Offload)", train<Opt>({.chunk_elements = chunk}, n, steps, traced(2)));
  }
  {  // 3. ZeRO-Infinity's optimizer offload
    using Opt = OffloadedOptimizer<AdamW, Bf16Mixed, NvmeFile, CudaOverlapped<2>, OnHost<>>;
    Opt::options o{.chunk_elements = chunk};
    o.tier.directory = dir;
    runs.emplace_back("NvmeFile + OnHost (ZeRO-Infinity)", train<Opt>(o, n, steps, traced(3)));
  }
  {  // 4. state streamed to the device
    using Opt = OffloadedOptimizer<AdamW, Bf16Mixed, PinnedHost, CudaOverlapped<2>, OnDevice>;
    runs.emplace_back("PinnedHost + OnDevice (streamed)", train<Opt>({.chunk_elements = chunk}, n, steps, traced(4)));
  }
  {
    using Opt = OffloadedOptimizer<AdamW, Bf16Mixed, NvmeFile, CudaOverlapped<2>, OnDevice>;
    Opt::options o{.chunk_elements = chunk};
    o.tier.directory = dir;
    runs.emplace_back("NvmeFile + OnDevice (streamed)", train<Opt>(o, n, steps, traced(5)));
  }
  if (own_dir) { std::filesystem::remove_all(dir); }

  bool same = true, traced_all = true;
  for (auto const& [name, r] : runs) {
    std::printf("%-36s loss %.9g  %8.3f ms/step  staging %zu bytes", name, r.loss, r.seconds * 1e3, r.staging);
    if (!trace_dir.empty()) { std::printf("  (traced: %zu events on the device's streams)", r.device_events); }
    std::printf("\n");
    same = same && r.loss == runs.front().second.loss;
    traced_all = traced_all && (trace_dir.empty() || r.device_events > 0);
  }
  double const start_loss = [&] {  // the loss before training, for scale
    double l = 0;
    for (std::size_t i = 0; i < n; ++i) {
      double const d = static_cast<double>(static_cast<float>(bf16(static_cast<float>((i * 7919) % 1000) / 500.0f - 1.0f))) -
                       static_cast<double>(static_cast<float>((i * 104729) % 1000) / 1000.0f);
      l += 0.5 * d * d;
    }
    return l;
  }();
  std::printf("loss before training %.9g; the compositions %s\n", start_loss,
              same ? "agree to the bit" : "DISAGREE");
  if (!traced_all) { std::printf("a traced step recorded nothing on the device's streams\n"); }
  return same && traced_all && runs.front().second.loss < 0.1 * start_loss ? 0 : 1;
}
