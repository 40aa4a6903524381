# SPDX-License-Identifier: Apache-2.0
"""tierstate_torch across ranks: test_parity's transformer trained by two ranks (gloo, CPU)
with FSDP2's fully_shard, each rank stepping its own shards with tierstate_torch.AdamW, every
step's loss (the ranks' mean) within test_parity's 1e-4 relative of one process's
torch.optim.AdamW on the whole batch, and the final params (gathered) within its bound:
- the state in PinnedHost and in NvmeFile (a directory per rank, from a "{rank}" template);
- param groups and an LR schedule; clipping with max_grad_norm (the global norm, the same
  bits on every rank, against torch's clip_grad_norm_ on the whole model);
- overlap_backward (the hooks fire on FSDP2's reduce-scattered shards; on NVMe the default
  check is shadowed and agrees across ranks after the update);
- GradScaler with an overflow planted on one rank only: both skip that step, both scales
  back off alike;
- FSDP2's MixedPrecisionPolicy (bf16 compute, fp32 sharded params: no master): against
  torch.optim.AdamW under the same FSDP2 setup;
- a NaN on one rank with on_nonfinite="skip_step" and no scaler: both skip;
- a layer with fewer rows than ranks (an empty shard on rank 1), clipped;
- each rank's state_dict() saved and loaded at the same world size: the uninterrupted run's bits;
- DDP with ShardedAdamW (partition=True: ZeRO-1), pinned and NVMe, clipped, a NaN in one
  rank's slice;
- refusals: a plain param among DTensors, Shard(1) placements, a rank with no rows;
  partition= with overlap_backward, delayed_update, Adafactor or two state formats; another
  rank's state_dict.

Run: torchrun --nproc-per-node 2 tests/pytorch/test_distributed.py (tests/run-all.sh's
pytorch stage; OMP_NUM_THREADS=1). Each rank prints its checks; rank 0 the summary. A rank
that fails exits 1, and torchrun then stops the other. ONLY=case_name runs one case.
"""
from __future__ import annotations

import copy
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import test_parity as tp  # noqa: E402  (its model, data and tolerance; it puts the package on the path)
import tierstate_torch  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402

RANK = WORLD = 0


def shard_model(model: nn.Module, mp: MixedPrecisionPolicy | None = None) -> nn.Module:
    kw = {"mp_policy": mp} if mp is not None else {}
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


