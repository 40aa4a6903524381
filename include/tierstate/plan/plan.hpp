// SPDX-License-Identifier: Apache-2.0
// The planner's model (issue 24): what each composition keeps where for a job, whether it fits
// a machine, and how long its step should take from the bandwidths the probes measure. Used by
// tools/tierstate-plan and by tierstate_torch.plan(model), so that both say the same thing.
//
//   plan::job j{.params = 7e9};                       // bf16 params, fp32 state, AdamW
//   plan::machine m{.gpu_bytes = 24.0 * (1ull << 30), .nvme = "/mnt/nvme"};
//   plan::measure(m, j);                              // host (and disk) probes, a second or two
//   for (auto const& c : plan::compositions(j, m)) { ... c.fits, c.step_seconds ... }
//   std::fputs(plan::table(j, m, plan::compositions(j, m)).c_str(), stdout);
//
// The bytes are the optimizer's model states (params, gradients, master, moments) and its
// staging; activations are the framework's. A composition fits where each memory holds it
// within 90%. A step is bound by the slowest of its three streams: the host update's memory
// traffic, the state's reads and writes on the disk, and params and gradients over PCIe.
#pragma once

#include <tierstate/core/error.hpp>
#include <tierstate/core/layout.hpp>
#include <tierstate/core/thread_pool.hpp>
#include <tierstate/io/error.hpp>
#include <tierstate/plan/probes.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include <sys/statvfs.h>
#include <unistd.h>

namespace tierstate::inline TIERSTATE_ABI::plan {

/// A training job as the planner sees it: a count of parameters and the optimizer's formats.
struct job {
  double params = 0;                 ///< parameters (elements), > 0
  std::string param  = "bf16";       ///< bf16, fp16 or fp32: the weights the model computes with
  std::string state  = "fp32";       ///< fp32, bf16 or int8 (8 bits, an fp32 scale per 256): the rule's slots
  std::string master = "fp32";       ///< fp32, kahan (a bf16 compensation) or none; none with fp32 params
  std::string rule   = "adamw";      ///< adamw, adam, adam_amsgrad, adamw_amsgrad, sgd, sgd_momentum, lion
  int layers = 32;                   ///< offloaded weights: two layers' params and gradients are on the GPU
  std::size_t chunk_elements = layout::default_chunk_elements;
  unsigned depth = 2;                ///< Pipelined<Depth>' and CudaOverlapped<Depth>'s

