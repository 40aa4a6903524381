# SPDX-License-Identifier: Apache-2.0
"""One optimizer step on CPU parameters: torch.optim.AdamW (its single-tensor, foreach and
fused implementations) against tierstate_torch.AdamW with the state in PinnedHost (with its
default inf/NaN check, and without it, as torch does) and in NvmeFile, side by side in one
run, on the same tensors and gradients. For bf16 params torch keeps bf16 moments and no
master (14 bytes of traffic per element); tierstate an fp32 master and fp32 moments (30). Prints one JSON line
per optimizer and dtype: the median seconds per step over --reps steps (after one warm-up
step that makes the state), and the ratio to torch's fused AdamW measured in the same run.

    python bench/torch_step.py [--elements N] [--reps R] [--path DIR] [--dtypes float32,bfloat16]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "pytorch"))
import tierstate_torch  # noqa: E402


def tensors(elements: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """A transformer-like mix: square matrices, 4x MLP matrices, and small vectors."""
    g = torch.Generator().manual_seed(0)
    width = 1024
    sizes = []
    while sum(sizes) < elements:
        sizes += [width * width, 4 * width * width, 4 * width * width, width, 4 * width, width]
    out = []
    left = elements
    for n in sizes:
        n = min(n, left)
        if n == 0:
            break
        p = torch.randn(n, generator=g).mul_(0.02).to(dtype).requires_grad_()
        p.grad = torch.randn(n, generator=g).mul_(1e-3).to(dtype)
        out.append(p)
        left -= n
    return out


def measure(make, params: list[torch.Tensor], reps: int) -> float:
    opt = make(params)
    opt.step()  # the state is made here
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    del opt
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--elements", type=int, default=64 * 1024 * 1024)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--path", help="the NvmeFile tier's directory (default: a fresh one under /tmp)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    args = ap.parse_args()
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    scratch = tempfile.TemporaryDirectory(prefix="tierstate-bench-", dir=args.path or "/tmp")
    hyper = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    candidates = {
        "torch_single_tensor": lambda p: torch.optim.AdamW(p, foreach=False, **hyper),
        "torch_foreach": lambda p: torch.optim.AdamW(p, foreach=True, **hyper),
        "torch_fused": lambda p: torch.optim.AdamW(p, fused=True, **hyper),
        "tierstate_pinned": lambda p: tierstate_torch.AdamW(p, tier="pinned", **hyper),
        # torch's AdamW does not look for inf/NaN: the same work, without the extra read
        "tierstate_pinned_unchecked": lambda p: tierstate_torch.AdamW(p, tier="pinned", on_nonfinite="ignore", **hyper),
        "tierstate_nvme": lambda p: tierstate_torch.AdamW(p, tier="nvme", path=scratch.name, **hyper),
    }
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        seconds = {}
        count = 0
        for label, make in candidates.items():
            params = tensors(args.elements, dtype)
            count = len(params)
            seconds[label] = measure(make, params, args.reps)
            del params
        for label, s in seconds.items():
            print(json.dumps({
                "bench": "torch_step", "optimizer": label, "param_dtype": name, "elements": args.elements,
                "tensors": count,
                "median_seconds": round(s, 6), "elements_per_second": round(args.elements / s),
                "ratio_to_torch_fused": round(s / seconds["torch_fused"], 3), "reps": args.reps,
                "threads": threads, "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
            }), flush=True)
    scratch.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
