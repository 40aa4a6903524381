// SPDX-License-Identifier: Apache-2.0
// host_step: the host step's speed against the limit its memory traffic allows, measured in
// one process, every comparison interleaved (rep by rep, the order rotating) on the same
// threads, medians reported.
//
// The limit. A step of precision P with S slots reads the gradient, reads and writes the
// weight (the fp32 master, or the param itself), writes the param (where there is a master)
// and reads and writes each slot: bytes_per_elem bytes per element. A "traffic loop" moves
// exactly those bytes and computes nothing but a checksum (every read is folded into it,
// every write stores a value derived from what was read, so no byte can be dropped), with
// SIMD loads and stores, block by block (every stream's block loaded, then stored, as the
// kernel goes; blocks of 32 and 64 elements). It comes in
//   layouts   separate (one array per stream, as a user's arrays are) and chunked (master
//             and slots of each chunk side by side, as the optimizer's state is laid out);
//   memory    4k (base pages, MADV_NOHUGEPAGE) and huge (transparent huge pages, as
//             PinnedHost allocates);
//   stores    plain, nt (non-temporal stores for the write-only param) and nt_all
//             (non-temporal stores for every write: nothing written is read again in a step);
//   prefetch  none, or "_pf": every read stream prefetched 8 pages ahead once per 1024
//             elements, as the kernels do (a hardware prefetcher starts cold at each 4 KiB
//             page, and a VM pays a two-level page walk there: worth 10-30% over 4k pages).
// A row's limit is the best loop over the same kind of memory as the row's own (a kernel
// over a user's 4 KiB-page arrays: the best 4k separate loop; the optimizer, whose state is
// PinnedHost's chunks in huge pages and whose params and gradients are the user's: the best
// chunked loop over that mix); limit_ratio is the row's speed over it, and a row above 1.03
// prints a warning on stderr (a limit that is beaten is no bound). Per precision, a "limits"
// line times every loop for AdamW's traffic and names the best over any memory.
//
// Rows (one JSON line each):
//   variant "kernel"     tierstate::host::update (xsimd) per rule x precision, with `plain`,
//                        the straightforward scalar loop of the same rule over __restrict
//                        pointers, as a user would write it;
//   variant "optimizer"  OffloadedOptimizer<R, P>::step() (PinnedHost) per rule with slots
//                        (AdamW, SGD, SGDMomentum, Lion) and Adafactor (whose tensor phase's
//                        passes, 2 gradient reads and 1 param read per element, are in its
//                        bytes but not in its limit, which is then loose) over a model-like
//                        set of tensors, with its default non-finite check and without: the
//                        check's extra read of the gradients is in its bytes and its limit;
//                        check_cost is the checked step's time over the unchecked one's,
//                        check_byte_ratio what the extra bytes alone would cost, and
//                        check_cost_limit what they cost the best loops (a separate read
//                        pass runs at the read-only bandwidth);
//   variant "dispatch"   AdamW's unchecked step (fp32, and bf16 params with an fp32 master) as
//                        a program built for plain x86-64 runs it (host_step_dispatch.cpp):
//                        with the kernels dispatched at run time (kernels/host/dispatch.hpp,
//                        `level`) and with its own SSE2 kernels (`baseline_`), interleaved
//                        with the optimizer rows' unchecked step of this build; `ratio` is
//                        the dispatched step's speed over this build's;
//   variant "compact"    AdamW's unchecked step with bf16 params and fp32 moments, and with
//                        8-bit moments (codecs/dynamic8.hpp) and an fp32 master, a
//                        compensation or stochastic rounding, and with bf16 moments and an
//                        fp32 master or stochastic rounding, in one interleaved set:
//                        `speedup` over the first, each against the loops of its own bytes
//                        (an 8-bit slot counted as 1 byte per element, its scales left out),
//                        state_bytes_per_elem what its chunks keep per element.
//
//   host_step [--elements N] [--reps R] [--threads T] [--rule NAME] [--precision p/g/m/s]
#include "host_step_dispatch.hpp"

#include <tierstate/tierstate.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <system_error>
#include <tuple>
#include <type_traits>
#include <vector>

#include <sys/mman.h>

namespace {

using namespace tierstate;
using clock_type = std::chrono::steady_clock;

struct options {
  std::size_t elements = std::size_t{1} << 24;
  int reps             = 9;
  std::size_t threads  = 0;
  std::string rule;
  std::string precision;
};

constexpr char const* usage_text =
  "usage: host_step [--elements N >= 1] [--reps R (1..10000)] [--threads T (0..4096)] "
  "[--rule adam|adamw|adam_amsgrad|adamw_amsgrad|sgd|sgd_momentum|lion|adafactor] [--precision PARAM/GRAD/MASTER/STATE] [--help]\n";

[[noreturn]] void usage_error(std::string const& what)
{
  std::fprintf(stderr, "host_step: %s\n%s", what.c_str(), usage_text);
  std::exit(2);
}

options parse(int argc, char** argv)
{
  options o;
  // A decimal integer in [lo, hi]: digits only, nothing after them, no overflow.
  auto number = [&](int& i, char const* flag, unsigned long long lo, unsigned long long hi) -> unsigned long long {
    if (i + 1 >= argc) { usage_error(std::string(flag) + " needs a value"); }
    std::string const text = argv[++i];
    unsigned long long v   = 0;
    auto const [end, ec]   = std::from_chars(text.data(), text.data() + text.size(), v);
    std::string const range = std::to_string(lo) + ".." + std::to_string(hi);
    if (text.empty() || (ec != std::errc{} && ec != std::errc::result_out_of_range) || end != text.data() + text.size()) {
      usage_error(std::string(flag) + " " + (text.empty() ? "\"\"" : text) + ": not a non-negative integer");
    }
    if (ec == std::errc::result_out_of_range || v < lo || v > hi) {
      usage_error(std::string(flag) + " " + text + ": out of range (" + range + ")");
    }
    return v;
  };
  for (int i = 1; i < argc; ++i) {
    std::string const a = argv[i];
    if (a == "--help" || a == "-h") {
      std::printf("%s", usage_text);
      std::exit(0);
    } else if (a == "--elements") {
      o.elements = number(i, "--elements", 1, std::size_t{1} << 40);
    } else if (a == "--reps") {
      o.reps = static_cast<int>(number(i, "--reps", 1, 10000));
    } else if (a == "--threads") {
      o.threads = number(i, "--threads", 0, 4096);
    } else if (a == "--rule" && i + 1 < argc) {
      o.rule = argv[++i];
      std::string_view const known[] = {Adam::name, AdamW::name, AdamAmsgrad::name, AdamWAmsgrad::name,
                                        SGD::name, SGDMomentum::name, Lion::name, Adafactor::name};
      if (std::find(std::begin(known), std::end(known), o.rule) == std::end(known)) {
        usage_error("--rule " + o.rule + ": not a rule this bench runs");
      }
    } else if (a == "--precision" && i + 1 < argc) {
      o.precision = argv[++i];
    } else {
      usage_error("unknown or incomplete argument " + a);
    }
  }
  return o;
}

double seconds_since(clock_type::time_point t0)
{
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

double median(std::vector<double> v)
{
  std::sort(v.begin(), v.end());
  std::size_t const m = v.size() / 2;
  return v.size() % 2 ? v[m] : (v[m - 1] + v[m]) / 2;
}

/// Runs each loop once to warm up, then `reps` times interleaved, rotating the order every
/// repetition; returns the median seconds of each.
std::vector<double> interleaved_medians(int reps, std::vector<std::function<void()>> const& loops)
{
  for (auto const& f : loops) { f(); }
  std::size_t const n = loops.size();
  std::vector<std::vector<double>> t(n);
  for (int r = 0; r < reps; ++r) {
    for (std::size_t k = 0; k < n; ++k) {
      std::size_t const which = (static_cast<std::size_t>(r) + k) % n;
      auto const t0           = clock_type::now();
      loops[which]();
      t[which].push_back(seconds_since(t0));
    }
  }
  std::vector<double> m;
  for (auto& v : t) { m.push_back(median(std::move(v))); }
  return m;
}

// --- memory --------------------------------------------------------------------------------

/// Anonymous memory in base pages (MADV_NOHUGEPAGE, so that THP "always" does not change
/// it) or in transparent huge pages (as PinnedHost maps its state), page-aligned.
class region {
 public:
  region(std::size_t bytes, bool huge)
  {
    std::size_t const h = huge ? detail::huge_page_bytes(bytes) : 0;
    mapped_             = h == 0 ? bytes : (bytes + h - 1) / h * h;
    p_                  = static_cast<std::byte*>(detail::map_anonymous(mapped_, h));
    if (p_ == nullptr) { throw std::system_error(errno, std::generic_category(), "host_step: mmap"); }
    if (h == 0) { (void)::madvise(p_, mapped_, MADV_NOHUGEPAGE); }
    huge_ = h != 0;
  }
  ~region() { ::munmap(p_, mapped_); }
  region(region const&)            = delete;
  region& operator=(region const&) = delete;
  template <class T = std::byte>
  [[nodiscard]] T* get() const noexcept
  {
    return reinterpret_cast<T*>(p_);
  }
  [[nodiscard]] bool huge() const noexcept { return huge_; }

 private:
  std::byte* p_       = nullptr;
  std::size_t mapped_ = 0;
  bool huge_          = false;
};

// --- the traffic loops -----------------------------------------------------------------------

enum class stores { plain, nt, nt_all };
constexpr char const* store_names[] = {"plain", "nt", "nt_all"};

using word_batch = xsimd::batch<std::uint32_t>;
// Elements per block: every stream's block, then the next block. 16 is the kernel's own order on
// AVX-512 (one batch of each stream at a time: half a vector of a 16-bit stream); 32 a cache
// line of a 16-bit array and two of an fp32 one; 64, longer runs per stream.
constexpr std::size_t blocks[] = {16, 32, 64};

/// A non-temporal store of one batch (aligned): past the caches, without reading the line.
template <class B>
inline void stream_store(std::uint32_t* p, B const& v) noexcept
{
#if XSIMD_WITH_AVX512F
  if constexpr (B::size == 16) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(p), v);
    return;
  }
#endif
#if XSIMD_WITH_AVX
  if constexpr (B::size == 8) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), v);
    return;
  }