  /// Refuses a value the planner does not know (invalid_option naming it).
  void validate() const
  {
    auto one_of = [](char const* option, std::string const& v, std::vector<char const*> const& known) {
      for (char const* k : known) {
        if (v == k) { return; }
      }
      std::string list;
      for (char const* k : known) { list += std::string(list.empty() ? "" : ", ") + k; }
      throw invalid_option(option, v, "is not one of " + list);
    };
    if (!(params > 0) || !std::isfinite(params)) { throw invalid_option("params", std::to_string(params), "must be a positive count"); }
    one_of("param", param, {"bf16", "fp16", "fp32"});
    one_of("state", state, {"fp32", "bf16", "int8"});
    one_of("master", master, {"fp32", "kahan", "none"});
    one_of("rule", rule, {"adamw", "adam", "adam_amsgrad", "adamw_amsgrad", "sgd", "sgd_momentum", "lion"});
    if (layers < 1) { throw invalid_option("layers", std::to_string(layers), "must be at least 1"); }
    if (chunk_elements == 0) { throw invalid_option("chunk_elements", "0", "must be at least 1"); }
  }
  [[nodiscard]] double param_bytes() const { return param == "fp32" ? 4 : 2; }
  [[nodiscard]] double master_bytes() const
  {
    if (param == "fp32" || master == "none") { return 0; }
    return master == "kahan" ? 2 : 4;
  }
  [[nodiscard]] int slots() const
  {
    if (rule == "adam" || rule == "adamw") { return 2; }
    if (rule == "adam_amsgrad" || rule == "adamw_amsgrad") { return 3; }
    if (rule == "sgd_momentum" || rule == "lion") { return 1; }
    return 0;  // sgd
  }
  /// A slot element: fp32, bf16, or 8 bits with an fp32 scale per block of 256 (codecs/dynamic8.hpp).
  [[nodiscard]] double slot_bytes() const { return state == "fp32" ? 4 : state == "bf16" ? 2 : 1 + 4.0 / 256; }
  /// The optimizer state per element: master and slots.
  [[nodiscard]] double state_bytes() const { return master_bytes() + slots() * slot_bytes(); }
  /// Whether the param is its own master (fp32 params, or a kahan or no master): the update then
  /// reads the param too, and with device params it comes down over PCIe as well.
  [[nodiscard]] bool own_master() const { return param == "fp32" || master != "fp32"; }
  /// What the host update reads and writes per element: the state twice, the gradient, the param
  /// written (and read, where it is its own master).
  [[nodiscard]] double host_traffic() const
  {
    return 2 * state_bytes() + 2 * param_bytes() + (own_master() ? param_bytes() : 0);
  }
  /// What crosses PCIe per element with device params: the gradient down, the param up (and
  /// down first, where it is its own master).
  [[nodiscard]] double pcie_traffic() const { return (own_master() ? 3 : 2) * param_bytes(); }
};

/// The machine: memories, the NVMe path, and the bandwidths (0: not known yet; measure() fills
/// them). Each bandwidth's source ("measured", "given", "assumed ...") is printed beside it.
struct machine {
  double gpu_bytes  = 24.0 * (1ull << 30);
  double host_bytes = 128.0 * (1ull << 30);
  std::string nvme{};                  ///< a folder on the drive for the state; empty: none
  std::optional<double> nvme_free{};   ///< its free bytes (statvfs when not given)
  double host_gb_s = 0, disk_gb_s = 0, pcie_gb_s = 0;
  std::string host_source = "assumed", disk_source = "assumed", pcie_source = "assumed";
};

/// One composition's needs and predicted step.
struct composition {
  std::string name{}, fits_text{}, bound{};
  bool fits = false;
  double gpu_bytes = 0, host_bytes = 0, nvme_bytes = 0, memlock_bytes = 0;
  double compute_seconds = 0, disk_seconds = 0, pcie_seconds = 0;
  double step_seconds = 0;  ///< NaN: not predicted (everything on the GPU; no disk bandwidth)
};

/// Fills what `m` does not know: the NVMe folder's free bytes (statvfs), and, with `probe`, the
/// host bandwidth (over the job's size up to 2^26 elements), the disk's (`scratch_bytes` each
/// way) and, in a CUDA build with a GPU, PCIe's; what is still unknown then is assumed (host
/// 20 GB/s, PCIe 25 GB/s) and said so.
inline void measure(machine& m, job const& j, bool probe = true, std::size_t scratch_bytes = std::size_t{256} << 20)
{
  j.validate();
  if (!m.nvme.empty() && !m.nvme_free) {
    struct statvfs st{};
    if (::statvfs(m.nvme.c_str(), &st) != 0) { throw io_error(errno, m.nvme, "statvfs", 0, 0, "the NVMe folder"); }
    m.nvme_free = static_cast<double>(st.f_bavail) * static_cast<double>(st.f_frsize);
  }
  if (probe && m.host_gb_s == 0) {
    thread_pool pool;
    m.host_gb_s   = probe_host_gb_s(pool, static_cast<std::size_t>(std::min(j.params, std::ldexp(1.0, 26))));
    m.host_source = "measured";
  }
  if (probe && m.disk_gb_s == 0 && !m.nvme.empty()) {
    m.disk_gb_s   = probe_disk_gb_s(m.nvme, scratch_bytes);
    m.disk_source = "measured";
  }
#if defined(TIERSTATE_ENABLE_CUDA)
  std::string no_pcie = "assumed: no GPU seen";
  if (probe && m.pcie_gb_s == 0) {
    try {
      if (auto const g = probe_pcie_gb_s()) { m.pcie_gb_s = *g, m.pcie_source = "measured"; }
    } catch (std::exception const& e) {  // the plan goes on with PCIe assumed, saying why
      no_pcie = std::string("assumed: the PCIe probe failed: ") + e.what();
    }
  }
#else
  char const* const no_pcie = "assumed: a build without CUDA";
#endif
  if (m.host_gb_s == 0) { m.host_gb_s = 20, m.host_source = "assumed"; }
  if (m.pcie_gb_s == 0) { m.pcie_gb_s = 25, m.pcie_source = probe ? no_pcie : "assumed"; }
}

/// The four compositions for `j` on `m`: everything on the GPU, the state in PinnedHost, the state
/// in NvmeFile, and state and weights in NvmeFile (offload_parameters).
inline std::vector<composition> compositions(job const& j, machine const& m)
{
  j.validate();
  double const n = j.params, p = j.param_bytes(), s = j.state_bytes();
  double const chunk      = static_cast<double>(j.chunk_elements);
  double const staging    = (j.depth + 2.0) * chunk * s;      // NvmeFile's ring
  double const pcie_rings = (j.depth + 2.0) * chunk * 2 * p;  // CudaOverlapped's gradients and params
  double const host_gb_s = m.host_gb_s > 0 ? m.host_gb_s : 20, pcie_gb_s = m.pcie_gb_s > 0 ? m.pcie_gb_s : 25;
  double const compute = n * j.host_traffic() / (host_gb_s * 1e9);
  double const pcie    = n * j.pcie_traffic() / (pcie_gb_s * 1e9);
  auto disk = [&](double bytes) { return m.disk_gb_s > 0 ? bytes / (m.disk_gb_s * 1e9) : NAN; };
  std::vector<composition> out;
  auto fill = [&](composition c) {
    std::string why;
    if (c.gpu_bytes > 0.9 * m.gpu_bytes) { why += "GPU "; }
    if (c.host_bytes > 0.9 * m.host_bytes) { why += "host "; }
    if (c.nvme_bytes > 0 && (m.nvme.empty() || (m.nvme_free && c.nvme_bytes > 0.9 * *m.nvme_free))) { why += "NVMe "; }
    c.fits      = why.empty();
    c.fits_text = c.fits ? "yes" : "no (" + why.substr(0, why.size() - 1) + ")";
    if (c.bound.empty()) {
      c.step_seconds = std::max({c.compute_seconds, c.disk_seconds, c.pcie_seconds});  // NaN where the disk is unknown
      c.bound = std::isnan(c.disk_seconds) ? "disk (not measured)"
              : c.step_seconds == c.disk_seconds ? "disk" : c.step_seconds == c.pcie_seconds ? "PCIe" : "host memory";
      if (std::isnan(c.disk_seconds)) { c.step_seconds = NAN; }
    }
    out.push_back(c);
  };
  fill({.name = "all on the GPU (no offload)", .bound = "GPU (not predicted)", .gpu_bytes = n * (2 * p + s), .step_seconds = NAN});
  fill({.name = "state in PinnedHost (ZeRO-Offload)", .gpu_bytes = n * 2 * p, .host_bytes = n * s + pcie_rings,
        .compute_seconds = compute, .pcie_seconds = pcie});
  fill({.name = "state in NvmeFile (ZeRO-Infinity)", .gpu_bytes = n * 2 * p, .host_bytes = staging + pcie_rings,
        .nvme_bytes = n * s, .memlock_bytes = staging, .compute_seconds = compute, .disk_seconds = disk(n * 2 * s),
        .pcie_seconds = pcie});
  double const window = std::min(2.0 / j.layers, 1.0) * n * 2 * p;  // two layers' params and gradients (at most all)
  fill({.name = "state and weights in NvmeFile (offload_parameters)", .gpu_bytes = window,
        .host_bytes = staging + pcie_rings + window, .nvme_bytes = n * (s + p), .memlock_bytes = staging,
        .compute_seconds = compute, .disk_seconds = disk(n * (2 * s + 2 * p)), .pcie_seconds = pcie});
  return out;
}

namespace detail {
inline std::string plan_size(double b)
{
  char t[32];
  if (b == 0) { return "0"; }
  if (b < (1ull << 30)) {
    std::snprintf(t, sizeof t, "%.0f MiB", b / (1ull << 20));
  } else {
    std::snprintf(t, sizeof t, "%.1f GiB", b / (1ull << 30));
  }
  return t;
}
/// `v` as a JSON number, or null where it is not finite.
inline std::string plan_number(double v)
{
  if (!std::isfinite(v)) { return "null"; }
  char t[32];
  std::snprintf(t, sizeof t, "%.4g", v);
  return t;
}
/// A byte count as a JSON integer.
inline std::string plan_bytes(double v)
{
  char t[32];
  std::snprintf(t, sizeof t, "%.0f", v);
  return t;
}
/// `s` as a JSON string (quotes, backslashes and control characters escaped).
inline std::string plan_string(std::string const& s)
{
  std::string o = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      o += '\\', o += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char t[8];
      std::snprintf(t, sizeof t, "\\u%04x", c);
      o += t;
    } else {
      o += c;
    }
  }
  return o + "\"";
}
}  // namespace detail