def my_part(x: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a batch (data parallel: equal parts, so the mean of the ranks'
    mean losses is the whole batch's)."""
    return x.chunk(WORLD)[RANK]


def mean_over_ranks(v: float) -> float:
    t = torch.tensor([v], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / WORLD


def full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def reference(steps: int, clip: float | None = None, sched: bool = True):
    """One process, torch.optim.AdamW, the whole batch."""
    model = tp.make_model()
    opt = torch.optim.AdamW(tp.groups(model), lr=tp.LR, foreach=False)
    s = tp.schedule(opt) if sched else None
    losses, norms = [], []
    for x, y in tp.batches(steps):
        opt.zero_grad(set_to_none=True)
        loss = tp.loss_of(model, x, y)
        loss.backward()
        if clip:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
        if s:
            s.step()
        losses.append(loss.item())
    return losses, model, norms


NOW = -1  # the step train_sharded is in


def plant(model: nn.Module, at: int, bad: float) -> None:
    """At step `at`, once FSDP2 has reduce-scattered the gradients, rank 1 alone finds `bad`
    in its shard of head.weight's (an inf or NaN in the loss would reach every rank's shard
    through the reduction, and test nothing). Call it before the optimizer is made: its hook
    then runs before overlap_backward's."""
    def hook(p: torch.Tensor) -> None:
        if NOW == at and RANK == 1:
            p.grad.to_local().view(-1)[0] = bad
    model.head.weight.register_post_accumulate_grad_hook(hook)


def train_sharded(model, opt, steps, sched=None, scaler=None, poisoned: int | None = None):
    """FSDP2's loop: each rank its part of each batch. Step `poisoned` (see plant) is
    recorded with loss 0, as test_parity's train_scaled records its overflowed step."""
    global NOW
    losses, results = [], []
    for i, (x, y) in enumerate(tp.batches(steps)):
        NOW = i
        opt.zero_grad(set_to_none=True)
        loss = tp.loss_of(model, my_part(x), my_part(y))
        if scaler:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        if sched:
            sched.step()
        results.append(dict(getattr(opt, "last_step", {})))
        losses.append(mean_over_ranks(loss.item()) if i != poisoned else 0.0)
    NOW = -1
    return losses, results


def assert_parity(what: str, ref_losses, losses, ref_model, model, lr=tp.LR, tol: float = 1e-4):
    assert len(ref_losses) == len(losses)
    for i, (a, b) in enumerate(zip(ref_losses, losses)):
        assert abs(a - b) <= tol * abs(a), f"{what}: step {i + 1}: loss {b} vs the reference's {a}"
    for (name, p), q in zip(ref_model.named_parameters(), model.parameters()):
        p, q = full(p.detach()).float(), full(q.detach()).float()
        bound = tol * (p.abs() + lr)
        excess = ((p - q).abs() - bound).max().item()
        assert excess <= 0.0, f"{what}: parameter {name} differs beyond {tol}*(|p|+lr)"


def scratch(tag: str) -> str:
    """A directory for this case, "{rank}" in it: each rank's own."""
    root = os.environ.get("TIERSTATE_TEST_DIR", tempfile.gettempdir())
    parent = os.path.join(root, f"tierstate-dist-{os.getppid()}-{tag}")  # (torchrun: one parent)
    os.makedirs(parent, exist_ok=True)
    return os.path.join(parent, "rank{rank}")


def cleanup(path: str) -> None:
    """After close(): the rank's directory the optimizer made is gone; then the case's."""
    mine = path.format(rank=RANK)
    assert not os.path.exists(mine), f"{mine}: the rank's directory the optimizer made, left behind"
    dist.barrier()
    if RANK == 0:
        shutil.rmtree(os.path.dirname(mine), ignore_errors=True)


def case_tiers(ref):
    for tier in ("pinned", "nvme"):
        model = shard_model(tp.make_model())
        path = scratch(tier) if tier == "nvme" else None
        opt = tierstate_torch.AdamW(tp.groups(model), lr=tp.LR, tier=tier, path=path, chunk_elements=2048)
        losses, results = train_sharded(model, opt, tp.STEPS, sched=tp.schedule(opt))
        assert_parity(f"FSDP2 {tier}", ref[0], losses, ref[1], model)
        if path is not None:
            mine = path.format(rank=RANK)
            assert os.path.isdir(mine), f"{mine}: the rank's directory"
            opt.close()
            cleanup(path)
        state = sum(p.to_local().numel() for p in model.parameters())
        total = sum(p.numel() for p in model.parameters())
        print(f"rank {RANK}: FSDP2 {tier}: 50 steps within 1e-4; state of {state} of {total} elements "
              f"({state / total:.3f})", flush=True)


def case_clip():
    clip = 0.05
    for overlap in (False, True):  # the norm is one tierstate process's, to the bit
        model = shard_model(tp.make_model())
        opt = tierstate_torch.AdamW(model.parameters(), lr=tp.LR, max_grad_norm=clip, overlap_backward=overlap)
        x, y = tp.batches(1)[0]
        tp.loss_of(model, my_part(x), my_part(y)).backward()
        opt.step()
        grads = [p.grad.full_tensor() for p in model.parameters()]
        whole = [p.full_tensor().detach().clone().requires_grad_() for p in model.parameters()]
        one = tierstate_torch.AdamW(whole, lr=tp.LR, max_grad_norm=clip)
        for p, g in zip(whole, grads):
            p.grad = g
        one.step()
        assert opt.last_step["grad_norm"] == one.last_step["grad_norm"], \
            (opt.last_step["grad_norm"], one.last_step["grad_norm"])
        one.close()
        opt.close()
    ref_losses, ref_model, ref_norms = reference(tp.STEPS, clip=clip)
    for overlap in (False, True):
        model = shard_model(tp.make_model())
        opt = tierstate_torch.AdamW(tp.groups(model), lr=tp.LR, max_grad_norm=clip, overlap_backward=overlap)
        losses, results = train_sharded(model, opt, tp.STEPS, sched=tp.schedule(opt))
        assert_parity(f"FSDP2 clip overlap={overlap}", ref_losses, losses, ref_model, model)
        norms = [r["grad_norm"] for r in results]
        every = [None] * WORLD
        dist.all_gather_object(every, norms)
        assert all(n == norms for n in every), "the ranks' gradient norms differ"
        for i, (a, b) in enumerate(zip(ref_norms, norms)):
            assert abs(a - b) <= 1e-4 * a, f"step {i + 1}: norm {b} vs clip_grad_norm_'s {a}"
        assert min(ref_norms) > clip, "the test clips every step"
        print(f"rank {RANK}: FSDP2 max_grad_norm overlap={overlap}: norms the same bits on both ranks and as one "
              f"tierstate process's over the gathered gradients, within 1e-4 of clip_grad_norm_'s", flush=True)


def case_overlap_nvme(ref):
    """fp32 params (no master: the check waits for backward's end) against the reference;
    then bf16 params with an fp32 master, where the default check is shadowed: with a NaN on
    rank 1 only at step 4, the same bits as plain steps in pinned memory."""
    model = shard_model(tp.make_model())
    path = scratch("overlap")
    opt = tierstate_torch.AdamW(tp.groups(model), lr=tp.LR, tier="nvme", path=path, overlap_backward=True,
                                chunk_elements=2048)
    losses, _ = train_sharded(model, opt, tp.STEPS, sched=tp.schedule(opt))
    assert_parity("FSDP2 overlap nvme", ref[0], losses, ref[1], model)
    opt.close()
    cleanup(path)
    runs = []
    for tier, overlap in (("pinned", False), ("nvme", True)):
        model = shard_model(tp.make_model(torch.bfloat16))
        plant(model, 3, float("nan"))
        path = scratch("shadow") if tier == "nvme" else None
        opt = tierstate_torch.AdamW(tp.groups(model), lr=tp.LR, tier=tier, path=path, overlap_backward=overlap,
                                    chunk_elements=2048)
        assert opt.composition()[0].endswith(" with shadow_state") == overlap, opt.composition()
        losses, results = train_sharded(model, opt, 12, sched=tp.schedule(opt), poisoned=3)
        assert results[3]["skipped"] and not any(r["skipped"] for i, r in enumerate(results) if i != 3), results
        runs.append((losses, [full(p.detach()).clone() for p in model.parameters()], opt.step_count()))
        if path is not None:
            opt.close()
            cleanup(path)
    assert runs[0][0] == runs[1][0], "the losses of plain and shadowed streaming steps differ"
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1])), "the params differ"
    assert runs[0][2] == runs[1][2] == 11
    print(f"rank {RANK}: FSDP2 overlap_backward on NVMe: fp32 within 1e-4; bf16 shadowed, a NaN on rank 1 at "
          "step 4: both skip, the bits of plain steps", flush=True)


