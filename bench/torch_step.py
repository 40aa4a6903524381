# SPDX-License-Identifier: Apache-2.0
"""One AdamW step on CPU parameters, tierstate_torch.AdamW against torch.optim.AdamW and
DeepSpeed's CPU Adam, all timed interleaved in one process; then the overlap_backward
streaming step against the plain one.

    python bench/torch_step.py [--elements N] [--reps R] [--placements K] [--path DIR]
                               [--dtypes float32,bfloat16] [--only NAME,...]
                               [--overlap-elements N] [--overlap-width W] [--overlap-batch B]

Part 1, the step (one JSON line per row and dtype). --elements parameters (default 2^26) of
a transformer-like mix (1024x1024 and 4096x1024 matrices and their vectors) and one set of
gradients, made once per dtype. Every row's optimizer gets its own copy of the params; the
gradient tensors are shared (every row only reads them, but for the GradScaler row's unscale,
which multiplies them in place by 1.0): at 2^26 fp32 elements the eight rows hold about
6.5 GiB. All optimizers are made first, each is warmed up with one step (which makes its
state), then each of the --reps rounds steps every optimizer once, the order rotated by one
each round, so that a change in the machine's load falls on every row alike.

Where a row's memory lies matters as much as the load: on the development VM, two
torch.optim.AdamW(fused=True) over two copies of the same params, timed interleaved in one
process, differed by up to 1.22x, run after run, and tierstate against torch fused moved
from 0.78x to 1.2x between processes. So all of this is done --placements times (default 3),
every row made anew each time, their params copied (and their state made) in the order of
the rows rotated by one each time, and freed after. A row's `median_seconds` is the median
over all its rounds of the timed region, its `ratio_to_torch_fused` the median over the
placements of its median over torch_fused's in the same placement (`placement_ratios`):
- torch_single_tensor, torch_foreach, torch_fused: opt.step() of torch.optim.AdamW with
  foreach=False, foreach=True, fused=True;
- torch_fused_gradscaler: torch's fused AdamW with the inf/NaN protection a torch user gets
  from torch.amp.GradScaler("cpu", init_scale=1.0): scaler.unscale_(opt) (one pass over the
  gradients that checks for inf/NaN and multiplies them in place by 1/scale),
  scaler.step(opt) (the fused step, handed found_inf: an overflowed step is skipped) and
  scaler.update(); scaler.scale(loss), which comes before backward, is outside the timing.
  The scale stays 1.0, so the gradients stay the other rows';
- tierstate_pinned, tierstate_pinned_unchecked, tierstate_nvme: opt.step() of
  tierstate_torch.AdamW with tier="pinned" (default on_nonfinite="skip_step": the gradients
  are checked for inf/NaN before any update), the same with on_nonfinite="ignore" (no check,
  as torch.optim without a GradScaler), and tier="nvme" under --path (checked);
- deepspeed_cpu_adam: opt.step() of deepspeed.ops.adam.DeepSpeedCPUAdam(adamw_mode=True)
  when deepspeed imports and its CPU Adam op builds (torch's JIT build, on first use, into
  TORCH_EXTENSIONS_DIR: `op_first_use_seconds` is how long that first use took, build
  included where it was not cached; `import_seconds` the import); otherwise the row says
  "skipped" and why;
- tierstate_pinned_int8: tierstate_torch.AdamW(state_dtype=torch.int8) in PinnedHost
  (checked): m and v in 8-bit blocks of 256, tensors under 4096 elements (min_8bit_size, as
  bitsandbytes) in fp32; bf16 params keep their fp32 master;
- bnb_adamw8bit: opt.step() of bitsandbytes.optim.AdamW8bit (its CPU kernels: blocks of 256,
  min_8bit_size 4096; bf16 params without a master) when bitsandbytes imports; otherwise
  "skipped" and why.
Every row uses lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1. `samples` are the
rounds' seconds, placement after placement.
`keeps` says what state the row keeps besides the params (for bf16 params: torch keeps
bf16 moments and no master; tierstate an fp32 master and fp32 moments; DeepSpeedCPUAdam,
with its default fp32_optimizer_states=True, fp32 moments and no master: it rounds the
update into the bf16 params), `state_bytes_per_element` its size and
`traffic_bytes_per_element` the memory traffic of one pass that does the row's work:
params (or the master), gradients and state read, params and state written, plus
tierstate's check (one more read of the gradients) or the GradScaler's unscale (a read and a
write of them): fp32 params: torch 28, with the GradScaler 36, tierstate 28 (32 checked),
DeepSpeed 28; bf16 params: torch 14, with the GradScaler 18, tierstate 28 (30 checked; the
bf16 param is written, not read), DeepSpeed 22. torch's single-tensor and foreach steps make
several passes and move more than that.
tierstate rows also give the tier's own bytes per element (`tier_bytes_read_per_element`,
`..._written_...`: NvmeFile's file I/O), the steps it skipped for inf/NaN (none expected)
and, for every row, `max_abs_diff_to_torch_fused`: how far its params ended from torch's
fused step's after the same steps (0 where the math is the same; with bf16 params the fp32
master and fp32 moments of tierstate and DeepSpeed make them differ).

Part 2, overlap_backward (rows tierstate_overlap_*, per dtype). A stack of nn.Linear(W, W)
layers (--overlap-width, bias included) with at least --overlap-elements parameters, three
copies from one initialisation; each round runs forward on a fixed (--overlap-batch, W)
input, loss = mean of the output's squares, backward and step() on each copy, in an order
rotated each round (one warm-up round first):
- tierstate_overlap_update_unchecked: tierstate_torch.AdamW(on_nonfinite="ignore") (in
  PinnedHost, as the other two) without
  overlap_backward; `update_seconds` (its median_seconds) is step() alone: "the update
  alone", the reference;
- tierstate_overlap_checked / tierstate_overlap_ignore: overlap_backward=True (each gradient
  handed to the library by a post-accumulate-grad hook as backward makes it; step() finishes
  the update) with the default check / with on_nonfinite="ignore", no clipping.
  `after_last_grad_seconds` (their median_seconds) is the time from the moment backward
  handed over its last gradient (a hook of this script registered before the optimizer's,
  so it fires just before the library's hook is called for that gradient) to the end of
  step(); `ratio_to_unchecked_update` is its median / the reference's update_seconds.
  The targets the library aims for (`target_ratio`): checked <= 1.10 (the check needs every
  gradient before the first update), ignore <= 0.10 (the update keeps up with backward).
Each of these rows also gives the medians of backward (`backward_seconds`), of the time
backward spent inside the library's hooks (`in_hooks_seconds`), of step() (`step_call_seconds`)
and of forward + backward + step (`iteration_seconds`), and whether its params equal the
reference's after the same steps (`params_equal_to_reference`).

Every line carries the torch version, the thread count (torch's intra-op threads, set to the
CPUs this process may run on), os.getloadavg() when the row's measurement began and ended
(`loadavg_start`, `loadavg_end`: the rows of one part and dtype share them) and the process's
peak resident memory so far (`peak_rss_mib`). --only NAME,... runs those rows alone (torch_fused
runs with any part 1 row, for the ratios; the reference with any overlap row).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import glob
import json
import math
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "pytorch"))
import tierstate_torch  # noqa: E402

HYPER = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
STEP_ROWS = ("torch_single_tensor", "torch_foreach", "torch_fused", "torch_fused_gradscaler", "tierstate_pinned",
             "tierstate_pinned_unchecked", "tierstate_nvme", "deepspeed_cpu_adam", "tierstate_pinned_int8",
             "bnb_adamw8bit")
OVERLAP_REFERENCE = "tierstate_overlap_update_unchecked"
OVERLAP_ROWS = (OVERLAP_REFERENCE, "tierstate_overlap_checked", "tierstate_overlap_ignore")
TARGETS = {"tierstate_overlap_checked": 1.10, "tierstate_overlap_ignore": 0.10}


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


@contextlib.contextmanager
def stdout_to_stderr():
    """Sends what is written to stdout (file descriptor 1 included: a compiler's output) to
    stderr meanwhile, so that stdout holds the JSON lines alone."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 1)
        os.close(saved)


def make_tensors(elements: int, dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A transformer-like mix (square matrices, 4x MLP matrices, small vectors): the params
    and their gradients."""
    g = torch.Generator().manual_seed(0)
    width = 1024
    sizes: list[int] = []
    while sum(sizes) < elements:
        sizes += [width * width, 4 * width * width, 4 * width * width, width, 4 * width, width]
    params, grads = [], []
    left = elements
    for n in sizes:
        n = min(n, left)
        if n == 0:
            break
        params.append(torch.randn(n, generator=g).mul_(0.02).to(dtype))
        grads.append(torch.randn(n, generator=g).mul_(1e-3).to(dtype))
        left -= n
    return params, grads


class Row:
    """One optimizer of part 1: the timed call, what runs before it (untimed), what it keeps."""

    def __init__(self, name: str, opt: Any, params: list[torch.Tensor], step: Callable[[], Any],
                 keeps: str, state_bytes: int, traffic_bytes: int, before: Callable[[], Any] = lambda: None,
                 extra: dict[str, Any] | None = None) -> None:
        self.name, self.opt, self.params, self.step, self.before = name, opt, params, step, before
        self.keeps, self.state_bytes, self.traffic_bytes = keeps, state_bytes, traffic_bytes
        self.extra = dict(extra or {})
        self.samples: list[float] = []
        self.skipped_steps = 0


_deepspeed: dict[str, Any] = {}  # the import and the op's first use, once per process


def bnb_optimizer(params: list[torch.Tensor]) -> tuple[Any, dict[str, Any]]:
    """bitsandbytes.optim.AdamW8bit over `params`, or None and why not."""
    try:
        with stdout_to_stderr():
            import bitsandbytes
            opt = bitsandbytes.optim.AdamW8bit(params, **HYPER)
    except Exception as e:  # noqa: BLE001 (not installed, or no CPU backend here)
        return None, {"skipped": f"bitsandbytes.optim.AdamW8bit: {type(e).__name__}: {e}"[:500]}
    return opt, {"bitsandbytes": bitsandbytes.__version__}


def deepspeed_optimizer(params: list[torch.Tensor]) -> tuple[Any, dict[str, Any]]:
    """DeepSpeedCPUAdam over `params`, or None and why not; with the import's and the first
    use's seconds (the first use builds the CPU Adam op when it is not cached)."""
    if "error" in _deepspeed:
        return None, {"skipped": _deepspeed["error"]}
    if "class" not in _deepspeed:
        t0 = time.perf_counter()
        try:
            with stdout_to_stderr():
                from deepspeed.ops.adam import DeepSpeedCPUAdam
                import deepspeed
        except Exception as e:  # noqa: BLE001 (not installed, or it does not import here)
            _deepspeed["error"] = f"deepspeed did not import: {type(e).__name__}: {e}"[:500]
            return None, {"skipped": _deepspeed["error"]}
        _deepspeed.update({"class": DeepSpeedCPUAdam, "version": deepspeed.__version__,
                           "import_seconds": round(time.perf_counter() - t0, 3)})
    info = {"deepspeed": _deepspeed["version"], "import_seconds": _deepspeed["import_seconds"]}
    first = "op_first_use_seconds" not in _deepspeed
    if first:
        _deepspeed["op_cached_before"] = op_cached("cpu_adam")
    t0 = time.perf_counter()
    try:
        with stdout_to_stderr():
            opt = _deepspeed["class"](params, adamw_mode=True, **HYPER)
    except Exception as e:  # noqa: BLE001 (its op did not build or load)
        why = f"DeepSpeedCPUAdam failed: {type(e).__name__}: {e}"
        if e.__cause__ is not None:
            why += f" ({type(e.__cause__).__name__}: {e.__cause__})"
        _deepspeed["error"] = why[:500]
        return None, {"skipped": _deepspeed["error"]}
    if first:
        _deepspeed["op_first_use_seconds"] = round(time.perf_counter() - t0, 3)
    info.update({"op_first_use_seconds": _deepspeed["op_first_use_seconds"],
                 "op_was_cached": _deepspeed["op_cached_before"]})
    return opt, info


def op_cached(name: str) -> bool | None:
    """Whether torch's JIT extension cache already holds a build of `name`."""
    try:
        from torch.utils.cpp_extension import _get_build_directory
        return bool(glob.glob(os.path.join(_get_build_directory(name, False), "*.so")))
    except Exception:  # noqa: BLE001 (a private helper: it may change)
        return None


def step_rows(wanted: set[str], base: list[torch.Tensor], grads: list[torch.Tensor], scratch: str,
              rotation: int) -> tuple[list[Row], list[dict]]:
    """Part 1's optimizers, made over copies of one set of params, sharing the gradients; made
    (their params copied) in the order of STEP_ROWS rotated by `rotation`, so that across
    placements each row's memory is allocated early and late."""
    dtype = base[0].dtype
    size = base[0].element_size()
    low = dtype != torch.float32

    def copies() -> list[torch.Tensor]:
        out = []
        for b, g in zip(base, grads):
            p = b.clone().requires_grad_()
            p.grad = g
            out.append(p)
        return out

    torch_keeps = f"{'bf16' if dtype == torch.bfloat16 else 'fp16' if low else 'fp32'} moments, no master"
    torch_state, torch_traffic = 2 * size, 7 * size  # p r/w, g r, m r/w, v r/w
    if low:
        # master, m and v read and written; g read; p written
        ts_keeps, ts_state, ts_traffic = "fp32 master + fp32 moments", 12, 24 + size + size
    else:
        ts_keeps, ts_state, ts_traffic = "fp32 moments (the fp32 params are the master)", 8, 28
    rows: list[Row] = []
    skipped: list[dict] = []

    def add_torch(name: str, **kw: Any) -> None:
        params = copies()
        opt = torch.optim.AdamW(params, **kw, **HYPER)
        rows.append(Row(name, opt, params, opt.step, torch_keeps, torch_state, torch_traffic))

    def add_gradscaler() -> None:
        params = copies()
        opt = torch.optim.AdamW(params, fused=True, **HYPER)
        scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
        loss = torch.zeros(())

        def scaled_step(opt=opt, scaler=scaler) -> None:
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()

        rows.append(Row("torch_fused_gradscaler", opt, params, scaled_step, torch_keeps, torch_state,
                        torch_traffic + 2 * size, before=lambda s=scaler, l=loss: s.scale(l),
                        extra={"grad_scale": 1.0}))

    def add_tierstate(name: str, checked: bool, **kw: Any) -> None:
        params = copies()
        opt = tierstate_torch.AdamW(params, **kw, **HYPER)
        rows.append(Row(name, opt, params, opt.step, ts_keeps, ts_state, ts_traffic + (size if checked else 0),
                        extra={"on_nonfinite": "skip_step" if checked else "ignore"}))

    # 8-bit m and v: 2 x (256 codes + a float scale) / 256 bytes per element.
    eight = 2 * (1 + 4 / 256)

    def add_int8() -> None:
        params = copies()
        opt = tierstate_torch.AdamW(params, state_dtype=torch.int8, **HYPER)
        # params (bf16: the fp32 master read and written, the param written), g read twice
        # (the check), m and v read and written
        p_traffic = 8 + size if low else 2 * size
        rows.append(Row("tierstate_pinned_int8", opt, params, opt.step,
                        ("fp32 master + " if low else "") + "8-bit moments (fp32 under 4096 elements)",
                        round((4 if low else 0) + eight, 3), round(p_traffic + 2 * size + 2 * eight, 3),
                        extra={"on_nonfinite": "skip_step"}))

    def add_bnb() -> None:
        params = copies()
        opt, info = bnb_optimizer(params)
        if opt is None:
            skipped.append({"optimizer": "bnb_adamw8bit", **info})
        else:  # p r/w, g r, m and v r/w
            rows.append(Row("bnb_adamw8bit", opt, params, opt.step, "8-bit moments (fp32 under 4096 elements), no master",
                            round(eight, 3), round(3 * size + 2 * eight, 3), extra=info))

    def add_deepspeed() -> None:
        params = copies()
        opt, info = deepspeed_optimizer(params)
        if opt is None:
            skipped.append({"optimizer": "deepspeed_cpu_adam", **info})
        else:
            # fp32_optimizer_states=True (its default): fp32 moments whatever the params' dtype.
            keeps = "fp32 moments, no master" + (" (the update is rounded into the params)" if low else "")
            rows.append(Row("deepspeed_cpu_adam", opt, params, opt.step, keeps, 8,
                            2 * size + size + 16, extra=info))  # p r/w, g r, fp32 m and v r/w

    makers: dict[str, Callable[[], None]] = {
        "torch_single_tensor": lambda: add_torch("torch_single_tensor", foreach=False),
        "torch_foreach": lambda: add_torch("torch_foreach", foreach=True),
        "torch_fused": lambda: add_torch("torch_fused", fused=True),
        "torch_fused_gradscaler": add_gradscaler,
        "tierstate_pinned": lambda: add_tierstate("tierstate_pinned", True, tier="pinned"),
        "tierstate_pinned_unchecked": lambda: add_tierstate("tierstate_pinned_unchecked", False, tier="pinned",
                                                            on_nonfinite="ignore"),
        "tierstate_nvme": lambda: add_tierstate("tierstate_nvme", True, tier="nvme", path=scratch),
        "deepspeed_cpu_adam": add_deepspeed,
        "tierstate_pinned_int8": add_int8,
        "bnb_adamw8bit": add_bnb,
    }
    names = [n for n in STEP_ROWS if n in wanted or n == "torch_fused"]
    k = rotation % len(names)
    for n in names[k:] + names[:k]:
        makers[n]()
    return rows, skipped


def run_step_rows(rows: list[Row], reps: int) -> None:
    for r in rows:  # warm-up: the state is made here
        r.before()
        r.step()
    for rep in range(reps):
        k = rep % len(rows)
        for r in rows[k:] + rows[:k]:
            r.before()
            t0 = time.perf_counter()
            r.step()
            r.samples.append(time.perf_counter() - t0)
            last = getattr(r.opt, "last_step", None)
            if isinstance(last, dict) and last.get("skipped"):
                r.skipped_steps += 1


def linear_stack(elements: int, width: int, dtype: torch.dtype) -> torch.nn.Sequential:
    """nn.Linear(width, width) layers, at least `elements` params, weights N(0, 1/width)
    (the activations keep their size through the stack)."""
    layers = math.ceil(elements / (width * width + width))
    g = torch.Generator().manual_seed(1)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width, device="meta") for _ in range(layers)))
    with torch.no_grad():
        for layer in model:
            layer.weight = torch.nn.Parameter(torch.randn(width, width, generator=g).mul_(width ** -0.5).to(dtype))
            layer.bias = torch.nn.Parameter(torch.randn(width, generator=g).mul_(0.02).to(dtype))
    return model