/// The plan as a table a person reads: the job, the bandwidths and where they came from, then a
/// row per composition.
inline std::string table(job const& j, machine const& m, std::vector<composition> const& rows)
{
  std::string o;
  char line[512];
  std::snprintf(line, sizeof line, "%.3g parameters, %s params, %s state, %s master, %s; GPU %s, host %s", j.params,
                j.param.c_str(), j.state.c_str(), j.master.c_str(), j.rule.c_str(), detail::plan_size(m.gpu_bytes).c_str(),
                detail::plan_size(m.host_bytes).c_str());
  o += line;
  if (!m.nvme.empty()) { o += ", NVMe " + m.nvme + " (" + detail::plan_size(m.nvme_free.value_or(0)) + " free)"; }
  char disk[96] = "disk: no NVMe folder given";
  if (m.disk_gb_s > 0) { std::snprintf(disk, sizeof disk, "disk %.2f GB/s (%s)", m.disk_gb_s, m.disk_source.c_str()); }
  std::snprintf(line, sizeof line, "\nbandwidths: host memory %.1f GB/s (%s), %s, PCIe %.0f GB/s (%s)\n\n", m.host_gb_s,
                m.host_source.c_str(), disk, m.pcie_gb_s, m.pcie_source.c_str());
  o += line;
  std::snprintf(line, sizeof line, "%-52s %-14s %11s %11s %11s %11s %10s  %s\n", "composition", "fits", "GPU", "host", "NVMe",
                "memlock", "step", "bound by");
  o += line;
  for (auto const& r : rows) {
    char step[32] = "-";
    if (std::isfinite(r.step_seconds)) { std::snprintf(step, sizeof step, "%.2f s", r.step_seconds); }
    std::snprintf(line, sizeof line, "%-52s %-14s %11s %11s %11s %11s %10s  %s\n", r.name.c_str(), r.fits_text.c_str(),
                  detail::plan_size(r.gpu_bytes).c_str(), detail::plan_size(r.host_bytes).c_str(),
                  detail::plan_size(r.nvme_bytes).c_str(), detail::plan_size(r.memlock_bytes).c_str(), step, r.bound.c_str());
    o += line;
  }
  return o;
}