def reference_scaled(steps: int, overflow_at: int):
    model = tp.make_model()
    opt = torch.optim.AdamW(tp.groups(model), lr=tp.LR, foreach=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    losses, _ = tp.train_scaled(model, opt, scaler, tp.batches(steps), overflow_at=overflow_at)
    return losses, model, scaler.get_scale()


def reference_sharded_skipping(steps: int, skip_at: int) -> nn.Module:
    """torch.optim.AdamW on the same FSDP2 model, with the same gradients, skipping step
    `skip_at` on every rank (what a GradScaler whose overflow is agreed does): the params'
    reference. Over 50 steps the one-process reference's params differ from FSDP2's own
    AdamW's by more than 1e-4 (1.7e-4 of |p| + lr in blocks.0.mlp.2.weight): the
    reduce-scatter sums half-batch gradients, which round otherwise than the whole batch's,
    and Adam amplifies that where a gradient is near zero. The losses are still held to the
    one-process reference's."""
    model = shard_model(tp.make_model())
    opt = torch.optim.AdamW(tp.groups(model), lr=tp.LR, foreach=False)
    for i, (x, y) in enumerate(tp.batches(steps)):
        opt.zero_grad(set_to_none=True)
        tp.loss_of(model, my_part(x), my_part(y)).backward()
        if i != skip_at:
            opt.step()
    return model


def case_scaler_one_rank_overflows():
    at = 5
    ref_losses, _, ref_scale = reference_scaled(tp.STEPS, at)
    ref_model = reference_sharded_skipping(tp.STEPS, at)
    for overlap, tier in ((False, "pinned"), (True, "pinned"), (True, "nvme")):
        model = shard_model(tp.make_model())
        plant(model, at, float("inf"))
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        path = scratch(f"scaled-{tier}") if tier == "nvme" else None
        opt = tierstate_torch.AdamW(tp.groups(model), lr=tp.LR, tier=tier, path=path, overlap_backward=overlap,
                                    grad_scaler=scaler)
        losses, results = train_sharded(model, opt, tp.STEPS, scaler=scaler, poisoned=at)
        assert_parity(f"FSDP2 GradScaler overlap={overlap} {tier}", ref_losses, losses, ref_model, model)
        scales = [None] * WORLD
        dist.all_gather_object(scales, scaler.get_scale())
        assert scales == [ref_scale] * WORLD, f"scales {scales} vs the reference's {ref_scale}"
        assert opt.step_count() == tp.STEPS - 1, opt.step_count()
        if path is not None:
            opt.close()
            cleanup(path)
        print(f"rank {RANK}: FSDP2 GradScaler, overflow on rank 1 only, overlap={overlap} {tier}: both skipped "
              f"step {at + 1}, scale {scales[RANK]} on both", flush=True)


def case_nan_one_rank():
    for overlap in (False, True):
        model = shard_model(tp.make_model())
        plant(model, 0, float("nan"))
        before = [full(p.detach()).clone() for p in model.parameters()]
        opt = tierstate_torch.AdamW(model.parameters(), lr=tp.LR, overlap_backward=overlap)
        _, results = train_sharded(model, opt, 1, poisoned=0)
        assert results[0]["skipped"], f"rank {RANK} stepped while rank 1 found a NaN: {results[0]}"
        after = [full(p.detach()) for p in model.parameters()]
        assert all(torch.equal(a, b) for a, b in zip(before, after)), "a param changed in a skipped step"
        assert opt.step_count() == 0
        print(f"rank {RANK}: a NaN on rank 1 only, overlap={overlap}: skipped on both", flush=True)


def case_mixed_precision():
    """MixedPrecisionPolicy: bf16 forward and backward, fp32 reduce-scatter and fp32 sharded
    params (no master). Against torch.optim.AdamW under the same FSDP2 setup. bf16 compute
    turns the last-bit differences of two correct fp32 updates into bf16 rounding flips that
    grow with the steps (the first steps agree to the bit; after 50, 3.7e-4 of the loss), so
    the bound is bf16's: each step's loss within 2e-3 relative (bf16's half ulp is 3.9e-3),
    each tensor of 1024 elements or more within 5e-3 relative in L2 (seen: 9.6e-4) and the
    smaller within 3e-2 (seen: 3.1e-3 for the positions, 7.3e-3 for a bias of 32, whose
    small gradients Adam divides by their own size)."""
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    runs = []
    for make in (lambda m: torch.optim.AdamW(tp.groups(m), lr=tp.LR, foreach=False),
                 lambda m: tierstate_torch.AdamW(tp.groups(m), lr=tp.LR)):
        model = shard_model(tp.make_model(), mp)
        opt = make(model)
        losses, _ = train_sharded(model, opt, tp.STEPS, sched=tp.schedule(opt))
        runs.append((losses, [full(p.detach()) for p in model.parameters()], opt))
    (ref_losses, ref_params, _), (losses, params, opt) = runs
    assert opt.composition()[0].startswith("OffloadedOptimizer<adamw, fp32/fp32/fp32/fp32,"), opt.composition()
    worst = max(abs(a - b) / abs(a) for a, b in zip(ref_losses, losses))
    far = [((p - q).norm() / p.norm()).item() for p, q in zip(ref_params, params)]
    large = max(f for f, p in zip(far, ref_params) if p.numel() >= 1024)
    assert worst <= 2e-3, f"mixed precision: a loss {worst:.2e} relative from torch's"
    assert large <= 5e-3, f"mixed precision: a matrix {large:.2e} relative (L2) from torch's"
    assert max(far) <= 3e-2, f"mixed precision: a vector {max(far):.2e} relative (L2) from torch's"
    print(f"rank {RANK}: FSDP2 MixedPrecisionPolicy(bf16 compute, fp32 shards, no master): losses within "
          f"{worst:.1e}, matrices within {large:.1e} and vectors {max(far):.1e} (L2) of torch.optim.AdamW under "
          "FSDP2", flush=True)


def case_rows_fewer_than_ranks():
    """A layer of one output row (its weight (1, 16), its bias (1,)): FSDP2 gives rank 1 no
    rows of it, an empty shard. Clipped, against torch.optim.AdamW under the same FSDP2 setup
    with clip_grad_norm_ (which FSDP2 computes across ranks)."""
    runs = []
    for ours in (False, True):
        torch.manual_seed(7)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
        fully_shard(model)
        opt = (tierstate_torch.AdamW(model.parameters(), lr=1e-2, max_grad_norm=0.1) if ours else
               torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False))
        g = torch.Generator().manual_seed(3)
        norms = []
        for _ in range(10):
            x = torch.randn(8, 8, generator=g)
            loss = (model(my_part(x)) - my_part(x.sum(1, keepdim=True))).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            if not ours:
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1).full_tensor().item())
            opt.step()
            if ours:
                norms.append(opt.last_step["grad_norm"])
        runs.append(([full(p.detach()) for p in model.parameters()], norms))
    assert model[2].weight.to_local().numel() == (16 if RANK == 0 else 0)
    for a, b in zip(runs[0][0], runs[1][0]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    for a, b in zip(runs[0][1], runs[1][1]):
        assert abs(a - b) <= 1e-5 * a, (a, b)
    print(f"rank {RANK}: a layer of one row (rank 1's shard of it empty), clipped: within 1e-5 of torch's", flush=True)


def case_resume(ref):
    """Each rank's state_dict() (its shards' checkpoints) saved with torch.save after 25 steps,
    then loaded into a new model and optimizer of the same world size: the next 25 steps are
    the uninterrupted run's, bit for bit; and within 1e-4 of the reference."""
    half = tp.STEPS // 2
    root = os.path.join(os.environ.get("TIERSTATE_TEST_DIR", tempfile.gettempdir()),
                        f"tierstate-dist-{os.getppid()}-resume")
    os.makedirs(root, exist_ok=True)
    runs = []
    for resumed in (False, True):
        model = shard_model(tp.make_model())
        opt = tierstate_torch.AdamW(tp.groups(model), lr=tp.LR)
        sched = tp.schedule(opt)
        data = tp.batches(tp.STEPS)
        losses = []
        for i, (x, y) in enumerate(data):
            if resumed and i == half:
                where = os.path.join(root, f"rank{RANK}.pt")
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, where)
                opt.close()
                model = shard_model(tp.make_model())
                opt = tierstate_torch.AdamW(tp.groups(model), lr=tp.LR)
                sched = tp.schedule(opt)
                saved = torch.load(where, weights_only=False)
                model.load_state_dict(saved["model"])
                opt.load_state_dict(saved["opt"])
                sched.load_state_dict(saved["sched"])
            opt.zero_grad(set_to_none=True)
            loss = tp.loss_of(model, my_part(x), my_part(y))
            loss.backward()
            opt.step()
            sched.step()
            losses.append(mean_over_ranks(loss.item()))
        runs.append((losses, [p.to_local().clone() for p in model.parameters()]))
    assert runs[0][0] == runs[1][0], "the resumed run's losses differ"
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1])), "the resumed run's params differ"
    assert_parity("FSDP2 resumed", ref[0], runs[1][0], ref[1], model)
    dist.barrier()
    if RANK == 0:
        shutil.rmtree(root, ignore_errors=True)
    print(f"rank {RANK}: FSDP2 saved at step {half} and resumed (same world size): the uninterrupted run's bits",
          flush=True)