#endif
#if XSIMD_WITH_SSE2
  if constexpr (B::size == 4) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(p), v);
    return;
  }
#endif
  v.store_aligned(p);
}

/// The lanes of a checksum batch folded into one word.
template <class B>
inline std::uint32_t fold(B const& acc) noexcept
{
  alignas(64) std::uint32_t lanes[B::size];
  acc.store_aligned(lanes);
  std::uint32_t sum = 0;
  for (std::uint32_t const l : lanes) { sum ^= l; }
  return sum;
}

/// Bytes per element of one slot of P's state: its element type's, or for a block codec its
/// block's bytes over its elements, rounded down (an 8-bit block's scale, 4 bytes in 260, is
/// left out: the limit's loop moves a little less than the step, so it is no looser).
template <class P>
inline constexpr std::size_t state_size_v = P::template state_codec<0>::block_bytes / P::template state_codec<0>::block;
/// Whether P's state is one storage type per element (the plain loops' pointers).
template <class P>
inline constexpr bool element_state_v = element_codec<typename P::template state_codec<0>>;

/// Where one step's streams are for a range of elements: byte pointers to element 0 of the
/// range (each stream's element size is the precision's).
template <std::size_t Slots>
struct traffic {
  std::byte* param       = nullptr;
  std::byte const* grad  = nullptr;
  std::byte* master      = nullptr;  // null: the param is the weight
  std::byte* compensation = nullptr;  // Compensated: read and written with the param
  std::array<std::byte*, Slots> state{};
};

/// Half a word_batch: a block of 16 elements of a 2-byte stream (32 bytes), as the kernel
/// loads it.
using half_batch = xsimd::make_sized_batch_t<std::uint32_t, word_batch::size / 2>;

/// The checksums of a loop: one per batch width.
struct checksums {
  word_batch full = word_batch(0u);
  half_batch half = half_batch(0u);
  template <class B>
  B& of() noexcept
  {
    if constexpr (std::is_same_v<B, word_batch>) {
      return full;
    } else {
      return half;
    }
  }
};

/// Block `i` (Block elements) of one stream of `Size`-byte elements: its batches, loaded
/// (whole vectors, or one half vector where the block is that small).
template <std::size_t Size, std::size_t Block>
struct block_of {
  static constexpr std::size_t words = Block * Size / 4;
  using batch                        = std::conditional_t<(words >= word_batch::size), word_batch, half_batch>;
  static constexpr std::size_t count = words / batch::size;
  static_assert(count * batch::size == words, "a block is whole vectors or one half vector");
  batch v[count];

  TIERSTATE_ALWAYS_INLINE void load(std::byte const* base, std::size_t i, checksums& acc) noexcept
  {
    auto const* w = reinterpret_cast<std::uint32_t const*>(base + i * Size);
    for (std::size_t j = 0; j < count; ++j) {
      v[j] = batch::load_aligned(w + j * batch::size);
      acc.of<batch>() ^= v[j];
    }
  }
  template <bool Stream>
  TIERSTATE_ALWAYS_INLINE void store(std::byte* base, std::size_t i) const noexcept
  {
    auto* w = reinterpret_cast<std::uint32_t*>(base + i * Size);
    batch const one(1u);
    for (std::size_t j = 0; j < count; ++j) {
      if constexpr (Stream) {
        stream_store(w + j * batch::size, v[j] + one);
      } else {
        (v[j] + one).store_aligned(w + j * batch::size);
      }
    }
  }
};