class OverlapCase:
    """One copy of the model and its optimizer, with hooks that stamp each gradient's arrival."""

    def __init__(self, name: str, model: torch.nn.Module, make: Callable[[list], Any]) -> None:
        self.name, self.model = name, model
        self.arrivals: list[float] = []
        params = list(model.parameters())
        # Registered before the optimizer's hooks, so each fires just before the library is
        # handed that gradient (post-accumulate-grad hooks run in the order they were added).
        self.handles = [p.register_post_accumulate_grad_hook(lambda _p: self.arrivals.append(time.perf_counter()))
                        for p in params]
        self.opt = make(params)
        # And these after them: the time inside the library's hooks is backward's too.
        self.returns: list[float] = []
        self.handles += [p.register_post_accumulate_grad_hook(lambda _p: self.returns.append(time.perf_counter()))
                         for p in params]
        self.after_last: list[float] = []
        self.in_hooks: list[float] = []
        self.backward: list[float] = []
        self.step_call: list[float] = []
        self.iteration: list[float] = []
        self.skipped_steps = 0

    def iterate(self, x: torch.Tensor, record: bool) -> None:
        self.opt.zero_grad()
        self.arrivals.clear()
        self.returns.clear()
        t0 = time.perf_counter()
        loss = self.model(x).float().square().mean()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        self.opt.step()
        t3 = time.perf_counter()
        if self.opt.last_step.get("skipped"):
            self.skipped_steps += 1
        if record:
            self.backward.append(t2 - t1)
            self.step_call.append(t3 - t2)
            self.iteration.append(t3 - t0)
            self.after_last.append(t3 - max(self.arrivals))
            self.in_hooks.append(sum(b - a for a, b in zip(self.arrivals, self.returns)))

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.opt.close()


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def r6(x: float) -> float:
    return round(x, 6)