def train_segment(net, opt, sched, batches, split: bool) -> list[float]:
    """Steps over `batches`: each rank its part of each batch (split: FSDP2, DDP), or one
    process's whole batch (every rank alike, no collective)."""
    losses = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        loss = tp.loss_of(net, my_part(x) if split else x, my_part(y) if split else y)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(mean_over_ranks(loss.item()) if split else loss.item())
    return losses


def case_torch_state_across_world_sizes(ref=None):
    """A torch state_dict across world sizes: ShardedAdamW's torch_state_dict() gathers every
    rank's slices into torch.optim.AdamW's whole state on every rank; torch.optim.AdamW and one
    process's tierstate optimizer load it and go on (2 ranks -> 1 process), and ShardedAdamW
    loads one process's (1 process -> 2 ranks). Each resumed run's losses are within 1e-4 of
    the uninterrupted reference's; its params within 1e-4 of torch.optim.AdamW's resumed from
    the same state."""
    ref = ref or reference(tp.STEPS)  # (ONLY= runs a case alone)
    from torch.nn.parallel import DistributedDataParallel as DDP
    half = tp.STEPS // 2
    data = tp.batches(tp.STEPS)

    def torch_resumed(state_dict, model_state, sched_state):
        t_model = tp.make_model()
        t_model.load_state_dict(model_state)
        t_opt = torch.optim.AdamW(tp.groups(t_model), lr=tp.LR, foreach=False)
        t_sched = tp.schedule(t_opt)
        t_opt.load_state_dict(copy.deepcopy(state_dict))
        t_sched.load_state_dict(sched_state)
        train_segment(t_model, t_opt, t_sched, data[half:], split=False)
        return t_model

    def tierstate_resumed(state_dict, model_state, sched_state):
        """One tierstate process going on from a whole torch state_dict: its model, losses."""
        one_model = tp.make_model()
        one_model.load_state_dict(model_state)
        one = tierstate_torch.AdamW(tp.groups(one_model), lr=tp.LR)
        one_sched = tp.schedule(one)
        one.load_state_dict(state_dict)
        one_sched.load_state_dict(sched_state)
        assert one.step_count() == half, one.step_count()
        return one_model, train_segment(one_model, one, one_sched, data[half:], split=False)

    # 2 ranks -> 1 process
    model = tp.make_model()
    opt = tierstate_torch.ShardedAdamW(tp.groups(model), lr=tp.LR)
    sched = tp.schedule(opt)
    first = train_segment(DDP(model), opt, sched, data[:half], split=True)
    sd = opt.torch_state_dict()
    assert sorted(sd["state"]) == list(range(len(list(model.parameters())))), sorted(sd["state"])
    for i, p in enumerate(p for g in opt.param_groups for p in g["params"]):  # (the state's order)
        s = sd["state"][i]
        assert s["exp_avg"].shape == p.shape and s["exp_avg_sq"].shape == p.shape and s["step"].item() == half, i
    every = [None] * WORLD
    dist.all_gather_object(every, {i: (s["exp_avg"].sum().item(), s["exp_avg_sq"].sum().item())
                                   for i, s in sd["state"].items()})
    assert all(e == every[0] for e in every), "the ranks' gathered states differ"
    t_model = torch_resumed(sd, model.state_dict(), sched.state_dict())
    one_model, rest = tierstate_resumed(sd, model.state_dict(), sched.state_dict())
    what = "DDP ShardedAdamW, 2 ranks -> 1 process (torch_state_dict)"
    assert_parity(what, ref[0], first + rest, t_model, one_model)
    print(f"rank {RANK}: {what}: torch.optim.AdamW and one tierstate process go on from it, within 1e-4", flush=True)

    # 1 process -> 2 ranks
    one_model = tp.make_model()
    one = tierstate_torch.AdamW(tp.groups(one_model), lr=tp.LR)
    one_sched = tp.schedule(one)
    first = train_segment(one_model, one, one_sched, data[:half], split=False)
    sd = one.torch_state_dict()
    t_model = torch_resumed(sd, one_model.state_dict(), one_sched.state_dict())
    model = tp.make_model()
    model.load_state_dict(one_model.state_dict())
    net = DDP(model)
    opt = tierstate_torch.ShardedAdamW(tp.groups(model), lr=tp.LR)
    sched = tp.schedule(opt)
    opt.load_state_dict(sd)
    sched.load_state_dict(one_sched.state_dict())
    rest = train_segment(net, opt, sched, data[half:], split=True)
    what = "one process -> DDP ShardedAdamW at 2 ranks (torch_state_dict)"
    assert_parity(what, ref[0], first + rest, t_model, model)
    print(f"rank {RANK}: {what}: within 1e-4", flush=True)

    # FSDP2: full=True gathers whole tensors (2 ranks -> 1 process), and FSDP2 loads whole ones
    model = shard_model(tp.make_model())
    opt = tierstate_torch.AdamW(tp.groups(model), lr=tp.LR)
    sched = tp.schedule(opt)
    first = train_segment(model, opt, sched, data[:half], split=True)
    sd = opt.torch_state_dict(full=True)
    whole_model = {k: full(v) for k, v in model.state_dict().items()}
    assert not any(hasattr(v, "full_tensor") for s in sd["state"].values() for v in s.values()), "a DTensor"
    t_model = torch_resumed(sd, whole_model, sched.state_dict())
    one_model, rest = tierstate_resumed(sd, whole_model, sched.state_dict())
    what = "FSDP2, 2 ranks -> 1 process (torch_state_dict(full=True))"
    assert_parity(what, ref[0], first + rest, t_model, one_model)
    model2 = shard_model(tp.make_model())
    model2.load_state_dict(model.state_dict())
    opt2 = tierstate_torch.AdamW(tp.groups(model2), lr=tp.LR)
    sched2 = tp.schedule(opt2)
    opt2.load_state_dict(sd)  # (whole tensors: each rank takes its shard's part)
    sched2.load_state_dict(sched.state_dict())
    rest2 = train_segment(model2, opt2, sched2, data[half:], split=True)
    assert_parity(what + ", loaded back into FSDP2", ref[0], first + rest2, t_model, model2)
    print(f"rank {RANK}: {what}, and back into FSDP2 from whole tensors: within 1e-4", flush=True)