/// The bytes of a step over elements [0, n) of `t`, block by block as the kernel goes: every
/// stream's block loaded, then every written stream's block stored (so no load waits behind
/// a store to the same address modulo 4 KiB, as it would with a stream stored before the
/// next is loaded); a tail of less than a block byte by byte. Returns the checksum.
template <class P, std::size_t Slots, stores S, std::size_t Block, bool Prefetch>
std::uint32_t touch(traffic<Slots> const& t, std::size_t n) noexcept
{
  constexpr std::size_t ps = sizeof(typename P::param_type), gs = sizeof(typename P::grad_type);
  constexpr std::size_t ss = state_size_v<P>;
  constexpr bool rw_stream = S == stores::nt_all, w_stream = S != stores::plain;
  checksums acc;
  std::size_t i = 0;
  for (; i + Block <= n; i += Block) {
    if constexpr (Prefetch) {  // as the kernel does: each read stream 8 pages ahead, per 1024 elements
      if (i % 1024 < Block) {
        host::detail::prefetch_page_ahead(t.grad + i * gs);
        host::detail::prefetch_page_ahead(P::has_master ? t.master + i * 4 : t.param + i * ps);
        if constexpr (P::has_compensation) { host::detail::prefetch_page_ahead(t.compensation + i * 2); }
        for (std::size_t j = 0; j < Slots; ++j) { host::detail::prefetch_page_ahead(t.state[j] + i * ss); }
      }
    }
    block_of<gs, Block> g;
    block_of<P::has_master ? 4 : ps, Block> w;
    block_of<ss, Block> st[Slots == 0 ? 1 : Slots];  // (a zero-length array is not C++)
    [[maybe_unused]] block_of<2, Block> c;
    g.load(t.grad, i, acc);
    w.load(P::has_master ? t.master : t.param, i, acc);
    if constexpr (P::has_compensation) { c.load(t.compensation, i, acc); }
    for (std::size_t j = 0; j < Slots; ++j) { st[j].load(t.state[j], i, acc); }
    w.template store<rw_stream>(P::has_master ? t.master : t.param, i);
    if constexpr (P::has_master) {  // the param is written, not read: from the checksum
      block_of<ps, Block> out;
      for (auto& x : out.v) { x = acc.of<typename block_of<ps, Block>::batch>(); }
      out.template store<w_stream>(t.param, i);
    }
    if constexpr (P::has_compensation) { c.template store<rw_stream>(t.compensation, i); }
    for (std::size_t j = 0; j < Slots; ++j) { st[j].template store<rw_stream>(t.state[j], i); }
  }
  std::uint32_t sum = fold(acc.full) ^ fold(acc.half);
  auto bytewise = [&](std::byte* p, std::size_t size, bool read, bool write) {
    for (std::size_t b = i * size; b < n * size; ++b) {
      auto const v = static_cast<std::uint32_t>(p[b]);
      if (read) { sum += v; }
      if (write) { p[b] = static_cast<std::byte>(v + 1); }
    }
  };
  bytewise(const_cast<std::byte*>(t.grad), gs, true, false);
  if (t.master != nullptr) { bytewise(t.master, 4, true, true); }
  if (t.compensation != nullptr) { bytewise(t.compensation, 2, true, true); }
  bytewise(t.param, ps, t.master == nullptr, true);
  for (std::size_t j = 0; j < Slots; ++j) { bytewise(t.state[j], ss, true, true); }
  if constexpr (S != stores::plain) { _mm_sfence(); }
  return sum;
}

/// The gradients read once more (the non-finite check's traffic).
template <class G, bool Prefetch>
std::uint32_t read_grads(std::byte const* g, std::size_t n) noexcept
{
  checksums acc;
  std::size_t i = 0;
  for (; i + 64 <= n; i += 64) {
    if constexpr (Prefetch) {
      if (i % 1024 < 64) { host::detail::prefetch_page_ahead(g + i * sizeof(G)); }
    }
    block_of<sizeof(G), 64>().load(g, i, acc);
  }
  std::uint32_t sum = fold(acc.full);
  for (std::size_t b = i * sizeof(G); b < n * sizeof(G); ++b) { sum += static_cast<std::uint32_t>(g[b]); }
  return sum;
}

std::atomic<std::uint32_t> sink{0};  // every checksum ends here: no traffic can be dropped

template <class P>
constexpr std::size_t bytes_per_element(std::size_t slots)
{
  std::size_t b = sizeof(typename P::grad_type);
  if constexpr (P::has_master) {
    b += 2 * sizeof(float) + sizeof(typename P::param_type);
  } else {
    b += 2 * sizeof(typename P::param_type);
  }
  if constexpr (P::has_compensation) { b += 2 * sizeof(bf16); }
  return b + 2 * slots * state_size_v<P>;
}

/// One precision's memory: the user's params and gradients (4k), the state as separate
/// arrays in 4k and in huge pages, and as the optimizer's chunks in huge pages.
template <class P>
struct arrays {
  using param_t = typename P::param_type;
  using grad_t  = typename P::grad_type;
  static constexpr std::size_t ss        = state_size_v<P>;
  static constexpr std::size_t lead      = P::has_master ? 4 : P::has_compensation ? 2 : 0;  // the master or the compensation
  static constexpr std::size_t max_slots = 3;
  static constexpr std::size_t chunk     = layout::default_chunk_elements;  // the optimizer's default

  std::size_t n;
  region param, grad;
  std::array<region, 2> master;                                   // 4k, huge (or the compensation)
  std::array<std::array<std::unique_ptr<region>, max_slots>, 2> state;  // [4k, huge][slot]
  region chunked;  // huge: per chunk, the master (if any) then max_slots slot arrays

  static std::size_t chunk_count(std::size_t n) { return (n + chunk - 1) / chunk; }
  static std::size_t chunk_bytes(std::size_t slots) { return chunk * (lead + slots * ss) + slots * state_pad(chunk); }
  /// A block codec's slot holds more than ss bytes per element (the scales): the excess.
  static std::size_t state_pad(std::size_t elements)
  {
    using C = typename P::template state_codec<0>;
    return (elements + C::block - 1) / C::block * C::block_bytes - elements * ss;
  }

  arrays(std::size_t size, thread_pool& pool)
    : n(size), param(n * sizeof(param_t), false), grad(n * sizeof(grad_t), false),
      master{region(lead > 0 ? n * lead : 1, false), region(lead > 0 ? n * lead : 1, true)},
      chunked(chunk_count(n) * chunk_bytes(max_slots), true)
  {
    for (int h = 0; h < 2; ++h) {
      for (auto& s : state[h]) { s = std::make_unique<region>(n * ss + state_pad(n), h == 1); }
    }
    // First touch from the threads that will use each part.
    pool.parallel_for(n, 4096, [&](std::size_t b, std::size_t e) {
      for (std::size_t i = b; i < e; ++i) {
        float const w = 0.5f + static_cast<float>(i % 1000) * 1e-4f;
        param.get<param_t>()[i] = convert<param_t>(w);
        grad.get<grad_t>()[i] = convert<grad_t>(static_cast<float>(static_cast<int>(i % 201) - 100) * 1e-4f);
        for (int h = 0; h < 2; ++h) {
          if constexpr (P::has_master) { master[h].template get<float>()[i] = w; }
          if constexpr (P::has_compensation) { master[h].template get<bf16>()[i] = bf16::from_bits(0); }
          if constexpr (element_state_v<P>) {
            using state_t = typename P::template state_codec<0>::element_type;
            for (auto& s : state[h]) { s->template get<state_t>()[i] = convert<state_t>(i % 2 ? 1e-4f : 2e-4f); }
          }
        }
      }
    });
    std::size_t const cb = chunk_count(n) * chunk_bytes(max_slots);
    pool.parallel_for(cb, 4096, [&](std::size_t b, std::size_t e) { std::memset(chunked.get() + b, 1, e - b); });
    if constexpr (!element_state_v<P>) {  // fresh blocks (zero bytes) that the kernel can read
      for (int h = 0; h < 2; ++h) {
        for (auto& s : state[h]) {
          pool.parallel_for(n * ss + state_pad(n), 4096, [&](std::size_t b, std::size_t e) { std::memset(s->get() + b, 0, e - b); });
        }
      }
    }
  }

