# SPDX-License-Identifier: Apache-2.0
"""A rank's share of a model under torch.distributed (FSDP2's fully_shard): each rank steps
its own shards of the params (DTensor.to_local()), and takes the step's decisions with the
others: whether any rank's gradients hold an inf or a NaN (every rank then skips), and the
gradients' global norm for max_grad_norm, the same bits one process would compute.

The shards call these from their own threads (tierstate::across_ranks: a streaming step's
checks run on its driver), so the collectives go through a group of their own, not FSDP2's
(whose reduce-scatters backward issues meanwhile), over gloo (a flag and block sums: CPU
tensors, whatever the model's backend)."""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from ._common import _ext

_BLOCK = 4096  # the gradient norm's blocks (step/checks.hpp)


def _dtensor_type() -> Any:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # (torch built without distributed)
        return None
    return DTensor


def is_sharded(p: torch.Tensor) -> bool:
    """Whether p is a DTensor (a param of a model FSDP2's fully_shard sharded)."""
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(p, dtensor)


def local(p: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the memory this rank updates), else p itself."""
    if is_sharded(p):
        with torch.no_grad():
            return p.to_local()
    return p


def local_grad(p: torch.Tensor) -> torch.Tensor | None:
    g = p.grad
    return None if g is None else local(g)


def as_param(flat: torch.Tensor, p: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A state slot of this rank's shard as torch keeps p's: p's shape, dtype (or `dtype`) and
    device; for FSDP2's p, a DTensor placed as p is (its local part the slot), as torch.optim's
    state of a fully_shard model is, which torch.distributed.checkpoint saves and reshards."""
    dtype = p.dtype if dtype is None else dtype
    if not is_sharded(p):
        return flat.view(p.shape).to(device=p.device, dtype=dtype)
    mine = local(p)
    part = flat.view(mine.shape).to(device=mine.device, dtype=dtype)
    return type(p).from_local(part, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def local_of_whole(v: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A state tensor for FSDP2's p: a DTensor's local shard, or, of a whole tensor (a full
    state_dict, one process's), the part this rank's shard of p holds (cut as p is: no
    communication)."""
    if is_sharded(v):
        return local(v)
    if is_sharded(p) and v.numel() == p.numel() and v.numel() != local(p).numel():
        from torch.distributed.tensor import distribute_tensor
        whole = v.detach().reshape(p.shape).to(local(p).device)
        return distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None).to_local()
    return v


def shard_offset(p: torch.Tensor, name: str, i: int) -> int:
    """Where p's local shard begins in the whole tensor, in elements: FSDP2's Shard(0) over a
    one-dimensional mesh (rows; the last ranks' may be fewer, or none). Other placements
    (HSDP's 2-D mesh, a shard_placement_fn's Shard(1), tensor parallelism) are refused."""
    from torch.distributed.tensor import Shard
    placements = tuple(p.placements)
    if p.device_mesh.ndim != 1 or placements != (Shard(0),):
        raise ValueError(f"{name}: parameter {i} is a DTensor placed {placements} on a {p.device_mesh.ndim}-D mesh; "
                         "tierstate_torch steps FSDP2's Shard(0) params on a 1-D mesh (fully_shard without "
                         "a 2-D mesh or shard_placement_fn)")
    rows = p.shape[0] if p.dim() > 0 else 1
    n = p.device_mesh.size()
    per = -(-rows // n)  # (torch.chunk's rows per rank)
    first_row = min(rows, per * p.device_mesh.get_local_rank())
    return first_row * (p.numel() // max(rows, 1))


def pairwise_sum(v: Sequence[float], begin: int = 0, end: int | None = None) -> float:
    """The sum of v[begin:end] in step/checks.hpp's pairwise order (the halves, recursively)."""
    end = len(v) if end is None else end
    n = end - begin
    if n == 0:
        return 0.0
    if n == 1:
        return v[begin]
    h = n // 2
    return pairwise_sum(v, begin, begin + h) + pairwise_sum(v, begin + h, end)


def norm_pieces(grads: Sequence[tuple[torch.Tensor | None, int]]) -> list[Any]:
    """This rank's share of the gradient norm, per tensor: None (no gradient), or (the slice's
    offset, its first elements that end a block an earlier rank began, the sums of the
    blocks that begin in it)."""
    C = _ext()
    out: list[Any] = []
    for g, offset in grads:
        if g is None:
            out.append(None)
            continue
        flat = g.detach().reshape(-1)
        if flat.device.type != "cpu":
            flat = flat.cpu()
        head = min(flat.numel(), (_BLOCK - offset % _BLOCK) % _BLOCK)
        out.append((offset, flat[:head].float().clone(), C.block_sums(flat.contiguous(), offset)))
    return out


def combine_norm(everyone: Sequence[list[Any]]) -> float:
    """Every rank's norm_pieces (in rank order) as one process's gradient norm: per tensor,
    its blocks' sums in element order (a block cut between ranks continued, in order, with
    the elements that end it), then all blocks combined pairwise in (tensor, block) order."""
    C = _ext()
    blocks: list[float] = []
    for t in range(len(everyone[0])):
        mine = [r[t] for r in everyone]
        if any(m is None for m in mine) and not all(m is None for m in mine):
            raise RuntimeError(f"tierstate_torch: across ranks, parameter {t} has a gradient on some ranks and "
                               "not on others")
        seq: list[float] = []
        for offset, head, sums in sorted((m for m in mine if m is not None), key=lambda m: m[0]):
            if head.numel():
                if not seq:
                    raise RuntimeError(f"tierstate_torch: across ranks, parameter {t}'s shards do not cover it")
                seq[-1] = C.fold_squares(seq[-1], head)
            seq.extend(sums.tolist())
        blocks.extend(seq)
    return math.sqrt(pairwise_sum(blocks))


class Ranks:
    """The across_ranks hooks of one optimizer's shards (tierstate_torch._C.Shard's ranks=)."""

    def __init__(self, ranks: list[int], blocks: bool = False) -> None:
        import torch.distributed as dist
        self._dist = dist
        self.ranks = ranks
        # partition=: the ranks own whole 4096-element blocks in order, so their block sums
        # gathered in rank order are one process's; else (FSDP2's rows) see norm.
        self.blocks = blocks
        # A mesh over part of the world (pipeline stages) is made by its ranks alone; then it is
        # not destroyed at close(): in torch 2.11 a new group made after destroying such a
        # group fails to connect (gloo: connection refused).
        self._local = len(ranks) < dist.get_world_size()
        self.group = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=self._local)
        # This rank's gradients and where each begins in its tensor (the optimizer's, in order).
        self.grads: Callable[[], list[tuple[torch.Tensor | None, int]]] = lambda: []

    def any_nonfinite(self, found: bool) -> bool:
        flag = torch.tensor([1 if found else 0], dtype=torch.int32)
        self._dist.all_reduce(flag, op=self._dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def norm(self, sums: torch.Tensor) -> float:
        everyone: list[Any] = [None] * len(self.ranks)
        if self.blocks:
            self._dist.all_gather_object(everyone, sums.tolist(), group=self.group)
            return math.sqrt(pairwise_sum([x for mine in everyone for x in mine]))
        # FSDP2: the shard's own block sums begin at its slices' starts; the global blocks begin
        # at the tensors' own, so the slices are summed again from where they lie.
        self._dist.all_gather_object(everyone, norm_pieces(self.grads()), group=self.group)
        return combine_norm(everyone)

    def close(self) -> None:
        """Ends the group (after the shards that call the hooks are gone)."""
        if self.group is not None and not self._local:
            self._dist.destroy_process_group(self.group)
        self.group = None