def case_dcp(ref=None):
    """torch.distributed.checkpoint, as FSDP2's users save: get_optimizer_state_dict of an
    optimizer with state_dict_format="torch" (a trained one is not stepped by it), dcp.save at
    2 ranks, then dcp.load and set_optimizer_state_dict into a new FSDP2 model and optimizer
    at 2 ranks, and into one process's (rank 0 alone, no_dist: resharded 2 -> 1). Each goes on
    within 1e-4 of the uninterrupted reference's losses and of torch.optim.AdamW resumed
    through the same checkpoint."""
    ref = ref or reference(tp.STEPS)  # (ONLY= runs a case alone)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)
    half = tp.STEPS // 2
    data = tp.batches(tp.STEPS)
    root = os.path.join(os.environ.get("TIERSTATE_TEST_DIR", tempfile.gettempdir()),
                        f"tierstate-dist-{os.getppid()}-dcp")
    for tier in ("pinned", "nvme"):
        model = shard_model(tp.make_model())
        path = scratch("dcp-state") if tier == "nvme" else None
        opt = tierstate_torch.AdamW(tp.groups(model), lr=tp.LR, tier=tier, path=path, state_dict_format="torch")
        sched = tp.schedule(opt)
        first = train_segment(model, opt, sched, data[:half], split=True)
        before = opt.step_count()
        osd = get_optimizer_state_dict(model, opt)
        assert opt.step_count() == before, "get_optimizer_state_dict stepped a trained optimizer"
        dcp.save({"model": get_model_state_dict(model), "optim": osd}, checkpoint_id=root)
        sched_state = sched.state_dict()
        if path is not None:
            opt.close()
            cleanup(path)

        # 2 ranks -> 2 ranks: DCP's recipe (the new optimizer's state_dict is the template)
        model2 = shard_model(tp.make_model())
        opt2 = tierstate_torch.AdamW(tp.groups(model2), lr=tp.LR, state_dict_format="torch")
        sched2 = tp.schedule(opt2)
        sd2 = {"model": get_model_state_dict(model2), "optim": get_optimizer_state_dict(model2, opt2)}
        dcp.load(sd2, checkpoint_id=root)
        set_model_state_dict(model2, sd2["model"])
        set_optimizer_state_dict(model2, opt2, sd2["optim"])
        sched2.load_state_dict(sched_state)
        assert opt2.step_count() == half, opt2.step_count()
        rest2 = train_segment(model2, opt2, sched2, data[half:], split=True)

        # torch.optim.AdamW through the same checkpoint, one process (the params' reference)
        dist.barrier()
        if RANK == 0:
            t_model = tp.make_model()
            t_opt = torch.optim.AdamW(tp.groups(t_model), lr=tp.LR, foreach=False)
            t_sched = tp.schedule(t_opt)
            tsd = {"model": get_model_state_dict(t_model), "optim": get_optimizer_state_dict(t_model, t_opt)}
            dcp.load(tsd, checkpoint_id=root, no_dist=True)
            set_model_state_dict(t_model, tsd["model"])
            set_optimizer_state_dict(t_model, t_opt, tsd["optim"])
            t_sched.load_state_dict(sched_state)
            train_segment(t_model, t_opt, t_sched, data[half:], split=False)
            # 2 ranks -> 1 process: rank 0 alone
            m1 = tp.make_model()
            o1 = tierstate_torch.AdamW(tp.groups(m1), lr=tp.LR, state_dict_format="torch")
            s1 = tp.schedule(o1)
            sd1 = {"model": get_model_state_dict(m1), "optim": get_optimizer_state_dict(m1, o1)}
            dcp.load(sd1, checkpoint_id=root, no_dist=True)
            set_model_state_dict(m1, sd1["model"])
            set_optimizer_state_dict(m1, o1, sd1["optim"])
            s1.load_state_dict(sched_state)
            assert o1.step_count() == half, o1.step_count()
            rest1 = train_segment(m1, o1, s1, data[half:], split=False)
            assert_parity(f"FSDP2 {tier} DCP, 2 ranks -> 1 process", ref[0], first + rest1, t_model, m1)
            whole = [p.detach().clone() for p in t_model.parameters()]
        else:
            whole = None
        box = [whole]
        dist.broadcast_object_list(box, src=0)
        t_model = tp.make_model()
        with torch.no_grad():
            for p, w in zip(t_model.parameters(), box[0]):
                p.copy_(w)
        assert_parity(f"FSDP2 {tier} DCP, 2 ranks -> 2 ranks", ref[0], first + rest2, t_model, model2)
        dist.barrier()
        if RANK == 0:
            shutil.rmtree(root, ignore_errors=True)
        dist.barrier()
        print(f"rank {RANK}: FSDP2 {tier}: DCP saved at step {half} (the optimizer not stepped by it), loaded at 2 "
              "ranks and at 1 (resharded): within 1e-4", flush=True)


