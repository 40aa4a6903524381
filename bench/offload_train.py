# SPDX-License-Identifier: Apache-2.0
"""The proof of parameter offload: a transformer made on the meta device, its weights built
layer by layer into NvmeFile (tierstate_torch.offload_parameters), its fp32 master and Adam
moments there too (tierstate_torch.AdamW(tier="nvme", overlap_backward=True)), trained for a
few steps by a process whose peak memory is a fraction of the model's bytes.

    python bench/offload_train.py [--path DIR] [--layers 24] [--dim 1024] [--vocab 8192]
                                  [--seq 256] [--batch 4] [--steps 3] [--window 2]
                                  [--dtype bfloat16] [--on-nonfinite skip_step|ignore]
                                  [--shadow-state auto|on|off]
                                  [--no-fio] [--min-free-gb G]
                                  [--glibc-malloc-default]

The model: a learned token and position embedding, --layers pre-norm blocks (LayerNorm,
causal attention with a fused qkv Linear, its projection, LayerNorm, a 4x GELU MLP; no
biases), a final LayerNorm and a head tied to the token embedding; about 12 dim^2 params a
block (the defaults: 310.7M params, 4.35 GB of model bytes: the smallest round size at
which the target below holds, since PyPI's torch 2.11 (its CUDA build, with no GPU) is 495 MB
of resident memory once imported, before any tensor: at 197M params the peak was 945 MB
against a target of 691). Every block runs under
torch.utils.checkpoint (non-reentrant), so that activations are one block's at a time. The
batch is the same each step (random tokens, fixed seed), so the loss falls as it memorizes.

One JSON line:
- params, model_bytes: the params, and weights + fp32 master (none for fp32 params) + the two
  moments, in bytes: what DeepSpeed ZeRO-Infinity would keep on NVMe for this model;
- peak_rss_mb: the process's peak resident memory (getrusage's ru_maxrss, the import of
  torch included, over the whole run: building the model, materializing it, every step),
  rss_after_import_mb (torch's and tierstate_torch's own, before any model), and
  rss_target_met: peak_rss_mb x 4 <= model_bytes. glibc's mmap threshold is fixed at 1 MiB
  first (fixed_mmap_threshold says why; --glibc-malloc-default leaves it);
- seconds_per_step (the median of --steps steps, after one untimed first step that makes the
  state), step_seconds (each), losses (every step's, the first included);
- bytes_read_per_step, bytes_written_per_step: the process's storage I/O over the timed
  steps (/proc/self/io's read_bytes and write_bytes: what reached the disk, O_DIRECT and
  io_uring's workers included), per step;
- disk_read_gb_s, disk_write_gb_s: the disk's sequential rates in --path, measured by fio
  (io_uring, O_DIRECT, 4 MiB blocks, queue depth 16, 1 GiB; null with --no-fio or where fio is
  missing, except under CI=true, where that is an error), before the model is made;
  disk_mixed_gb_s: reads and writes at once (fio --rw=rw, its --rwmixread the steps' share of
  reads), after the steps; disk_separate_seconds (bytes read / read rate + bytes written / write
  rate), disk_mixed_seconds (all the bytes / the mixed rate), and disk_seconds, the smaller: the
  step's time if the disk alone bounded it, at the best rate fio found for these bytes (the
  first version took the separate sum alone, and the unchecked step beat it: a bound the code
  beats is no bound);
- compute_seconds: forward + backward alone: the same model and batch with its weights in
  memory, no optimizer, in a child process (so that its memory is not this one's), the median
  of 3 after a warm-up;
- step_over_bound: seconds_per_step / max(compute_seconds, disk_seconds), and
  step_target_met: at most 1.25;
- shadowed: whether the optimizer took shadow_state (--shadow-state; its automatic default takes
  it here: the state file is then twice the state's bytes, and skip_step's update overlaps
  backward instead of following it);
- materialize_seconds (offload_parameters: building every layer and writing it), window
  statistics (offload_stats), torch's version and threads, os.getloadavg() at the start and end.
The scratch folder (a fresh directory in --path, default the system's temporary folder) is
removed at the end. --min-free-gb: below that much free space in --path, the run prints
{"skipped": reason} and exits 0 (the default size needs about 10 GB with a shadowed state;
bench-long's 1B run about 28 GB).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

try:
    import tierstate_torch
except ImportError:  # (a checkout: the package's source beside this script)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "pytorch"))
    import tierstate_torch


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim, bias=False)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.ln2 = nn.LayerNorm(dim, bias=False)
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class LM(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, dim // 64) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim, bias=False)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), targets.reshape(-1))


def init(m: nn.Module) -> None:
    """GPT-2's: N(0, 0.02) weights, unit norms (offload_parameters calls it on each module)."""
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, std=0.02)
    elif isinstance(m, nn.LayerNorm):
        m.reset_parameters()