/// The plan as JSON lines, one per composition, for the record.
inline std::string json_lines(job const& j, machine const& m, std::vector<composition> const& rows)
{
  std::string o;
  for (auto const& r : rows) {
    o += "{\"plan\":" + detail::plan_string(r.name) + ",\"params\":" + detail::plan_bytes(j.params) +
         ",\"param\":" + detail::plan_string(j.param) + ",\"state\":" + detail::plan_string(j.state) +
         ",\"master\":" + detail::plan_string(j.master) + ",\"rule\":" + detail::plan_string(j.rule) +
         ",\"fits\":" + (r.fits ? "true" : "false") + ",\"gpu_bytes\":" + detail::plan_bytes(r.gpu_bytes) +
         ",\"host_bytes\":" + detail::plan_bytes(r.host_bytes) + ",\"nvme_bytes\":" + detail::plan_bytes(r.nvme_bytes) +
         ",\"memlock_bytes\":" + detail::plan_bytes(r.memlock_bytes) +
         ",\"step_seconds\":" + detail::plan_number(r.step_seconds) + ",\"bound\":" + detail::plan_string(r.bound) +
         ",\"host_gb_s\":" + detail::plan_number(m.host_gb_s) +
         ",\"disk_gb_s\":" + detail::plan_number(m.disk_gb_s > 0 ? m.disk_gb_s : NAN) +
         ",\"pcie_gb_s\":" + detail::plan_number(m.pcie_gb_s) + ",\"pcie_source\":" + detail::plan_string(m.pcie_source) + "}\n";
  }
  return o;
}

}  // namespace tierstate::plan