def step_part(args: argparse.Namespace, wanted: set[str], name: str, scratch: str,
              emit: Callable[[dict], None]) -> None:
    """Part 1 for one dtype: for each of --placements, makes the rows (their memory allocated
    in a rotated order), times them interleaved and frees them; then prints each row over all
    placements."""
    start = loadavg()
    base, grads = make_tensors(args.elements, getattr(torch, name))
    samples: dict[str, list[float]] = {}
    ratios: dict[str, list[float]] = {}
    info: dict[str, dict[str, Any]] = {}  # what a row is, and its tier's bytes in its last step
    diffs: dict[str, float] = {}
    skipped: list[dict] = []
    for placement in range(args.placements):
        rows, skipped = step_rows(wanted, base, grads, scratch, placement)
        run_step_rows(rows, args.reps)
        fused = next(r for r in rows if r.name == "torch_fused")
        for r in rows:
            samples.setdefault(r.name, []).extend(r.samples)
            ratios.setdefault(r.name, []).append(median(r.samples) / median(fused.samples))
            diffs[r.name] = max(diffs.get(r.name, 0.0),
                                max(float((p.detach().float() - q.detach().float()).abs().max())
                                    for p, q in zip(r.params, fused.params)))
            stats = getattr(r.opt, "last_step", None)
            stats = stats if isinstance(stats, dict) else {}
            prev = info.get(r.name, {})
            info[r.name] = {"tensors": len(r.params), "keeps": r.keeps, "state_bytes": r.state_bytes,
                            "traffic_bytes": r.traffic_bytes, "extra": r.extra, "stats": stats,
                            "skipped_steps": prev.get("skipped_steps", 0) + r.skipped_steps}
        for r in rows:
            if isinstance(r.opt, tierstate_torch.AdamW):
                r.opt.close()  # the pinned memory and the scratch file now, not at garbage collection
        del rows, fused, r
        gc.collect()
    end = loadavg()
    for row_name in STEP_ROWS:
        if row_name not in wanted or row_name not in info:
            continue
        r, xs = info[row_name], samples[row_name]
        s = median(xs)
        row = {"optimizer": row_name, "param_dtype": name, "elements": args.elements,
               "tensors": r["tensors"], "placements": args.placements, "median_seconds": r6(s),
               "min_seconds": r6(min(xs)), "elements_per_second": round(args.elements / s),
               "ratio_to_torch_fused": round(median(ratios[row_name]), 3),
               "placement_ratios": [round(x, 3) for x in ratios[row_name]], "keeps": r["keeps"],
               "state_bytes_per_element": r["state_bytes"], "traffic_bytes_per_element": r["traffic_bytes"],
               "max_abs_diff_to_torch_fused": float(f"{diffs[row_name]:.3g}"), **r["extra"]}
        if row_name.startswith("tierstate"):
            stats = r["stats"]
            row["tier_bytes_read_per_element"] = round(stats.get("tier_bytes_read", 0) / args.elements, 3)
            row["tier_bytes_written_per_element"] = round(stats.get("tier_bytes_written", 0) / args.elements, 3)
            row["skipped_steps"] = r["skipped_steps"]
        row.update({"samples": [round(x, 4) for x in xs], "loadavg_start": start, "loadavg_end": end})
        emit(row)
    for sk in skipped:
        emit({**sk, "param_dtype": name, "elements": args.elements, "loadavg_start": start, "loadavg_end": end})


