# SPDX-License-Identifier: Apache-2.0
"""Training steps across ranks on CPU (gloo): FSDP2 with tierstate_torch.AdamW, and DDP with
tierstate_torch.ShardedAdamW, each with the state in PinnedHost or NvmeFile. Run it under
torchrun at each world size to compare:

    torchrun --standalone --nproc-per-node N bench/dist_step.py [--mode fsdp|ddp]
             [--tier pinned|nvme] [--path DIR] [--layers L] [--width W] [--steps S]

An MLP of --layers square layers of --width (fp32), a batch of 8 rows per rank. Rank 0
prints one JSON line: the median step time (forward, backward with the reduction, the
optimizer step and, for ddp, the params' all-gather), the optimizer step's median, and per
rank the state's elements and bytes, and the bytes moved to and from the tier per step, as
the optimizer's last_step reports them; the load average at the start. Each rank runs one
optimizer thread and OMP_NUM_THREADS=1 (set it).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

if os.environ.get("TIERSTATE_TORCH_TEST_INSTALLED") != "1":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "pytorch"))
import tierstate_torch  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("fsdp", "ddp"), default="fsdp")
    ap.add_argument("--tier", choices=("pinned", "nvme"), default="pinned")
    ap.add_argument("--path", default=tempfile.gettempdir())
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8)
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    load = os.getloadavg()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(a.width, a.width), nn.GELU()) for _ in range(a.layers)])
    path = None
    if a.tier == "nvme":
        parent = os.path.join(a.path, f"tierstate-dist-step-{os.getppid()}")
        os.makedirs(parent, exist_ok=True)
        path = os.path.join(parent, "rank{rank}")
    if a.mode == "fsdp":
        from torch.distributed.fsdp import fully_shard
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        net = model
        opt = tierstate_torch.AdamW(model.parameters(), lr=1e-4, tier=a.tier, path=path, threads=1)
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP
        net = DDP(model)
        opt = tierstate_torch.ShardedAdamW(model.parameters(), lr=1e-4, tier=a.tier, path=path, threads=1)
    g = torch.Generator().manual_seed(rank)
    steps, opt_steps, moved = [], [], []
    for i in range(a.steps + 1):
        x = torch.randn(8, a.width, generator=g)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        net(x).pow(2).mean().backward()
        opt.step()
        if i > 0:  # (the first makes the state)
            steps.append(time.perf_counter() - t0)
            opt_steps.append(opt.last_step["total_seconds"])
            moved.append(opt.last_step["tier_bytes_read"] + opt.last_step["tier_bytes_written"])
    state = sum(s.numel() for s in _states(opt))
    mine = {"rank": rank, "state_elements": state, "tier_bytes_per_step": int(statistics.median(moved)),
            "step_seconds": round(statistics.median(steps), 4), "optimizer_seconds": round(statistics.median(opt_steps), 4)}
    every = [None] * world
    dist.all_gather_object(every, mine)
    total = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(json.dumps({"bench": "dist_step", "mode": a.mode, "tier": a.tier, "world": world, "params": total,
                          "threads_per_rank": 1, "loadavg_start": [round(x, 2) for x in load],
                          "step_seconds": max(r["step_seconds"] for r in every),
                          "state_fraction_per_rank": [round(r["state_elements"] / total, 4) for r in every],
                          "ranks": every}), flush=True)
    opt.close()
    dist.barrier()
    if path is not None and rank == 0:
        os.rmdir(os.path.dirname(path))
    dist.destroy_process_group()
    return 0


def _states(opt):
    """Each local tensor's slot of exp_avg: its elements are the rank's share of the state."""
    for i, p in enumerate(opt._params()):
        if opt._where[i] is not None:
            key, _ = opt._where[i]
            yield opt._shards[key].get_state(f"p{i}", "exp_avg")


if __name__ == "__main__":
    sys.exit(main())