  /// The kernel's view of the 4k separate arrays.
  template <class R>
  update_arrays<P, R::slot_count> view()
  {
    update_arrays<P, R::slot_count> a;
    a.param  = param.get<param_t>();
    a.grad   = grad.get<grad_t>();
    a.master = P::has_master ? master[0].template get<float>() : nullptr;
    a.compensation = P::has_compensation ? master[0].template get<bf16>() : nullptr;
    for (std::size_t j = 0; j < R::slot_count; ++j) { a.state[j] = state[0][j]->get(); }
    return a;
  }

  /// Elements [b, e) of the separate arrays (huge: the state in huge pages).
  template <std::size_t Slots>
  traffic<Slots> separate(bool huge, std::size_t b) const
  {
    traffic<Slots> t;
    t.param = param.get() + b * sizeof(param_t);
    t.grad  = grad.get() + b * sizeof(grad_t);
    t.master = P::has_master ? master[huge].get() + b * 4 : nullptr;
    t.compensation = P::has_compensation ? master[huge].get() + b * 2 : nullptr;
    for (std::size_t j = 0; j < Slots; ++j) { t.state[j] = state[huge][j]->get() + b * ss; }
    return t;
  }

  /// Elements [b, e) within chunk k = b / chunk of the chunked state (Slots slots).
  template <std::size_t Slots>
  traffic<Slots> in_chunk(std::size_t b) const
  {
    std::size_t const k = b / chunk, at = b % chunk;
    std::byte* base     = chunked.get() + k * chunk_bytes(Slots);
    traffic<Slots> t    = separate<Slots>(false, b);
    if constexpr (P::has_master) {
      t.master = base + at * 4;
      base += chunk * 4;
    } else if constexpr (P::has_compensation) {
      t.compensation = base + at * 2;
      base += chunk * 2;
    }
    for (std::size_t j = 0; j < Slots; ++j) { t.state[j] = base + j * (chunk * ss + state_pad(chunk)) + at * ss; }
    return t;
  }
};

/// One traffic loop: a layout, a memory, a store kind, a block size, and whether each read
/// stream is prefetched some pages ahead (as the kernels do, host/detail/prefetch.hpp).
struct loop_kind {
  bool chunked      = false;
  bool huge         = false;
  stores store      = stores::plain;
  std::size_t block = 32;
  bool prefetch     = false;
  [[nodiscard]] std::string name() const
  {
    return std::string(chunked ? "chunked_" : "separate_") + (huge ? "huge_" : "4k_") +
           store_names[static_cast<int>(store)] + "_" + std::to_string(block) + (prefetch ? "_pf" : "");
  }
};

constexpr std::size_t grain = 1024;  // elements: a multiple of every block

/// Whether a block of B elements is whole vectors of every stream of P (8-bit state in blocks
/// of 16 is 16 bytes, less than the half vector the loops load).
template <class P, std::size_t B>
inline constexpr bool block_fits = B * state_size_v<P> >= 4 * half_batch::size;

/// The step's traffic over all elements with the pool, as `k` says; `check`: the gradients
/// are read once more first, in their own pass (the non-finite check's traffic).
template <class P, std::size_t Slots>
void run_loop(thread_pool& pool, arrays<P>& arr, loop_kind k, bool check)
{
  std::size_t const n = arr.n;
  if (check) {
    pool.parallel_for(n, grain, [&](std::size_t b, std::size_t e) {
      auto const* g = arr.grad.get() + b * sizeof(typename P::grad_type);
      sink.fetch_xor(k.prefetch ? read_grads<typename P::grad_type, true>(g, e - b)
                                : read_grads<typename P::grad_type, false>(g, e - b),
                     std::memory_order_relaxed);
    });
  }
  pool.parallel_for(n, grain, [&](std::size_t b, std::size_t e) {
    std::uint32_t sum = 0;
    auto go = [&](traffic<Slots> const& t, std::size_t count) {
      auto with = [&]<std::size_t B>(std::integral_constant<std::size_t, B>) {
        if constexpr (!block_fits<P, B>) {  // (kinds_for offers no such kind)
          std::fprintf(stderr, "host_step: blocks of %zu do not fit %s\n", B, P::name().c_str());
          std::abort();
        } else {
        auto with_prefetch = [&]<bool F>(std::bool_constant<F>) {
          switch (k.store) {
            case stores::plain: sum ^= touch<P, Slots, stores::plain, B, F>(t, count); break;
            case stores::nt: sum ^= touch<P, Slots, stores::nt, B, F>(t, count); break;
            case stores::nt_all: sum ^= touch<P, Slots, stores::nt_all, B, F>(t, count); break;
          }
        };
        if (k.prefetch) {
          with_prefetch(std::true_type{});
        } else {
          with_prefetch(std::false_type{});
        }
        }
      };
      if (k.block == blocks[0]) {
        with(std::integral_constant<std::size_t, blocks[0]>{});
      } else if (k.block == blocks[1]) {
        with(std::integral_constant<std::size_t, blocks[1]>{});
      } else {
        with(std::integral_constant<std::size_t, blocks[2]>{});
      }
    };
    if (!k.chunked) {
      go(arr.template separate<Slots>(k.huge, b), e - b);
    } else {
      for (std::size_t i = b; i < e;) {  // piece by piece, chunk by chunk, as the optimizer goes
        std::size_t const end = std::min(e, (i / arrays<P>::chunk + 1) * arrays<P>::chunk);
        go(arr.template in_chunk<Slots>(i), end - i);
        i = end;
      }
    }
    sink.fetch_xor(sum, std::memory_order_relaxed);
  });
}

/// The loop kinds for a memory: separate or chunked; plain stores in both block sizes and nt
/// (only where there is a write-only param: a master) in the short one, each without and
/// with prefetching; nt_all in the short one.
template <class P>
std::vector<loop_kind> kinds_for(bool chunked, bool huge)
{
  std::vector<loop_kind> k;
  for (bool const prefetch : {false, true}) {
    for (std::size_t const b : blocks) {
      if (b * state_size_v<P> >= 4 * half_batch::size) { k.push_back({chunked, huge, stores::plain, b, prefetch}); }
    }
    if (P::has_master) {
      if (block_fits<P, blocks[0]>) { k.push_back({chunked, huge, stores::nt, blocks[0], prefetch}); }
      k.push_back({chunked, huge, stores::nt, blocks[1], prefetch});
    }
  }
  k.push_back({chunked, huge, stores::nt_all, blocks[1], false});
  return k;
}

/// The best of `kinds` from their medians: {gelem/s, name}.
std::pair<double, std::string> best_of(std::vector<loop_kind> const& kinds, std::vector<double> const& seconds,
                                       std::size_t first, std::size_t n)
{
  std::pair<double, std::string> best{0.0, ""};
  for (std::size_t i = 0; i < kinds.size(); ++i) {
    double const g = static_cast<double>(n) / seconds[first + i] / 1e9;
    if (g > best.first) { best = {g, kinds[i].name()}; }
  }
  return best;
}