def overlap_part(args: argparse.Namespace, wanted: set[str], name: str, emit: Callable[[dict], None]) -> None:
    """Part 2 for one dtype: the streaming step against the plain one's update."""
    dtype = getattr(torch, name)
    start = loadavg()
    model = linear_stack(args.overlap_elements, args.overlap_width, dtype)
    makers = {
        OVERLAP_REFERENCE: lambda p: tierstate_torch.AdamW(p, on_nonfinite="ignore", **HYPER),
        "tierstate_overlap_checked": lambda p: tierstate_torch.AdamW(p, overlap_backward=True, **HYPER),
        "tierstate_overlap_ignore": lambda p: tierstate_torch.AdamW(p, overlap_backward=True,
                                                                    on_nonfinite="ignore", **HYPER),
    }
    cases = [OverlapCase(n, copy.deepcopy(model), make) for n, make in makers.items() if n in wanted]
    del model
    x = torch.randn(args.overlap_batch, args.overlap_width, generator=torch.Generator().manual_seed(2)).to(dtype)
    for c in cases:  # warm-up: the state is made here
        c.iterate(x, record=False)
    for rep in range(args.reps):
        k = rep % len(cases)
        for c in cases[k:] + cases[:k]:
            c.iterate(x, record=True)
    end = loadavg()
    ref = cases[0]  # the reference, always run
    update = median(ref.step_call)
    ref_params = list(ref.model.parameters())
    for c in cases:
        row = {"optimizer": c.name, "param_dtype": name, "elements": sum(p.numel() for p in ref_params),
               "tensors": len(ref_params), "layers": len(c.model), "width": args.overlap_width,
               "batch": args.overlap_batch, "overlap_backward": c is not ref,
               "on_nonfinite": "skip_step" if c.name == "tierstate_overlap_checked" else "ignore"}
        if c is ref:
            row.update({"median_seconds": r6(update), "update_seconds": r6(update),
                        "samples": [round(v, 4) for v in c.step_call]})
        else:
            after = median(c.after_last)
            row.update({"median_seconds": r6(after), "after_last_grad_seconds": r6(after),
                        "ratio_to_unchecked_update": round(after / update, 3), "target_ratio": TARGETS[c.name],
                        "within_target": after / update <= TARGETS[c.name],
                        "samples": [round(v, 4) for v in c.after_last],
                        "params_equal_to_reference": all(torch.equal(p, q)
                                                         for p, q in zip(c.model.parameters(), ref_params))})
        row.update({"backward_seconds": r6(median(c.backward)), "step_call_seconds": r6(median(c.step_call)),
                    "in_hooks_seconds": r6(median(c.in_hooks)),
                    "iteration_seconds": r6(median(c.iteration)), "skipped_steps": c.skipped_steps,
                    "loadavg_start": start, "loadavg_end": end})
        emit(row)
    for c in cases:
        c.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--elements", type=int, default=1 << 26, help="part 1's params per row (default 2^26)")
    ap.add_argument("--reps", type=int, default=5, help="timed rounds per placement, after one warm-up round (default 5)")
    ap.add_argument("--placements", type=int, default=3,
                    help="part 1: times every row is made anew, its memory allocated in a rotated order (default 3)")
    ap.add_argument("--path", help="the NvmeFile tier's directory (default: a fresh one under /tmp)")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="param dtypes (default float32,bfloat16)")
    ap.add_argument("--only", help="comma-separated rows to run (default: all): " + ", ".join(STEP_ROWS + OVERLAP_ROWS))
    ap.add_argument("--overlap-elements", type=int, default=1 << 26,
                    help="part 2's model has at least this many params (default 2^26)")
    ap.add_argument("--overlap-width", type=int, default=2048, help="part 2's layer width (default 2048)")
    ap.add_argument("--overlap-batch", type=int, default=256, help="part 2's input rows (default 256)")
    args = ap.parse_args()
    if args.placements < 1 or args.reps < 1:
        ap.error(f"--placements and --reps must be at least 1 (got {args.placements} and {args.reps})")
    every = STEP_ROWS + OVERLAP_ROWS
    wanted = set(every) if not args.only else {n.strip() for n in args.only.split(",") if n.strip()}
    unknown = wanted - set(every)
    if unknown:
        ap.error(f"--only: unknown rows {sorted(unknown)} (rows: {', '.join(every)})")
    if wanted & set(OVERLAP_ROWS):
        wanted.add(OVERLAP_REFERENCE)
    try:
        threads = len(os.sched_getaffinity(0))
    except AttributeError:
        threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    scratch = tempfile.TemporaryDirectory(prefix="tierstate-bench-", dir=args.path or "/tmp")
    common = {"bench": "torch_step", "torch": torch.__version__, "threads": threads,
              "cpu": platform.processor() or platform.machine(), "reps": args.reps}

    def emit(row: dict[str, Any]) -> None:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024  # (KiB on Linux)
        print(json.dumps({**common, **row, "peak_rss_mib": peak}), flush=True)

    for name in args.dtypes.split(","):
        if wanted & set(STEP_ROWS):
            step_part(args, wanted, name, scratch.name, emit)
            gc.collect()
        if wanted & set(OVERLAP_ROWS):
            overlap_part(args, wanted, name, emit)
            gc.collect()
    scratch.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