def case_ddp_partition(ref):
    """DDP (each rank a replica, the gradients all-reduced) with ShardedAdamW: each rank keeps
    the state of its share of the elements, in PinnedHost and NvmeFile; within 1e-4 of one
    process's torch.optim.AdamW, the replicas equal to the bit; clipped, the norm is one
    tierstate process's to the bit; a NaN that only rank 1's slice holds skips both."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    total = sum(p.numel() for p in tp.make_model().parameters())
    for tier in ("pinned", "nvme"):
        model = tp.make_model()
        net = DDP(model)
        path = scratch("ddp") if tier == "nvme" else None
        opt = tierstate_torch.ShardedAdamW(tp.groups(model), lr=tp.LR, tier=tier, path=path, chunk_elements=2048)
        losses, _ = train_sharded(net, opt, tp.STEPS, sched=tp.schedule(opt))
        assert_parity(f"DDP ShardedAdamW {tier}", ref[0], losses, ref[1], model)
        mine = sum(c for _, _, c in opt._pieces[RANK])
        assert mine <= total / WORLD + 4096, (mine, total)
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        every = [torch.empty_like(flat) for _ in range(WORLD)]
        dist.all_gather(every, flat)
        assert all(torch.equal(e, flat) for e in every), "the replicas differ"
        if path is not None:
            opt.close()
            cleanup(path)
        print(f"rank {RANK}: DDP + ShardedAdamW {tier}: within 1e-4, replicas equal; state of {mine} of {total} "
              f"elements ({mine / total:.3f})", flush=True)
    clip = 0.05
    model = tp.make_model()
    net = DDP(model)
    opt = tierstate_torch.ShardedAdamW(tp.groups(model), lr=tp.LR, max_grad_norm=clip)
    ref_losses, ref_model, ref_norms = reference(tp.STEPS, clip=clip)
    losses, results = train_sharded(net, opt, tp.STEPS, sched=tp.schedule(opt))
    assert_parity("DDP ShardedAdamW clip", ref_losses, losses, ref_model, model)
    for i, (a, r) in enumerate(zip(ref_norms, results)):
        assert abs(a - r["grad_norm"]) <= 1e-4 * a, f"step {i + 1}: norm {r['grad_norm']} vs clip_grad_norm_'s {a}"
    model = tp.make_model()
    net = DDP(model)
    opt = tierstate_torch.ShardedAdamW(model.parameters(), lr=tp.LR, max_grad_norm=clip)
    whole = [p.detach().clone().requires_grad_() for p in model.parameters()]
    one = tierstate_torch.AdamW(whole, lr=tp.LR, max_grad_norm=clip)
    x, y = tp.batches(1)[0]
    tp.loss_of(net, my_part(x), my_part(y)).backward()
    for p, q in zip(whole, model.parameters()):
        p.grad = q.grad.clone()
    opt.step()
    one.step()
    assert opt.last_step["grad_norm"] == one.last_step["grad_norm"], (opt.last_step, one.last_step)
    assert all(torch.equal(p, q) for p, q in zip(whole, model.parameters())), "one step differs from one process's"
    # Each rank's state_dict is its share: a rank loads its own, and another's is refused.
    sd = opt.state_dict()
    every = [None] * WORLD
    dist.all_gather_object(every, sd)
    opt.load_state_dict(every[RANK])
    try:
        opt.load_state_dict(every[1 - RANK])
    except ValueError as e:
        assert f"rank {1 - RANK} of 2's share" in str(e), e
    else:
        raise AssertionError("another rank's share of the state was taken")
    # A NaN in rank 1's slice alone (after DDP's all-reduce): both skip.
    tp.loss_of(net, my_part(x), my_part(y)).backward()
    before = [p.detach().clone() for p in model.parameters()]
    if RANK == 1:
        model.head.bias.grad[0] = float("nan")
    opt.step()
    assert opt.last_step["skipped"], opt.last_step
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    print(f"rank {RANK}: DDP + ShardedAdamW clipped: the norm one process's bits; a NaN in rank 1's slice alone "
          "skips both", flush=True)


def case_refusals():
    model = shard_model(tp.make_model())
    extra = nn.Parameter(torch.zeros(3))
    try:
        tierstate_torch.AdamW([*model.parameters(), extra], overlap_backward=True)
    except ValueError as e:
        assert "plain tensor among FSDP2's DTensor params" in str(e), e
    else:
        raise AssertionError("a plain param among DTensor ones was taken")
    from torch.distributed.tensor import Shard
    model = tp.make_model()
    fully_shard(model, shard_placement_fn=lambda p: Shard(1) if p.dim() == 2 else None)
    try:
        tierstate_torch.AdamW(model.parameters(), overlap_backward=True)
    except ValueError as e:
        assert "Shard(0)" in str(e) and "parameter " in str(e), e
    else:
        raise AssertionError("Shard(1) params were taken")
    tiny = nn.Linear(8, 1)
    fully_shard(tiny)
    try:
        tierstate_torch.AdamW(tiny.parameters(), overlap_backward=True)
    except ValueError as e:
        assert "gives rank 1 no rows" in str(e), e
    else:
        raise AssertionError("a rank with nothing to step was taken")
    for kw, words in (({"overlap_backward": True}, "overlap_backward"), ({"delayed_update": True}, "delayed_update")):
        try:
            tierstate_torch.ShardedAdamW(tp.make_model().parameters(), **kw)
        except ValueError as e:
            assert words in str(e) and "partition=" in str(e), e
        else:
            raise AssertionError(f"partition= with {kw} was taken")
    try:  # (min_8bit_size keeps the small tensors' state in fp32: a second shard, on some ranks only)
        tierstate_torch.ShardedAdamW(tp.make_model().parameters(), state_dtype=torch.int8).step()
    except ValueError as e:
        assert "min_8bit_size=0" in str(e), e
    else:
        raise AssertionError("partition= over two shard formats was taken")
    try:
        tierstate_torch.Adafactor(tp.make_model().parameters(), partition=True).step()
    except ValueError as e:
        assert "Adafactor" in str(e), e
    else:
        raise AssertionError("Adafactor with partition= was taken")
    print(f"rank {RANK}: refusals name what was wrong", flush=True)


def main() -> int:
    global RANK, WORLD
    dist.init_process_group("gloo")
    RANK, WORLD = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    t0 = time.time()
    try:
        if os.environ.get("ONLY"):
            globals()[os.environ["ONLY"]]()
            return 0
        ref = reference(tp.STEPS)
        case_tiers(ref)
        case_overlap_nvme(ref)
        case_clip()
        case_scaler_one_rank_overflows()
        case_nan_one_rank()
        case_mixed_precision()
        case_rows_fewer_than_ranks()
        case_resume(ref)
        case_ddp_partition(ref)
        case_torch_state_across_world_sizes(ref)
        case_dcp(ref)
        case_refusals()
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # (torchrun stops the other rank, which may be waiting in a collective)
    dist.barrier()
    if RANK == 0:
        print(f"test_distributed: {WORLD} ranks, every case passed in {time.time() - t0:.1f} s", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