void warn_if_beaten(char const* what, std::string const& precision, double ratio, std::string const& limit)
{
  if (ratio > 1.03) {
    std::fprintf(stderr,
                 "host_step: warning: %s (%s) ran at %.3f of its limit (%s): a limit that is beaten by more than "
                 "noise is no bound; find the loop it lacks\n",
                 what, precision.c_str(), ratio, limit.c_str());
  }
}

/// The straightforward scalar loop: torch's formula, one element at a time, in float.
template <class R, class P>
void plain_step(typename P::param_type* __restrict param, typename P::grad_type const* __restrict grad,
                float* __restrict master, typename P::state_type* __restrict m,
                typename P::state_type* __restrict v, typename P::state_type* __restrict vmax,
                std::size_t b, std::size_t e, float inv_scale, float lr, float wd, float beta1,
                float beta2, float eps, float step_size, float bc2_sqrt)
{
  using state_t = typename P::state_type;
  for (std::size_t i = b; i < e; ++i) {
    float w = P::has_master ? master[i] : convert<float>(param[i]);
    float g = convert<float>(grad[i]) * inv_scale;
    if constexpr (R::decay_mode == weight_decay_mode::l2) {
      g += wd * w;
    } else {
      w *= 1.0f - lr * wd;
    }
    float mi = convert<float>(m[i]);
    float vi = convert<float>(v[i]);
    mi += (1.0f - beta1) * (g - mi);
    vi = beta2 * vi + (1.0f - beta2) * g * g;
    float second = vi;
    if constexpr (R::amsgrad) {
      float const mx = std::max(convert<float>(vmax[i]), vi);
      vmax[i]        = convert<state_t>(mx);
      second         = mx;
    }
    w -= step_size * mi / (std::sqrt(second) / bc2_sqrt + eps);
    m[i] = convert<state_t>(mi);
    v[i] = convert<state_t>(vi);
    if constexpr (P::has_master) { master[i] = w; }
    param[i] = convert<typename P::param_type>(w);
  }
}

/// The plain scalar loop of a rule with at most one slot (SGD, SGD with momentum, Lion),
/// written as a user would write it.
template <class R, class P>
void plain_one_slot_step(typename P::param_type* __restrict param, typename P::grad_type const* __restrict grad,
                         float* __restrict master, typename P::state_type* __restrict s, std::size_t b,
                         std::size_t e, typename R::hyperparameters const& h, bool first)
{
  using state_t  = typename P::state_type;
  auto const lr  = static_cast<float>(h.lr);
  auto const wd  = static_cast<float>(h.weight_decay);
  for (std::size_t i = b; i < e; ++i) {
    float w  = P::has_master ? master[i] : convert<float>(param[i]);
    float g  = convert<float>(grad[i]);
    float si = R::slot_count == 1 ? convert<float>(s[i]) : 0.0f;
    if constexpr (std::is_same_v<R, SGD>) {
      w -= lr * (g + wd * w);
    } else if constexpr (std::is_same_v<R, Lion>) {
      auto const b1 = static_cast<float>(h.betas[0]), b2 = static_cast<float>(h.betas[1]);
      float const c = b1 * si + (1.0f - b1) * g;
      w             = w * (1.0f - lr * wd) - lr * static_cast<float>((c > 0.0f) - (c < 0.0f));
      si            = b2 * si + (1.0f - b2) * g;
    } else {
      auto const mom = static_cast<float>(h.momentum);
      g += wd * w;
      si = first ? g : mom * si + (1.0f - static_cast<float>(h.dampening)) * g;
      w -= lr * (h.nesterov ? g + mom * si : si);
    }
    if constexpr (R::slot_count == 1) { s[i] = convert<state_t>(si); }
    if constexpr (P::has_master) { master[i] = w; }
    param[i] = convert<typename P::param_type>(w);
  }
}

double triad_gb_s(thread_pool& pool, std::size_t n, int reps)
{
  region a(n * sizeof(double), false), b(n * sizeof(double), false), c(n * sizeof(double), false);
  pool.parallel_for(n, 4096, [&](std::size_t lo, std::size_t hi) {
    for (std::size_t i = lo; i < hi; ++i) {
      a.get<double>()[i] = 0.0;
      b.get<double>()[i] = 1.0;
      c.get<double>()[i] = 2.0;
    }
  });
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    auto const t0 = clock_type::now();
    pool.parallel_for(n, 4096, [&](std::size_t lo, std::size_t hi) {
      double* __restrict x       = a.get<double>();
      double const* __restrict y = b.get<double>();
      double const* __restrict z = c.get<double>();
      for (std::size_t i = lo; i < hi; ++i) { x[i] = y[i] + 3.0 * z[i]; }
    });
    t.push_back(seconds_since(t0));
  }
  return 3.0 * sizeof(double) * static_cast<double>(n) / median(t) / 1e9;
}

/// Per precision: every loop for AdamW's traffic (2 slots), interleaved; returns the best
/// over any memory in GB/s.
template <class P>
double run_limits(options const& o, thread_pool& pool, arrays<P>& arr, double triad)
{
  std::vector<loop_kind> kinds;
  for (bool const chunked : {false, true}) {
    for (bool const huge : {false, true}) {
      if (chunked && !huge) { continue; }  // the optimizer's chunks are PinnedHost's: huge
      auto const k = kinds_for<P>(chunked, huge);
      kinds.insert(kinds.end(), k.begin(), k.end());
    }
  }
  std::vector<std::function<void()>> loops;
  for (auto const& k : kinds) { loops.push_back([&, k] { run_loop<P, 2>(pool, arr, k, false); }); }
  auto const s          = interleaved_medians(o.reps, loops);
  std::size_t const bpe = bytes_per_element<P>(2);
  std::string fields;
  for (std::size_t i = 0; i < kinds.size(); ++i) {
    char buf[96];
    std::snprintf(buf, sizeof buf, ",\"%s_gb_s\":%.4g", kinds[i].name().c_str(),
                  static_cast<double>(arr.n) * static_cast<double>(bpe) / s[i] / 1e9);
    fields += buf;
  }
  auto const [best, best_name] = best_of(kinds, s, 0, arr.n);
  std::printf("{\"bench\":\"host_step\",\"variant\":\"limits\",\"traffic\":\"adamw\",\"precision\":\"%s\","
              "\"arch\":\"%s\",\"elements\":%zu,\"threads\":%zu,\"reps\":%d,\"bytes_per_elem\":%zu,"
              "\"huge_pages\":%s%s,\"best\":\"%s\",\"best_gb_s\":%.4g,\"triad_gb_s\":%.4g}\n",
              P::name().c_str(), host::arch_name(), arr.n, pool.size(), o.reps, bpe,
              arr.chunked.huge() ? "true" : "false", fields.c_str(), best_name.c_str(),
              best * static_cast<double>(bpe), triad);
  std::fflush(stdout);
  return best * static_cast<double>(bpe);
}

