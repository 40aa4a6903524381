// SPDX-License-Identifier: Apache-2.0
// What tracing costs when it is off: built twice (as trace_overhead, and with TIERSTATE_TRACE=0
// as trace_overhead_notrace) and run under callgrind by bench/trace_overhead.py, which compares
// the instructions of the same steps. Instruction counts are repeatable where wall time is not.
//
// Two compositions, one thread each, so that nothing depends on scheduling: PinnedHost (the
// in-place route) and a user's memory tier under Synchronous (the staged route: a read,
// compute and write per chunk). Only the steps are counted (CALLGRIND_TOGGLE_COLLECT), never
// the set-up.
//
//   trace_overhead [--elements N] [--steps S]
#include <tierstate/tierstate.hpp>

#include <valgrind/callgrind.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <string>
#include <vector>

namespace {

/// A user's tier: plain memory behind read and write, so the optimizer stages its chunks.
class memory_tier {
 public:
  struct options {};
  static constexpr std::string_view name = "memory_tier";
  memory_tier(std::size_t bytes, options const&) : bytes_(bytes) {}
  [[nodiscard]] std::size_t size() const { return bytes_.size(); }
  void read(std::size_t offset, std::span<std::byte> to) const { std::memcpy(to.data(), bytes_.data() + offset, to.size()); }
  void write(std::size_t offset, std::span<std::byte const> from) { std::memcpy(bytes_.data() + offset, from.data(), from.size()); }

 private:
  std::vector<std::byte> bytes_;
};

template <class Optimizer>
void run(std::size_t elements, int steps)
{
  typename Optimizer::options o;
  o.threads        = 1;
  o.chunk_elements = 16384;
  std::vector<float> p(elements, 0.5f), g(elements, 0.001f);
  Optimizer opt({.lr = 1e-3, .weight_decay = 0.01}, o);
  opt.add_tensor("w", p.data(), p.size());
  std::vector<tierstate::grad_view<float>> grads{{g.data(), g.size()}};
  (void)opt.step(grads);  // the state made: not counted
  CALLGRIND_TOGGLE_COLLECT;
  for (int s = 0; s < steps; ++s) { (void)opt.step(grads); }
  CALLGRIND_TOGGLE_COLLECT;
}

}  // namespace

int main(int argc, char** argv)
{
  std::size_t elements = 100003;
  int steps            = 4;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--elements") == 0) {
      elements = std::strtoull(argv[i + 1], nullptr, 10);
    } else if (std::strcmp(argv[i], "--steps") == 0) {
      steps = std::atoi(argv[i + 1]);
    } else {
      std::fprintf(stderr, "usage: trace_overhead [--elements N] [--steps S]\n");
      return 2;
    }
  }
  if (elements == 0 || steps <= 0) {
    std::fprintf(stderr, "trace_overhead: --elements and --steps must be positive\n");
    return 2;
  }
  using namespace tierstate;
  run<OffloadedOptimizer<AdamW, Fp32, PinnedHost>>(elements, steps);
  run<OffloadedOptimizer<AdamW, Fp32, memory_tier, Synchronous>>(elements, steps);
  std::printf("trace_overhead: %d steps of %zu elements, twice (tracing %s)\n", steps, elements,
              trace_compiled ? "compiled in, off" : "compiled out");
  return 0;
}