def make_model(args: argparse.Namespace, device: str) -> LM:
    with torch.device(device):
        model = LM(args.vocab, args.dim, args.layers, args.seq)
    return model.to(getattr(torch, args.dtype))


def batch(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(args.vocab, (args.batch, args.seq + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def io_bytes() -> tuple[int, int]:
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def compute_alone(args: argparse.Namespace) -> None:
    """(the child) forward + backward with the weights in memory: prints the median seconds."""
    torch.manual_seed(0)
    model = make_model(args, "cpu")
    idx, tgt = batch(args)
    times = []
    for i in range(4):
        t0 = time.perf_counter()
        model(idx, tgt).backward()
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    print(json.dumps({"compute_seconds": statistics.median(times[1:]), "compute_samples": times[1:]}))


def fio(directory: str, rw: str, *extra: str) -> tuple[float | None, float | None, str | None]:
    """fio's read and write rates (GB/s; None where the job does not do that) for one job
    (io_uring, O_DIRECT, 4 MiB blocks, queue depth 16, 1 GiB) in `directory`; or why not."""
    if shutil.which("fio") is None:
        return None, None, "fio is not installed"
    target = os.path.join(directory, "fio.data")
    try:
        out = subprocess.run(["fio", "--name=disk", f"--filename={target}", f"--rw={rw}", *extra, "--bs=4M",
                              "--iodepth=16", "--ioengine=io_uring", "--direct=1", "--size=1G",
                              "--output-format=json"], capture_output=True, text=True, check=False)
        if out.returncode != 0:
            return None, None, f"fio --rw={rw} failed: {out.stderr.strip()[-300:]}"
        job = json.loads(out.stdout)["jobs"][0]
        return (job["read"]["bw_bytes"] / 1e9 or None), (job["write"]["bw_bytes"] / 1e9 or None), None
    finally:
        if os.path.exists(target):
            os.unlink(target)


def fixed_mmap_threshold(threshold: int = 1 << 20) -> bool:
    """glibc's malloc raises its mmap threshold each time it frees a mapped block (up to 32 MiB),
    after which the blocks of freed tensors stay in its arenas, fragmented, and the process's
    RSS grows with the largest activations it ever freed rather than what is alive (here: 1.9
    GB against 1.1 at 310M params). A fixed threshold (mallopt(M_MMAP_THRESHOLD), which
    MALLOC_MMAP_THRESHOLD_=1048576 in the environment also sets) maps every block over it and
    gives it back when freed, for some time in page faults. Returns whether it was set."""
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(-3, threshold))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--path", default=tempfile.gettempdir())
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--window", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--on-nonfinite", default="skip_step", choices=("skip_step", "ignore"),
                    help="the optimizer's: skip_step (its default) keeps a step only if no gradient holds an inf "
                         "or a NaN; ignore does not look")
    ap.add_argument("--shadow-state", default="auto", choices=("auto", "on", "off"),
                    help="the optimizer's shadow_state (auto: its default, None): with it, skip_step's update "
                         "overlaps backward into a second copy of the state; off: it follows backward")
    ap.add_argument("--no-fio", action="store_true")
    ap.add_argument("--min-free-gb", type=float, default=0.0)
    ap.add_argument("--glibc-malloc-default", action="store_true",
                    help="leave glibc's dynamic mmap threshold (see fixed_mmap_threshold)")
    ap.add_argument("--compute-alone", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.dim % 64 or args.steps < 1 or args.layers < 1:
        ap.error("--dim must be a multiple of 64 (heads of 64), --steps and --layers at least 1")
    malloc_fixed = False if args.glibc_malloc_default else fixed_mmap_threshold()
    if args.compute_alone:
        compute_alone(args)
        return 0

    after_import = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    common = {"bench": "offload_train", "torch": torch.__version__, "threads": torch.get_num_threads(),
              "layers": args.layers, "dim": args.dim, "vocab": args.vocab, "seq": args.seq, "batch": args.batch,
              "dtype": args.dtype, "window": args.window, "on_nonfinite": args.on_nonfinite,
              "shadow_state": args.shadow_state,
              "malloc_mmap_threshold_fixed": malloc_fixed,
              "loadavg_start": loadavg()}
    free_gb = shutil.disk_usage(args.path).free / 1e9
    if free_gb < args.min_free_gb:
        print(json.dumps({**common, "skipped": f"{args.path} has {free_gb:.1f} GB free; this size needs "
                                               f"{args.min_free_gb:g} GB (--min-free-gb)"}), flush=True)
        return 0

    # The reference terms first, each alone on the machine.
    child = subprocess.run([sys.executable, __file__, "--compute-alone", *sys.argv[1:]], capture_output=True,
                           text=True, check=False)
    if child.returncode != 0:
        sys.stderr.write(child.stderr)
        raise SystemExit(f"offload_train: the forward/backward reference run failed (exit {child.returncode})")
    compute = json.loads(child.stdout.strip().splitlines()[-1])
    read_gb_s = write_gb_s = None
    fio_note = "--no-fio"
    with tempfile.TemporaryDirectory(prefix="tierstate-offload-train-", dir=args.path) as scratch:
        if not args.no_fio:
            _, write_gb_s, fio_note = fio(scratch, "write")
            if fio_note is None:
                read_gb_s, _, fio_note = fio(scratch, "read")
            if fio_note is not None and os.environ.get("CI") == "true":
                raise SystemExit(f"offload_train: under CI=true the disk's rate is required: {fio_note}")

        torch.manual_seed(0)
        model = make_model(args, "meta")
        params = sum(p.numel() for p in model.parameters())
        itemsize = torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
        master = 0 if args.dtype == "float32" else 4
        model_bytes = params * (itemsize + master + 8)
        for sub in ("weights", "state"):
            os.mkdir(os.path.join(scratch, sub))
        t0 = time.perf_counter()
        off = tierstate_torch.offload_parameters(model, "nvme", os.path.join(scratch, "weights"), window=args.window,
                                                 init=init)
        materialize = time.perf_counter() - t0
        opt = tierstate_torch.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, tier="nvme",
                                    path=os.path.join(scratch, "state"), overlap_backward=True,
                                    on_nonfinite=args.on_nonfinite,
                                    shadow_state={"auto": None, "on": True, "off": False}[args.shadow_state])
        shadowed = opt.composition()[0].endswith("with shadow_state")
        idx, tgt = batch(args)
        losses, times, reads, writes = [], [], [], []
        for step in range(args.steps + 1):
            r0, w0 = io_bytes()
            t0 = time.perf_counter()
            loss = model(idx, tgt)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            elapsed = time.perf_counter() - t0
            r1, w1 = io_bytes()
            losses.append(round(loss.item(), 4))
            if step > 0:
                times.append(elapsed)
                reads.append(r1 - r0)
                writes.append(w1 - w0)
        stats = off.stats()
        del opt
        off.close()
        read_b, write_b = statistics.median(reads), statistics.median(writes)
        mixed = None
        if fio_note is None and not args.no_fio:  # reads and writes at once, in the steps' proportion
            share = max(1, min(99, round(100 * read_b / (read_b + write_b))))
            mixed_r, mixed_w, note = fio(scratch, "rw", f"--rwmixread={share}")
            if note is not None:
                raise SystemExit(f"offload_train: {note}")
            mixed = (mixed_r or 0.0) + (mixed_w or 0.0)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    step_s = statistics.median(times)
    separate_s = (read_b / (read_gb_s * 1e9) + write_b / (write_gb_s * 1e9)) if read_gb_s and write_gb_s else None
    mixed_s = (read_b + write_b) / (mixed * 1e9) if mixed else None
    disk_s = min(separate_s, mixed_s) if separate_s and mixed_s else None
    bound = max(compute["compute_seconds"], disk_s or 0.0)
    row = {**common, "shadowed": shadowed, "params": params, "model_bytes": model_bytes, "peak_rss_mb": round(peak_mb, 1),
           "rss_after_import_mb": round(after_import, 1),
           "model_bytes_over_peak_rss": round(model_bytes / (peak_mb * 2**20), 2),
           "rss_target_met": peak_mb * 2**20 * 4 <= model_bytes,
           "seconds_per_step": round(step_s, 3), "step_seconds": [round(t, 3) for t in times],
           "tokens_per_s": round(args.batch * args.seq / step_s, 1), "losses": losses,
           "bytes_read_per_step": int(read_b), "bytes_written_per_step": int(write_b),
           "bytes_per_param_per_step": round((read_b + write_b) / params, 2),
           "disk_read_gb_s": read_gb_s and round(read_gb_s, 3), "disk_write_gb_s": write_gb_s and round(write_gb_s, 3),
           "disk_mixed_gb_s": mixed and round(mixed, 3), "disk_note": fio_note,
           "disk_separate_seconds": separate_s and round(separate_s, 3),
           "disk_mixed_seconds": mixed_s and round(mixed_s, 3), "disk_seconds": disk_s and round(disk_s, 3),
           "compute_seconds": round(compute["compute_seconds"], 3),
           "step_over_bound": round(step_s / bound, 3),
           "step_target_met": step_s <= 1.25 * bound, "materialize_seconds": round(materialize, 2),
           "offload_stats": stats, "loadavg_end": loadavg()}
    if not all(math.isfinite(x) for x in losses):
        row["error"] = "a loss is not finite"
    print(json.dumps(row), flush=True)
    return 0 if "error" not in row else 1


if __name__ == "__main__":
    sys.exit(main())