/// One rule's kernel over the 4k separate arrays, with the plain loop and the 4k limit.
template <class R, class P>
void run_kernel(options const& o, thread_pool& pool, arrays<P>& arr, double best_any_gb_s, double triad)
{
  if (!o.rule.empty() && o.rule != R::name) { return; }
  std::size_t const n     = arr.n;
  std::size_t const kgrain = 64 * host::batch_size<>;
  auto const a            = arr.template view<R>();
  typename R::hyperparameters h;
  h.lr = 1e-4;
  using state_t = typename P::state_type;
  state_t* s2   = nullptr;  // the last slot
  if constexpr (R::slot_count > 0) { s2 = arr.state[0][R::slot_count - 1]->template get<state_t>(); }

  std::int64_t step = 0;
  std::vector<std::function<void()>> loops;
  loops.push_back([&] { host::update<R, P>(pool, R::coefficients_for(h, ++step), a, n); });
  if constexpr (R::slot_count <= 1) {
    loops.push_back([&] {
      bool const first = ++step == 1;
      pool.parallel_for(n, kgrain, [&](std::size_t b, std::size_t e) {
        plain_one_slot_step<R, P>(arr.param.template get<typename P::param_type>(),
                                  arr.grad.template get<typename P::grad_type>(),
                                  P::has_master ? arr.master[0].template get<float>() : nullptr, s2, b, e, h, first);
      });
    });
  } else loops.push_back([&] {
    ++step;
    double const bc1 = 1.0 - std::pow(h.betas[0], static_cast<double>(step));
    double const bc2 = 1.0 - std::pow(h.betas[1], static_cast<double>(step));
    pool.parallel_for(n, kgrain, [&](std::size_t b, std::size_t e) {
      plain_step<R, P>(arr.param.template get<typename P::param_type>(), arr.grad.template get<typename P::grad_type>(),
                       P::has_master ? arr.master[0].template get<float>() : nullptr,
                       arr.state[0][0]->template get<state_t>(), arr.state[0][1]->template get<state_t>(), s2, b, e,
                       1.0f, static_cast<float>(h.lr), static_cast<float>(h.weight_decay),
                       static_cast<float>(h.betas[0]), static_cast<float>(h.betas[1]), static_cast<float>(h.eps),
                       static_cast<float>(h.lr / bc1), static_cast<float>(std::sqrt(bc2)));
    });
  });
  auto const kinds = kinds_for<P>(false, false);
  for (auto const& k : kinds) { loops.push_back([&, k] { run_loop<P, R::slot_count>(pool, arr, k, false); }); }

  auto const s           = interleaved_medians(o.reps, loops);
  double const gelem     = static_cast<double>(n) / s[0] / 1e9;
  double const plain_g   = static_cast<double>(n) / s[1] / 1e9;
  auto const [limit_g, limit_name] = best_of(kinds, s, 2, n);
  std::size_t const bpe  = bytes_per_element<P>(R::slot_count);
  double const gb        = gelem * static_cast<double>(bpe);
  std::printf(
    "{\"bench\":\"host_step\",\"variant\":\"kernel\",\"rule\":\"%s\",\"precision\":\"%s\",\"arch\":\"%s\","
    "\"elements\":%zu,\"threads\":%zu,\"reps\":%d,\"memory\":\"4k\",\"seconds_per_step\":%.6g,"
    "\"gelem_per_s\":%.4g,\"bytes_per_elem\":%zu,\"gb_per_s\":%.4g,\"plain_gelem_per_s\":%.4g,"
    "\"plain_ratio\":%.4f,\"limit\":\"%s\",\"limit_gb_s\":%.4g,\"limit_ratio\":%.4f,"
    "\"best_any_memory_gb_s\":%.4g,\"best_any_memory_ratio\":%.4f,\"triad_gb_s\":%.4g}\n",
    std::string(R::name).c_str(), P::name().c_str(), host::arch_name(), n, pool.size(), o.reps, s[0], gelem, bpe, gb,
    plain_g, gelem / plain_g, limit_name.c_str(), limit_g * static_cast<double>(bpe), gelem / limit_g, best_any_gb_s,
    gb / best_any_gb_s, triad);
  std::fflush(stdout);
  warn_if_beaten((std::string("the ") + std::string(R::name) + " kernel").c_str(), P::name(), gelem / limit_g,
                 limit_name);
  warn_if_beaten((std::string("the plain ") + std::string(R::name) + " loop").c_str(), P::name(), plain_g / limit_g,
                 limit_name);
}

/// A transformer-like mix of n elements: large matrices, small biases and norms.
std::vector<std::size_t> model_sizes(std::size_t n)
{
  std::vector<std::size_t> sizes;
  std::size_t const pattern_sizes[] = {std::size_t{1} << 22, 4096, 1024, 1024, std::size_t{1} << 22, 1024};
  for (std::size_t total = 0, i = 0; total < n; ++i) {
    std::size_t const s = std::min(pattern_sizes[i % 6], n - total);
    sizes.push_back(s);
    total += s;
  }
  return sizes;
}

/// OffloadedOptimizer<R, P>::step() (PinnedHost) over a model-like set of tensors, with
/// the non-finite check (the default) and without, interleaved with the bare kernel and the
/// limit over the optimizer's memory (chunks in huge pages; params and gradients 4k).
/// Adafactor (a tensor phase) has no bare kernel; its passes read each gradient twice and
/// each param once more, which its bytes count and its limit leaves out (a loose bound).
template <class R, class P>
void run_optimizer(options const& o, thread_pool& pool, arrays<P>& arr, double best_any_gb_s, double triad)
{
  if (!o.rule.empty() && o.rule != R::name) { return; }
  constexpr std::size_t S = R::slot_count;
  constexpr bool phased   = has_tensor_phase<R>;
  std::size_t const n = arr.n;
  auto const sizes    = model_sizes(n);
  region param(n * sizeof(typename P::param_type), false);
  region grad(n * sizeof(typename P::grad_type), false);
  pool.parallel_for(n, 4096, [&](std::size_t b, std::size_t e) {
    for (std::size_t i = b; i < e; ++i) {
      param.get<typename P::param_type>()[i] =
        convert<typename P::param_type>(0.5f + static_cast<float>(i % 1000) * 1e-4f);
      grad.get<typename P::grad_type>()[i] = arr.grad.template get<typename P::grad_type>()[i];
    }
  });
  using Opt = OffloadedOptimizer<R, P>;
  typename Opt::options checked, unchecked;
  checked.threads = unchecked.threads = pool.size();
  checked.on_nonfinite                = nonfinite_policy::skip_step;
  unchecked.on_nonfinite              = nonfinite_policy::ignore;
  Opt with_check({}, checked), without({}, unchecked);
  std::vector<grad_view<typename P::grad_type>> views;
  for (std::size_t t = 0, off = 0; t < sizes.size(); off += sizes[t], ++t) {
    std::string name = "t";  // (not "t" + ...: GCC 12 -Wrestrict false positive, bug 105329)
    name += std::to_string(t);
    // Adafactor's large tensors as matrices of 1024 columns (its statistics per row and
    // column), the biases and norms as vectors
    tensor_shape const shape = sizes[t] > 4096 && sizes[t] % 1024 == 0 ? tensor_shape{sizes[t] / 1024, 1024}
                                                                       : tensor_shape::of_vector(sizes[t]);
    with_check.add_tensor(name, param.get<typename P::param_type>() + off, shape);
    without.add_tensor(std::move(name), param.get<typename P::param_type>() + off, shape);
    views.push_back({grad.get<typename P::grad_type>() + off, sizes[t], location::host});
  }
  typename R::hyperparameters h;
  h.lr              = 1e-4;
  std::int64_t step = 0;
  auto const kinds  = kinds_for<P>(true, true);
  std::vector<std::function<void()>> loops;
  loops.push_back([&] { with_check.step(views); });
  loops.push_back([&] { without.step(views); });
  if constexpr (phased) {
    loops.push_back([] {});  // (no bare kernel)
  } else {
    loops.push_back([&, a = arr.template view<R>()] { host::update<R, P>(pool, R::coefficients_for(h, ++step), a, n); });
  }
  for (auto const& k : kinds) { loops.push_back([&, k] { run_loop<P, S>(pool, arr, k, true); }); }
  for (auto const& k : kinds) { loops.push_back([&, k] { run_loop<P, S>(pool, arr, k, false); }); }
  // The default step (AdamW, fp32 or bf16 params with an fp32 master): the same unchecked step
  // as a program built for plain x86-64 runs it, with the dispatched kernels and with its own.
  constexpr bool portable = std::is_same_v<R, AdamW> && (std::is_same_v<P, Fp32> || std::is_same_v<P, Bf16Mixed>);
  std::size_t const portable_at = loops.size();
  // And the same unchecked step with its workers bound to physical cores (thread_binding).
  typename Opt::options bound_options = unchecked;
  bound_options.bind_threads          = thread_binding::physical_cores;
  std::unique_ptr<Opt> bound;
  if constexpr (portable) {
    for (auto const k : {host_step_portable::kernels::dispatched, host_step_portable::kernels::baseline}) {
      loops.push_back(host_step_portable::adamw_step(k, std::is_same_v<P, Bf16Mixed>, param.get<typename P::param_type>(),
                                                     grad.get<typename P::grad_type>(), sizes.data(), sizes.size(),
                                                     pool.size()));
    }
    bound = std::make_unique<Opt>(typename R::hyperparameters{}, bound_options);
    for (std::size_t t = 0, off = 0; t < sizes.size(); off += sizes[t], ++t) {
      std::string name = "t";
      name += std::to_string(t);
      bound->add_tensor(std::move(name), param.get<typename P::param_type>() + off, sizes[t]);
    }
    loops.push_back([&] { bound->step(views); });
  }
  auto const s = interleaved_medians(o.reps, loops);
  if constexpr (portable) {
    // ratio: the dispatched step's speed over the -march build's (1: as fast); baseline_ratio
    // the same for the portable build's own kernels, as a plain x86-64 build without dispatch
    // runs them.
    std::printf(
      "{\"bench\":\"host_step\",\"variant\":\"dispatch\",\"rule\":\"%s\",\"precision\":\"%s\",\"arch\":\"%s\","
      "\"level\":\"%s\",\"portable_arch\":\"%s\",\"elements\":%zu,\"tensors\":%zu,\"threads\":%zu,\"reps\":%d,"
      "\"nonfinite_check\":false,\"seconds_per_step\":%.6g,\"native_seconds_per_step\":%.6g,"
      "\"baseline_seconds_per_step\":%.6g,\"ratio\":%.4f,\"baseline_ratio\":%.4f}\n",
      std::string(R::name).c_str(), P::name().c_str(), host::arch_name(), host_step_portable::dispatched_level().c_str(),
      host_step_portable::baseline_arch().c_str(), n, sizes.size(), pool.size(), o.reps, s[portable_at], s[1],
      s[portable_at + 1], s[1] / s[portable_at], s[1] / s[portable_at + 1]);
    // binding: the unchecked step with the workers bound to physical cores against the same
    // step left to the kernel (ratio > 1: binding is faster), in the same interleaved run.
    std::string cpus;
    for (int c : bound->pool().bound_cpus()) {
      if (!cpus.empty()) { cpus += ','; }
      cpus += std::to_string(c);
    }
    std::printf(
      "{\"bench\":\"host_step\",\"variant\":\"binding\",\"rule\":\"%s\",\"precision\":\"%s\",\"arch\":\"%s\","
      "\"elements\":%zu,\"threads\":%zu,\"physical_cores\":%zu,\"bound_cpus\":[%s],\"reps\":%d,"
      "\"nonfinite_check\":false,\"unbound_seconds_per_step\":%.6g,\"bound_seconds_per_step\":%.6g,"
      "\"ratio\":%.4f}\n",
      std::string(R::name).c_str(), P::name().c_str(), host::arch_name(), n, pool.size(), physical_core_cpus().size(),
      cpus.c_str(), o.reps, s[1], s[portable_at + 2], s[1] / s[portable_at + 2]);
    std::fflush(stdout);
  }

  // The tensor phase's reads: the gradient twice and the param once more.
  std::size_t const phase_bytes =
    phased ? 2 * sizeof(typename P::grad_type) + sizeof(typename P::param_type) : std::size_t{0};
  std::size_t const bpe = bytes_per_element<P>(S) + phase_bytes;
  double const kernel_g = phased ? std::nan("") : static_cast<double>(n) / s[2] / 1e9;
  // What the check's pass costs the best loops: the best checked loop's time over the best
  // unchecked one's. A separate read pass runs at the read-only bandwidth, which on many
  // machines is well below what a mixed read/write stream gets: this, not the byte ratio,
  // is what a check before any update can reach.
  double const check_cost_limit = best_of(kinds, s, 3 + kinds.size(), n).first / best_of(kinds, s, 3, n).first;
  for (bool const check : {true, false}) {
    double const sec                 = s[check ? 0 : 1];
    double const gelem               = static_cast<double>(n) / sec / 1e9;
    auto const [limit_g, limit_name] = best_of(kinds, s, check ? 3 : 3 + kinds.size(), n);
    std::size_t const bytes          = bpe + (check ? sizeof(typename P::grad_type) : 0);
    double const gb                  = gelem * static_cast<double>(bytes);
    char kernel[96] = "null", kernel_ratio[32] = "null";  // (Adafactor has no bare kernel)
    if (!phased) {
      std::snprintf(kernel, sizeof kernel, "%.4g", kernel_g);
      std::snprintf(kernel_ratio, sizeof kernel_ratio, "%.4f", gelem / kernel_g);
    }
    std::printf(
      "{\"bench\":\"host_step\",\"variant\":\"optimizer\",\"rule\":\"%s\",\"precision\":\"%s\",\"arch\":\"%s\","
      "\"elements\":%zu,\"tensors\":%zu,\"chunk_elements\":%zu,\"threads\":%zu,\"reps\":%d,"
      "\"memory\":\"state huge, params and grads 4k\",\"nonfinite_check\":%s,\"seconds_per_step\":%.6g,"
      "\"gelem_per_s\":%.4g,\"bytes_per_elem\":%zu,\"gb_per_s\":%.4g,\"kernel_gelem_per_s\":%s,"
      "\"kernel_ratio\":%s,\"limit\":\"%s%s\",\"limit_gb_s\":%.4g,\"limit_ratio\":%.4f,"
      "\"best_any_memory_gb_s\":%.4g,\"best_any_memory_ratio\":%.4f,\"check_cost\":%.4f,"
      "\"check_byte_ratio\":%.4f,\"check_cost_limit\":%.4f,\"triad_gb_s\":%.4g}\n",
      std::string(R::name).c_str(), P::name().c_str(), host::arch_name(), n, sizes.size(),
      with_check.state_layout().chunk_elements(),
      pool.size(), o.reps, check ? "true" : "false", sec, gelem, bytes, gb, kernel, kernel_ratio,
      limit_name.c_str(), check ? "+grad_read" : "", limit_g * static_cast<double>(bytes), gelem / limit_g,
      best_any_gb_s, gb / best_any_gb_s, s[0] / s[1],
      static_cast<double>(bpe + sizeof(typename P::grad_type)) / static_cast<double>(bpe), check_cost_limit, triad);
    std::fflush(stdout);
    warn_if_beaten(check ? "the optimizer's checked step" : "the optimizer's unchecked step", P::name(),
                   gelem / limit_g, limit_name);
  }
}

/// One precision of the compact-state comparison: AdamW's unchecked optimizer step over the
/// model-like tensors, and the traffic loops of its bytes over the optimizer's memory.
template <class P>
struct compact_case {
  using Opt = OffloadedOptimizer<AdamW, P>;
  arrays<P> arr;
  region param, grad;
  std::unique_ptr<Opt> opt;
  std::vector<grad_view<typename P::grad_type>> views;
  std::vector<loop_kind> kinds = kinds_for<P>(true, true);

  compact_case(std::size_t n, thread_pool& pool)
    : arr(n, pool), param(n * sizeof(typename P::param_type), false), grad(n * sizeof(typename P::grad_type), false)
  {
    pool.parallel_for(n, 4096, [&](std::size_t b, std::size_t e) {
      for (std::size_t i = b; i < e; ++i) {
        param.get<typename P::param_type>()[i] = convert<typename P::param_type>(0.5f + static_cast<float>(i % 1000) * 1e-4f);
        grad.get<typename P::grad_type>()[i]   = arr.grad.template get<typename P::grad_type>()[i];
      }
    });
    typename Opt::options oo;
    oo.threads      = pool.size();
    oo.on_nonfinite = nonfinite_policy::ignore;
    typename Opt::hyperparameters h;
    h.lr = 1e-4;
    opt  = std::make_unique<Opt>(h, oo);
    auto const sizes = model_sizes(n);
    for (std::size_t t = 0, off = 0; t < sizes.size(); off += sizes[t], ++t) {
      std::string name = "t";
      name += std::to_string(t);
      opt->add_tensor(std::move(name), param.get<typename P::param_type>() + off, sizes[t]);
      views.push_back({grad.get<typename P::grad_type>() + off, sizes[t], location::host});
    }
  }
  void add_loops(thread_pool& pool, std::vector<std::function<void()>>& loops)
  {
    loops.push_back([this] { opt->step(views); });
    for (auto const& k : kinds) { loops.push_back([this, &pool, k] { run_loop<P, 2>(pool, arr, k, false); }); }
  }
};

/// Compact state: AdamW's step with bf16 params and fp32 moments (the first), and with 8-bit
/// moments and an fp32 master, a compensation (Compensated) or stochastic rounding, all timed
/// in one interleaved set; each row's limit is the best loop of its own bytes, and `speedup`
/// its step's speed over the first's, rep for rep medians.
template <class... P>
void run_compact(options const& o, thread_pool& pool, double triad)
{
  if (!o.rule.empty() && o.rule != AdamW::name) { return; }
  if (!o.precision.empty() && ((o.precision != P::name()) && ...)) { return; }
  auto cases = std::make_tuple(std::make_unique<compact_case<P>>(o.elements, pool)...);
  std::vector<std::function<void()>> loops;
  std::apply([&](auto&... c) { (c->add_loops(pool, loops), ...); }, cases);
  auto const s = interleaved_medians(o.reps, loops);
  std::size_t first = 0;
  double const baseline = s[0];
  std::apply([&](auto&... c) {
    auto row = [&](auto& one) {
      using Q = typename std::remove_reference_t<decltype(*one)>::Opt::precision_type;
      std::size_t const n              = o.elements;
      double const sec                 = s[first];
      double const gelem               = static_cast<double>(n) / sec / 1e9;
      auto const [limit_g, limit_name] = best_of(one->kinds, s, first + 1, n);
      std::size_t const bpe            = bytes_per_element<Q>(2);
      std::printf(
        "{\"bench\":\"host_step\",\"variant\":\"compact\",\"rule\":\"adamw\",\"precision\":\"%s\","
        "\"arch\":\"%s\",\"elements\":%zu,\"threads\":%zu,\"reps\":%d,\"nonfinite_check\":false,"
        "\"seconds_per_step\":%.6g,\"gelem_per_s\":%.4g,\"bytes_per_elem\":%zu,\"state_bytes_per_elem\":%.4g,"
        "\"speedup\":%.4f,\"limit\":\"%s\",\"limit_gb_s\":%.4g,\"limit_ratio\":%.4f,\"triad_gb_s\":%.4g}\n",
        Q::name().c_str(), host::arch_name(), n, pool.size(), o.reps, sec, gelem, bpe,
        static_cast<double>(one->opt->state_layout().chunk_bytes()) / static_cast<double>(one->opt->state_layout().chunk_elements()),
        baseline / sec, limit_name.c_str(), limit_g * static_cast<double>(bpe), gelem / limit_g, triad);
      std::fflush(stdout);
      warn_if_beaten("the compact-state step", Q::name(), gelem / limit_g, limit_name);
      first += 1 + one->kinds.size();
    };
    (row(c), ...);
  }, cases);
}

template <class P>
void run_precision(options const& o, thread_pool& pool, double triad)
{
  if (!o.precision.empty() && o.precision != P::name()) { return; }
  arrays<P> arr(o.elements, pool);
  double const best = run_limits<P>(o, pool, arr, triad);
  run_kernel<Adam, P>(o, pool, arr, best, triad);
  run_kernel<AdamW, P>(o, pool, arr, best, triad);
  run_kernel<AdamAmsgrad, P>(o, pool, arr, best, triad);
  run_kernel<AdamWAmsgrad, P>(o, pool, arr, best, triad);
  run_kernel<SGD, P>(o, pool, arr, best, triad);
  run_kernel<SGDMomentum, P>(o, pool, arr, best, triad);
  run_kernel<Lion, P>(o, pool, arr, best, triad);
  run_optimizer<AdamW, P>(o, pool, arr, best, triad);
  run_optimizer<SGD, P>(o, pool, arr, best, triad);
  run_optimizer<SGDMomentum, P>(o, pool, arr, best, triad);
  run_optimizer<Lion, P>(o, pool, arr, best, triad);
  run_optimizer<Adafactor, P>(o, pool, arr, best, triad);
}

}  // namespace

int main(int argc, char** argv)
{
  options const o = parse(argc, argv);
  try {
    thread_pool pool(o.threads);
    double const triad = triad_gb_s(pool, o.elements, std::max(3, o.reps));
    run_precision<Fp32>(o, pool, triad);
    run_precision<Bf16Mixed>(o, pool, triad);
    run_precision<Fp16Mixed>(o, pool, triad);
    run_precision<Bf16MixedBf16State>(o, pool, triad);
    run_compact<Bf16Mixed, Bf16Mixed8bit, Precision<bf16, bf16, Compensated, Bf16Mixed8bit::state_type>,
                Precision<bf16, bf16, StochasticRounding, Bf16Mixed8bit::state_type>, Bf16MixedBf16State,
                Precision<bf16, bf16, StochasticRounding, bf16>>(o, pool, triad);
  } catch (std::exception const& e) {
    std::fprintf(stderr, "host_step: %s\n", e.what());
    return 1;
  }
  return 0;
}
