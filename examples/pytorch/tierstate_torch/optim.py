# SPDX-License-Identifier: Apache-2.0
"""torch.optim.Adam, AdamW, SGD and Adafactor, and Lion, with their state offloaded by tierstate.

    opt = tierstate_torch.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1,
                                tier="nvme", path="/mnt/nvme/scratch")

A drop-in replacement for torch.optim.AdamW (and Adam, SGD, Adafactor; Lion as lion-pytorch): param groups, LR schedulers,
zero_grad, closures, GradScaler, state_dict/load_state_dict. The master copy (for
bf16/fp16 params) and the moments live in the chosen tier, not in tensors: `tier="pinned"`
keeps them in host memory, `tier="nvme"` in a scratch file under `path`, streamed through a
few chunks of staging memory each step; `tier="device"` in GPU memory (no offload, with
compute="device"). `compute="host"` runs the update on the CPU (for CUDA params: ZeRO-
Offload, gradients down and params up over PCIe, overlapped chunk by chunk);
`compute="device"` runs it on the GPU, the state streamed in and out.

Testing aid: with TIERSTATE_TORCH_EMULATED_DEVICE=1 and a build without CUDA, CPU params
are handled as device params on tierstate's emulated device (device memory is host memory,
its streams are threads), so the GPU compositions run on a machine without a GPU.

What differs from torch.optim:
- The state is not in `optimizer.state` (it is not made of tensors; `optimizer.state` is
  empty, but true once a step was taken); read a slot with `get_state(param, "exp_avg")`,
  convert the whole state with `torch_state_dict()` (`full=True`: FSDP2's gathered whole).
- `state_dict()` carries tierstate checkpoints (master included) plus the param groups;
  `load_state_dict()` takes those, or the state_dict of the torch optimizer it stands in for
  (with FSDP2 or partition=, its slots whole or as DTensors: any world size). With
  `state_dict_format="torch"`, `state_dict()` gives torch's format (slots in fp32, the master
  kept), which torch.distributed.checkpoint's get/set_optimizer_state_dict save and reshard.
- SGD chooses its rule by momentum (0: no buffer), so every group's momentum is 0, or none is.
- Step counts are per param, as torch keeps them: a param whose `.grad` is None in a step
  is left as it is and its count does not advance. `step_count()` is the optimizer's (the
  steps taken), `step_count(param)` a param's own.
- `params` are updated in place through their memory: the optimizer checks each step that
  they were not moved or reallocated (`model.to(...)` after making the optimizer).
- With overlap_backward, the update reads each gradient when backward hands it over:
  changing gradients or hyper-parameters between backward and step() is refused.
- One tierstate_torch optimizer drives a parameter at a time, the newest: making one over a
  parameter that another (still alive: kept by an old scheduler, a notebook variable)
  already has replaces that one, with or without overlap_backward on either side. The
  replaced optimizer's backward hooks are removed at once, so backward hands the newer one
  alone the gradients; its step(), zero_grad(), load_state_dict() and add_param_group()
  raise, saying it was replaced; its state can still be read (state_dict(), get_state(),
  torch_state_dict()), to carry it over with `new.load_state_dict(old.state_dict())`. A
  delayed update it has in flight is written into the params first (as flush() would); one
  in the middle of a streaming step (backward handed it gradients, its step() not yet
  called) is not replaced: making the newer one is refused until its step() has run.
  torch.optim optimizers are not tracked: close() a tierstate_torch one you swap for them.
- Compact state (AdamW and Adam without amsgrad, Lion, SGD with momentum; compute="host"):
  `state_dtype=torch.int8` keeps the moments (Lion's and SGD's one) in 8-bit blocks of 256
  (bitsandbytes' blockwise dynamic maps, encoded to the nearest value; about 2.03 bytes per
  element for Adam's m and v instead of 8); tensors under `min_8bit_size` elements
  (default 4096, as bitsandbytes) keep fp32 state. `torch.bfloat16` keeps them in bf16. For
  bf16 params, `master="kahan"` drops the fp32 master for a bf16 compensation slot, and
  `master="stochastic"` for nothing (each update rounded stochastically, deterministic for a
  seed); `master="fp32"` (the default) keeps it. Each of the three may also be a param
  group's key. `state_dict()`, `get_state()` and `torch_state_dict()` still give fp32
  moments. Params of one format share a shard: several formats make several shards, as
  several dtypes do.
- `close()` removes the hooks and releases the state (pinned memory, the scratch file)
  without waiting for the garbage collector; every call but close() then raises.
"""
from __future__ import annotations

import math
import os
import weakref
from typing import Any, Callable, Iterable

import torch

from ._build import _COMPACT_RULES
from ._common import (_COMPUTES, _check_tier, _DTYPES, _POLICIES, _TIERS, _checked_format, _ext, _key_name, _number, _on, _stream,
                      _table_values)
from ._ownership import _Ownership
from ._ranks import Ranks, is_sharded, local, local_grad, shard_offset
from ._state_dict import _StateDicts
from ._trace import Trace
from . import _progress
from ._metrics import StepMetrics


def _offload_of(p: torch.Tensor) -> Any:
    """The OffloadedParameters holding `p` (offload_parameters), or None."""
    return getattr(p, "_tierstate_offload", None)


def _rank_path(name: str, tier: str, path: Any) -> tuple[Any, str | None]:
    """path= with "{rank}" in it: this rank's (torch.distributed's rank), its directory made
    if only it is missing (and removed when the optimizer is closed, if empty). Returns the
    path and the directory made, if one was."""
    if path is None or "{rank}" not in str(path):
        return path, None
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"{name}: path={str(path)!r} names a rank, and torch.distributed is not initialized")
    mine = str(path).replace("{rank}", str(dist.get_rank()))
    if tier == "nvme" and not os.path.isdir(mine) and os.path.isdir(os.path.dirname(mine) or "."):
        os.mkdir(mine)
        return mine, mine
    return mine, None


def _one_format_hint(shards: dict[tuple, Any], demoted: bool) -> str:
    """Where min_8bit_size alone split the params (two shards, one of 8-bit state, the other
    of the small tensors it left in fp32): how to keep them in one."""
    keys = list(shards)
    if demoted and len(keys) == 2 and {k[2] for k in keys} == {torch.int8, torch.float32} and \
            len({(k[0], k[1], k[3]) for k in keys}) == 1:
        return " (min_8bit_size=0 keeps every tensor's state in 8 bits, in one shard)"
    return ""


class _OffloadedBase(_Ownership, _StateDicts, torch.optim.Optimizer):
    """What every rule's optimizer shares: the options, the shards, stepping, state_dicts.
    A rule's class says which rule its groups choose, refuses their numbers in torch's words,
    and how its state looks in the torch.optim optimizer it stands in for (the hooks below)."""

    # -- what a rule's class says --------------------------------------------------------

    #: torch's names of the rule's slots, in the state_dict torch.optim keeps
    _torch_slots: tuple[str, ...] = ()
    #: whether torch's state keeps a per-param "step"
    _torch_keeps_step = True
    #: the numbers a torch state_dict's param groups must have, and its flags (False where a
    #: group lacks one, as torch's own loading assumes)
    _torch_group_keys: tuple[str, ...] = ()
    _torch_flags: tuple[str, ...] = ("maximize",)

    def _rule_name(self) -> str:
        raise NotImplementedError

    def _check_rule_group(self, group: dict[str, Any]) -> None:
        """Refuses a group whose numbers would need another rule than the optimizer's."""

    def _validate_hyper(self, group: dict[str, Any]) -> None:
        """Refuses a group's numbers as torch.optim does (in its order, in its words)."""

    def _torch_group_extras(self) -> dict[str, Any]:
        """What torch's param groups hold besides the numbers (foreach, fused, ...)."""
        return {}

    def _check_torch_group(self, g: dict[str, Any]) -> None:
        """Refuses a torch state_dict's param group made by another rule."""

    def _torch_tensor_keys(self, p: torch.Tensor) -> dict[str, int]:
        """A rule with per-tensor state (Adafactor's statistics): the keys torch's state keeps
        it under for param `p`, with each one's element count."""
        return {}

    def _to_torch_tensor_state(self, p: torch.Tensor, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """The per-tensor state (tierstate's floats) as torch keeps it."""
        return {}

    def _from_torch_tensor_state(self, p: torch.Tensor, values: dict[str, torch.Tensor]) -> torch.Tensor:
        """torch's (zeros for a param without state) as tierstate's floats."""
        raise NotImplementedError

    # -----------------------------------------------------------------------------------

    def __init__(
        self,
        params: Iterable[Any],
        defaults: dict[str, Any],
        *,
        tier: str = "pinned",
        path: str | os.PathLike | None = None,
        compute: str = "host",
        state_dtype: torch.dtype | str = torch.float32,
        master: str = "fp32",
        min_8bit_size: int = 4096,
        chunk_elements: int = 0,
        threads: int = 0,
        bind_threads: bool = False,
        max_grad_norm: float | None = None,
        on_nonfinite: str = "skip_step",
        delayed_update: bool = False,
        overlap_backward: bool = False,
        shadow_state: bool | None = None,
        partition: Any = False,
        micro_batches: int = 1,
        grad_scaler: "torch.amp.GradScaler | None" = None,
        state_dict_format: str = "tierstate",
        progress: "bool | Callable[[str, int, int], None] | None" = None,
        metrics: "Callable[[dict], None] | None" = None,
    ) -> None:
        name = type(self).__name__
        self._progress = _progress.resolve(progress, name)
        if metrics is not None and not callable(metrics):
            raise ValueError(f"{name}: metrics must be a callable f(dict) (or None), not {metrics!r}")
        self._metrics = None if metrics is None else StepMetrics(metrics)
        if state_dict_format not in ("tierstate", "torch"):
            raise ValueError(f"{name}: state_dict_format must be 'tierstate' (its checkpoints, as bytes) or 'torch' "
                             f"(torch's format: what torch.distributed.checkpoint saves), not {state_dict_format!r}")
        path, self._made_dir = _rank_path(name, tier, path)
        _check_tier(name, tier, path, _TIERS)
        if compute not in _COMPUTES:
            raise ValueError(f"{name}: compute must be one of {_COMPUTES}, not {compute!r}")
        if tier == "device" and compute != "device":
            raise ValueError(f"{name}: tier='device' keeps the state where compute='device' updates it: "
                             "pass compute='device' (or offload to tier='pinned' or 'nvme')")
        state_dtype, master, min_8bit_size = _checked_format(state_dtype, master, min_8bit_size, f"{name}: ")
        if on_nonfinite not in _POLICIES:
            raise ValueError(f"{name}: on_nonfinite must be one of {_POLICIES}, not {on_nonfinite!r}")
        if max_grad_norm is not None and not (max_grad_norm > 0 and math.isfinite(max_grad_norm)):
            raise ValueError(f"{name}: max_grad_norm must be a finite number > 0 (or None), not {max_grad_norm!r}")
        if not (isinstance(micro_batches, int) and micro_batches >= 1):
            raise ValueError(f"{name}: micro_batches must be an int >= 1, not {micro_batches!r}")
        if micro_batches != 1 and not overlap_backward:
            raise ValueError(f"{name}: micro_batches counts backward passes through the hooks: it needs "
                             "overlap_backward=True (without it, accumulate into .grad and call step() once)")
        if overlap_backward and delayed_update:
            raise ValueError(f"{name}: overlap_backward and delayed_update do not combine")
        if shadow_state is not None and not isinstance(shadow_state, bool):
            raise ValueError(f"{name}: shadow_state must be True, False or None (automatic), not {shadow_state!r}")
        if shadow_state and not (tier == "nvme" and compute == "host" and overlap_backward and not delayed_update):
            raise ValueError(f"{name}: shadow_state=True serves overlap_backward's steps with the state on "
                             "tier='nvme' and compute='host' (without delayed_update)")
        # None: where it lets the non-finite check overlap backward (nvme, host compute, no
        # clipping), and the shard's composition takes it (CPU params, an fp32 master, a rule
        # without a tensor phase).
        shadow = (2 if shadow_state is None and tier == "nvme" and compute == "host" and overlap_backward
                  and on_nonfinite != "ignore" and not max_grad_norm else int(bool(shadow_state)))
        if partition is not False and partition is not None:
            import torch.distributed as dist
            if not (dist.is_available() and dist.is_initialized()):
                raise ValueError(f"{name}: partition= shares the state out among torch.distributed's ranks, which "
                                 "is not initialized")
            if overlap_backward:
                raise ValueError(f"{name}: partition= with overlap_backward is not built (DDP writes the reduced "
                                 "gradients after the post-accumulate-grad hooks run): use overlap_backward=False")
            if delayed_update:
                raise ValueError(f"{name}: partition= with delayed_update is not built")
        if grad_scaler is not None and on_nonfinite != "skip_step":
            raise ValueError(f"{name}: with a grad_scaler, on_nonfinite must be 'skip_step' (GradScaler "
                             "skips the steps whose gradients overflowed)")
        self._shards: dict[torch.dtype, Any] | None = None
        self._closed = False
        self._replaced: str | None = None  # by what, over which params: for the messages
        super().__init__(params, defaults)
        self._state_dict_format = state_dict_format
        self._keep_state_view()
        self._options = dict(tier=tier, compute=compute, directory=str(path) if path is not None else "",
                             chunk_elements=int(chunk_elements), threads=int(threads),
                             bind_threads=bool(bind_threads),
                             max_grad_norm=float(max_grad_norm or 0.0), on_nonfinite=on_nonfinite,
                             delayed_update=bool(delayed_update), shadow_state=shadow)
        self._format = dict(state_dtype=state_dtype, master=master, min_8bit_size=min_8bit_size)
        self._emulated = os.environ.get("TIERSTATE_TORCH_EMULATED_DEVICE") == "1"
        # The rule, by name (its hyper-parameter table comes from the extension when it is built).
        self._rule = self._rule_name()
        self._table: list[str] | None = None
        self._overlap = bool(overlap_backward)
        self._micro_batches = micro_batches
        self._grad_scaler = grad_scaler
        self._streaming_scale: float | None = None
        self._hooks: list[Any] = []
        self._pushed: dict[int, tuple] = {}
        # GradScaler hands this optimizer the scale and found_inf instead of unscaling the
        # gradients: the update divides the scale out on the fly.
        self._step_supports_amp_scaling = True
        self.last_step: dict[str, Any] = {}
        for group in self.param_groups:
            self._check_group(group)
        self._partition = None if partition is False or partition is None else partition
        self._slices: list[tuple[int, int] | None] | None = None
        self._ranks = self._make_ranks(self._params())
        self._offsets: list[int] = []
        replacing = self._owners_to_replace(self._params())  # refuses before anything changes
        if self._overlap:
            self._build()
        self._take_over(self._params(), replacing)
        if self._overlap:
            self._install_hooks()

    # -- the params ---------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self._refuse_if("add_param_group", replaced=True)
        if getattr(self, "_shards", None) is not None:
            raise RuntimeError(f"{type(self).__name__}: add_param_group after the state was made (the "
                               "first step, state_dict or overlap_backward): the set of tensors is fixed")
        super().add_param_group(param_group)
        if hasattr(self, "_options"):  # after __init__ (which checks and takes its groups itself)
            try:
                self._check_group(self.param_groups[-1])
                params = self.param_groups[-1]["params"]
                self._take_over(params, self._owners_to_replace(params))
            except BaseException:
                self.param_groups.pop()  # refused: the groups stay as they were
                raise

    def _group_format(self, group: dict[str, Any]) -> tuple[torch.dtype, str, int]:
        """The group's state_dtype, master and min_8bit_size (its own keys, else the optimizer's)."""
        f = self._format
        return _checked_format(group.get("state_dtype", f["state_dtype"]), group.get("master", f["master"]),
                               group.get("min_8bit_size", f["min_8bit_size"]), f"{type(self).__name__}: a param group's ")

    def _format_of(self, group: dict[str, Any], p: torch.Tensor) -> tuple[torch.dtype, str, bool]:
        """A param's state format: its group's, with fp32 state below min_8bit_size elements;
        and whether min_8bit_size made it so."""
        state, master, least = self._group_format(group)
        demoted = state == torch.int8 and p.numel() < least
        return (torch.float32 if demoted else state), master, demoted

    def _check_group(self, group: dict[str, Any]) -> None:
        name = type(self).__name__
        self._check_rule_group(group)
        state, master, _ = self._group_format(group)
        if state == torch.int8 or master != "fp32":
            what = "state_dtype=torch.int8" if state == torch.int8 else f"master={master!r}"
            if self._rule not in _COMPACT_RULES:
                raise ValueError(f"{name}: {what} is built for AdamW and Adam without amsgrad, Lion and SGD with "
                                 f"momentum (this optimizer's rule is {self._rule!r})")
        if master != "fp32":
            for p in group["params"]:
                if p.dtype != torch.bfloat16:
                    raise ValueError(f"{name}: master={master!r} is for bfloat16 params (the param is its own "
                                     f"master); a param group with it has a {p.dtype} param")
        for p in group["params"]:
            if self._options["compute"] == "device" and p.device.type == "cpu" and not self._emulated:
                raise ValueError(f"{name}: compute='device' updates CUDA parameters; a parameter is on cpu "
                                 "(use compute='host')")
            if p.dtype not in _DTYPES:
                raise ValueError(f"{name}: a parameter of dtype {p.dtype}: float32, bfloat16 and float16 are supported")
            if p.device.type not in ("cpu", "cuda"):
                raise ValueError(f"{name}: a parameter is on {p.device}; CPU and CUDA parameters are supported")
        self._validate_hyper(group)  # now rather than at the first step

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _hyper(self, group: dict[str, Any]) -> tuple:
        """The group's numbers in the order of the rule's table, checked first."""
        self._validate_hyper(group)
        if self._table is None:
            self._table = list(_ext().rule_table(self._rule)["hyperparameters"])
        return _table_values(group, self._table)

    def __del__(self) -> None:
        for handle in getattr(self, "_hooks", []):
            handle.remove()
        self._shards = None
        self._remove_made_dir()

    def _remove_made_dir(self) -> None:
        """The rank's directory a "{rank}" path made, once its scratch files are gone (if empty)."""
        made = getattr(self, "_made_dir", None)
        if made is not None and self._shards is None:
            try:
                os.rmdir(made)
            except FileNotFoundError:
                pass
            except OSError:
                return  # (not empty yet: a scratch file still held elsewhere; tried again at close/GC)
            self._made_dir = None

    def _device_params(self, p: torch.Tensor) -> bool:
        return p.is_cuda or self._emulated

    def _build(self) -> None:
        """Makes one shard per parameter dtype and device, registers every param and its group."""
        if self._shards is not None:
            return
        C = _ext()
        name = type(self).__name__
        if self._emulated and not (C.device_is_emulated() and C.has_device_params()):
            raise RuntimeError(f"{name}: TIERSTATE_TORCH_EMULATED_DEVICE=1 needs a build with the emulated device: "
                               "without CUDA (TIERSTATE_TORCH_CUDA=0), and for a package "
                               "TIERSTATE_TORCH_EMULATED_DEVICE_BUILD=1 as well")
        params = self._params()
        if len({id(p) for p in params}) != len(params):
            raise ValueError(f"{name}: a parameter appears twice")
        self._offsets = self._check_ranks(params)
        self._slices = self._partition_slices(params)
        shards: dict[tuple, Any] = {}
        self._where: list[tuple[tuple, int]] = []  # per global index: (shard key, tensor)
        members: dict[tuple, list[int]] = {}
        defaults = self._hyper(self.defaults)
        group_of = [g for g in self.param_groups for _ in g["params"]]
        demoted = False  # (where min_8bit_size keeps a tensor's state in fp32)
        for i, p in enumerate(params):
            if self._slices is not None and self._slices[i] is None:
                self._where.append(None)  # (partition: every element another rank's)
                continue
            off = _offload_of(p)
            if off is None and not local(p).is_contiguous():
                raise ValueError(f"{name}: parameter {i} is not contiguous")
            if off is not None and self._options["delayed_update"]:
                raise ValueError(f"{name}: delayed_update keeps its own copy of every parameter; parameter {i} is "
                                 "offloaded (offload_parameters): use delayed_update=False")
            if p.is_cuda and C.device_is_emulated():
                raise ValueError(f"{name}: parameter {i} is on {p.device}, but the extension was built "
                                 "without CUDA (TIERSTATE_TORCH_CUDA=0, or torch.cuda was not available)")
            if self._options["compute"] == "device" and not self._device_params(p):
                raise ValueError(f"{name}: compute='device' updates CUDA parameters; parameter {i} is on "
                                 f"{p.device} (use compute='host')")
            state, master, small = self._format_of(group_of[i], p)
            demoted |= small
            key = (p.dtype, p.device, state, master)
            if key not in shards:
                with _on(p.device):
                    shards[key] = C.Shard(
                        rule=self._rule, param_dtype=p.dtype,
                        state_dtype=key[2], master=key[3], device_params=self._device_params(p),
                        defaults=list(defaults), ranks=self._ranks, **self._options)
                    if self._progress is not None:
                        shards[key].set_progress(self._progress)
                members[key] = []
            with _on(p.device):
                if off is not None:
                    store, tid, _ = off.source(p)
                    t = shards[key].add_offloaded(f"p{i}", store, tid)
                else:
                    t = shards[key].add_tensor(f"p{i}", self._mine(i, p))
            self._where.append((key, t))
            members[key].append(i)
        self._group_ids: dict[tuple[tuple, int], int] = {}
        i = 0
        for gi, group in enumerate(self.param_groups):
            by_key: dict[tuple, list[str]] = {}
            for _ in group["params"]:
                if self._where[i] is not None:
                    by_key.setdefault(self._where[i][0], []).append(f"p{i}")
                i += 1
            for key, names in by_key.items():
                self._group_ids[(key, gi)] = shards[key].add_group(list(self._hyper(group)), names)
        if len(shards) > 1 and self._options["max_grad_norm"] > 0:
            raise ValueError(f"{name}: max_grad_norm with parameters of several dtypes, devices or state "
                             f"formats ({'; '.join(_key_name(k) for k in shards)}): clip with "
                             "torch.nn.utils.clip_grad_norm_ before step() instead"
                             f"{_one_format_hint(shards, demoted)}")
        if len(shards) > 1 and self._overlap:
            raise ValueError(f"{name}: overlap_backward with parameters of several dtypes, devices or state "
                             f"formats ({'; '.join(_key_name(k) for k in shards)}): each would check its own "
                             "gradients for inf/NaN and could step while another skips; use one dtype, "
                             f"or overlap_backward=False{_one_format_hint(shards, demoted)}")
        self._shards = shards
        self._members = members
        self._versions = [local(p)._version for p in params]
        self._masters = any({"master", "compensation"} & set(shard.slot_names()) for shard in shards.values())
        if self._overlap:  # (the hooks: _install_hooks, once the params are this optimizer's)
            self._arrivals = [0] * len(params)
            self._grad_versions: list[int | None] = [None] * len(params)
            self._grad_storages: list[int] = [0] * len(params)
            self._dropped: set[int] = set()

    def _push_hyperparameters(self, force: bool = False) -> None:
        """Hands the groups' hyper-parameters to the shards when they changed (schedulers)."""
        for gi, group in enumerate(self.param_groups):
            values = self._hyper(group)
            if not force and self._pushed.get(gi) == values:
                continue
            for key, shard in self._shards.items():
                g = self._group_ids.get((key, gi))
                if g is not None:
                    shard.set_hyperparameters(g, list(values))
            self._pushed[gi] = values

    def _sync_masters(self) -> None:
        """A bf16/fp16 param changed in place since the last step (load_state_dict, a
        clamp, an EMA swap: anything that bumps its version counter; not edits through
        `.data`, which bypass it) gets its fp32 master from it where the two now disagree, so
        the next update starts from the param the user sees, as torch's would. Elements the
        edit left as they were keep their master's full precision. A bf16 param with a Kahan
        compensation slot instead (master="kahan") has its compensation zeroed: the edited
        param is exact as it is."""
        params = self._params()
        for i, p in enumerate(params):
            off = _offload_of(p)
            if off is not None:  # written through the store (its write(), the model's load_state_dict)
                if off.take_edited(p):
                    key, _ = self._where[i]
                    shard = self._shards[key]
                    _, _, pname = off.source(p)
                    if "master" in shard.slot_names():
                        shard.set_state(f"p{i}", "master", off.read(pname).reshape(-1).float())
                    if "compensation" in shard.slot_names():
                        shard.set_state(f"p{i}", "compensation", torch.zeros(p.numel()))
                continue
            if self._where[i] is None:
                continue
            p = self._mine(i, p)  # (FSDP2's shard, partition's slice)
            if p._version != self._versions[i]:
                key, _ = self._where[i]
                shard = self._shards[key]
                if "master" in shard.slot_names():
                    with _on(key[1]):
                        master = shard.get_state(f"p{i}", "master")
                        now = p.detach().reshape(-1).cpu()
                        edited = master.to(p.dtype) != now
                        if bool(edited.any()):
                            shard.set_state(f"p{i}", "master", torch.where(edited, now.float(), master))
                if "compensation" in shard.slot_names():
                    with _on(key[1]):
                        shard.set_state(f"p{i}", "compensation", torch.zeros(p.numel()))
                self._versions[i] = p._version

    def _note_versions(self) -> None:
        self._versions = [local(p)._version for p in self._params()]

    def _check_memory(self) -> None:
        for i, p in enumerate(self._params()):
            if self._where[i] is None:
                continue
            key, t = self._where[i]
            if _offload_of(p) is not None:
                continue  # (its memory comes and goes with its layer's fetches)
            if (p.dtype, p.device) != key[:2] or not self._shards[key].same_memory(t, self._mine(i, p)):
                raise RuntimeError(
                    f"{type(self).__name__}: parameter {i} is no longer the memory it was registered with "
                    "(moved with .to(), or its .data replaced): make the optimizer after the model is in place")

    # -- stepping -----------------------------------------------------------------------

    def _amp(self) -> tuple[float, bool, bool]:
        """What GradScaler.step set on this optimizer: the scale the gradients carry (1 when
        none), whether it found an inf or NaN, and whether GradScaler.unscale_ already
        unscaled them (found_inf set, grad_scale None)."""
        scale = getattr(self, "grad_scale", None)
        found = getattr(self, "found_inf", None)
        s = 1.0 if scale is None else _number(scale, "grad_scale")
        f = False if found is None else bool(_number(found, "found_inf") != 0)
        return s, f, found is not None and scale is None

    def _forget_amp(self) -> None:
        """GradScaler deletes grad_scale and found_inf after a step() that returns; after one
        that raises, they would stay and multiply into the next step's scale."""
        for attribute in ("grad_scale", "found_inf"):
            if attribute in self.__dict__:
                delattr(self, attribute)

    # -- across ranks (FSDP2) ---------------------------------------------------------------

    def _make_ranks(self, params: list[torch.Tensor]) -> Ranks | None:
        """For FSDP2's DTensor params: the hooks that take each step's decisions with the other
        ranks of their mesh, through a group of their own made now (each rank makes its
        optimizer at the same point). None in one process."""
        if self._partition is not None:
            import torch.distributed as dist
            group = None if self._partition is True else self._partition
            return Ranks(dist.get_process_group_ranks(group or dist.group.WORLD), blocks=True)
        meshes = {tuple(p.device_mesh.mesh.flatten().tolist()) for p in params if is_sharded(p)}
        if not meshes:
            return None
        if len(meshes) != 1:
            raise ValueError(f"{type(self).__name__}: the DTensor params lie on {len(meshes)} different meshes; one "
                             "optimizer steps the params of one mesh")
        return Ranks(list(next(iter(meshes))))

    def _check_ranks(self, params: list[torch.Tensor]) -> list[int]:
        """FSDP2's params as this optimizer can step them; where each local shard begins in
        its tensor. Every refusal follows from what every rank sees alike (the params' global
        shapes, placements and options), so every rank refuses alike. [] in one process."""
        sharded = [is_sharded(p) for p in params]
        if not any(sharded):
            return []
        name = type(self).__name__
        if not all(sharded):
            plain = sharded.index(False)
            raise ValueError(f"{name}: parameter {plain} is a plain tensor among FSDP2's DTensor params: each rank "
                             "would step its own copy of it (fully_shard the module that holds it, or give it "
                             "to another optimizer)")
        if self._ranks is None:
            raise ValueError(f"{name}: FSDP2's DTensor params were added after the optimizer was made; pass them "
                             "when making it")
        if self._rule == "adafactor":
            raise ValueError(f"{name}: Adafactor's per-matrix statistics over FSDP2's row shards would be each "
                             "rank's own, not the matrix's: not built (use AdamW, Adam, SGD or Lion)")
        if self._options["delayed_update"]:
            raise ValueError(f"{name}: delayed_update with FSDP2's DTensor params is not built (its update of one "
                             "step runs during the next across ranks): use delayed_update=False")
        if self._micro_batches != 1 and self._options["max_grad_norm"] > 0:
            raise ValueError(f"{name}: max_grad_norm with FSDP2 and micro_batches > 1 is not built: accumulate the "
                             "gradients with no_sync-style backward passes and step once per batch")
        offsets = []
        held = [0] * params[0].device_mesh.size()  # (each rank's elements)
        for i, p in enumerate(params):
            if _offload_of(p) is not None:
                raise ValueError(f"{name}: parameter {i} is both FSDP2's and offload_parameters'; use one")
            offsets.append(shard_offset(p, name, i))
            if self._overlap and p.device.type == "cpu" and p.device_mesh.device_type != "cpu":
                raise ValueError(f"{name}: overlap_backward with FSDP2's CPUOffloadPolicy: its hooks fire while the "
                                 "gradient's copy to the CPU may still be on its way; use overlap_backward=False")
            if self._overlap and p.is_cuda and self._options["max_grad_norm"] > 0:
                raise ValueError(f"{name}: max_grad_norm with overlap_backward on FSDP2's CUDA params is not built "
                                 "(the norm would read gradients FSDP2's reduce-scatter may still be writing); "
                                 "use overlap_backward=False")
            rows = p.shape[0] if p.dim() > 0 else 1
            per = -(-rows // len(held))
            for r in range(len(held)):
                held[r] += max(0, min(rows, per * (r + 1)) - per * r) * (p.numel() // max(rows, 1))
        if 0 in held:
            raise ValueError(f"{name}: FSDP2 gives rank {held.index(0)} no rows of any of these params (each has "
                             f"fewer rows than the {len(held)} ranks): its optimizer would have nothing to step "
                             "and could not take part in the other ranks' checks; give it more params")
        me = weakref.ref(self)  # (the shards hold the hooks: no cycle through C++, which the GC cannot see)

        def grads() -> list[tuple[torch.Tensor | None, int]]:  # (max_grad_norm: one shard, params in order)
            return [(local_grad(p), offsets[i]) for i, p in enumerate(me()._params())]

        self._ranks.grads = grads
        return offsets

    def _mine(self, i: int, p: torch.Tensor) -> torch.Tensor:
        """The memory of param i this rank steps: partition's slice of it, FSDP2's local shard,
        or the param."""
        if self._slices is not None:
            b, c = self._slices[i]
            return p.detach().view(-1)[b:b + c]
        return local(p).detach()

    def _mine_grad(self, i: int, p: torch.Tensor) -> torch.Tensor | None:
        g = p.grad
        if g is None:
            return None
        if self._slices is not None:
            b, c = self._slices[i]
            return g.view(-1)[b:b + c]
        return local(g)

    def _partition_slices(self, params: list[torch.Tensor]) -> list[tuple[int, int] | None] | None:
        """partition=: this rank's slice of each param (None: all another rank's), from
        ranks::partition_elements over every param's elements (the same on every rank, so
        every rank refuses alike)."""
        if self._partition is None:
            return None
        import torch.distributed as dist
        name = type(self).__name__
        if any(is_sharded(p) for p in params):
            raise ValueError(f"{name}: partition= shares out a replicated (DDP) model's state; FSDP2's params are "
                             "sharded already: drop partition=")
        if self._rule == "adafactor":
            raise ValueError(f"{name}: partition= would split Adafactor's per-matrix statistics among ranks: not "
                             "built (use AdamW, Adam, SGD or Lion)")
        # One shard on every rank, so that every rank's shards call the hooks alike: the shard
        # keys of all the params (not of this rank's alone: min_8bit_size keeps small tensors'
        # state in fp32, in a shard of their own).
        group_of = [g for g in self.param_groups for _ in g["params"]]
        keys = {(p.dtype, p.device, *self._format_of(group_of[i], p)[:2]) for i, p in enumerate(params)}
        if len(keys) != 1:
            raise ValueError(f"{name}: partition= takes params of one dtype, device and state format, so that "
                             f"every rank has one shard; these make {len(keys)} "
                             f"({'; '.join(sorted(str(k) for k in keys))}) (with state_dtype=torch.int8, "
                             "min_8bit_size=0 keeps every tensor's state in 8 bits)")
        for i, p in enumerate(params):
            if not p.is_contiguous() or _offload_of(p) is not None:
                raise ValueError(f"{name}: partition= takes contiguous params in memory; parameter {i} is not")
        world = len(self._ranks.ranks)
        pieces = _ext().partition_elements([p.numel() for p in params], world)
        empty = [r for r, mine in enumerate(pieces) if not mine]
        if empty:
            raise ValueError(f"{name}: partition= over {world} ranks: the params' {sum(p.numel() for p in params)} "
                             f"elements make fewer 4096-element blocks than ranks (rank {empty[0]} would own none)")
        self._pieces = pieces
        self._rank = dist.get_rank(self._ranks.group)
        slices: list[tuple[int, int] | None] = [None] * len(params)
        for t, b, c in pieces[self._rank]:
            slices[t] = (b, c)
        return slices

    def _gather_params(self) -> None:
        """partition=: every rank's updated slices into every rank's params (one all-gather
        through the ranks' gloo group, padded to the largest share)."""
        import torch.distributed as dist
        params = self._params()
        counts = [sum(c for _, _, c in mine) for mine in self._pieces]
        p0 = params[0]
        out = torch.empty(max(counts), dtype=p0.dtype)
        parts = [params[t].detach().view(-1)[b:b + c].cpu() for t, b, c in self._pieces[self._rank]]
        torch.cat(parts, out=out[:counts[self._rank]])
        everyone = [torch.empty_like(out) for _ in counts]
        dist.all_gather(everyone, out, group=self._ranks.group)
        with torch.no_grad():
            for r, mine in enumerate(self._pieces):
                if r == self._rank:
                    continue
                at = 0
                for t, b, c in mine:
                    params[t].view(-1)[b:b + c].copy_(everyone[r][at:at + c])
                    at += c

    def _grad_hook(self, i: int, p: torch.Tensor) -> None:
        if self._closed or self._replaced is not None:
            return  # (its handle is removed; a hook already queued by autograd may still run)
        key, t = self._where[i]
        if self._streaming_scale is None:
            scale = 1.0
            if self._grad_scaler is not None and self._grad_scaler.is_enabled():
                scale = _number(self._grad_scaler.get_scale(), "the grad_scaler's scale")
            self._check_memory()
            self._sync_masters()
            self._push_hyperparameters()
            self._arrivals = [0] * len(self._arrivals)
            self._grad_versions = [None] * len(self._grad_versions)
            self._dropped = set()
            for key2, shard in self._shards.items():
                with _on(key2[1]):
                    shard.begin_step(scale, self._micro_batches)
            self._streaming_scale = scale
        grad = local_grad(p)
        with _on(key[1]):
            self._shards[key].grad_ready(t, grad, _stream(key[1]))
        self._arrivals[i] += 1
        self._grad_versions[i] = grad._version
        # (FSDP2's are views of one reduce-scatter buffer, sharing its version counter.)
        self._grad_storages[i] = grad.untyped_storage().data_ptr()
        if self._arrivals[i] == self._micro_batches and _offload_of(p) is not None and \
                self._shards[key].drop_grad(t):
            if p.grad.is_cuda:  # its copy down is queued on this stream: its memory is reused after it
                p.grad.record_stream(torch.cuda.current_stream(p.grad.device))
            p.grad = None  # kept by the store (written behind): backward's memory stays flat
            self._dropped.add(i)

    def _combine(self, results: list[dict[str, Any]]) -> dict[str, Any]:
        out = dict(results[0])
        for r in results[1:]:
            for k, v in r.items():
                if isinstance(v, bool):
                    out[k] = out[k] or v
                elif k == "step":
                    out[k] = v  # the same in every shard
                elif k == "grad_norm":
                    out[k] = math.hypot(out[k], v)  # the norm over all shards' gradients
                else:
                    out[k] = out[k] + v
        return out

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        try:
            loss = self._step(closure)
        except BaseException:
            self._forget_amp()
            raise
        if self._metrics is not None and self.last_step:
            self._metrics(self.last_step)
        return loss

    def _step(self, closure: Callable[[], Any] | None):
        self._refuse_if("step", replaced=True)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.last_step = {}
        self._build()
        scale, found_inf, unscaled = self._amp()
        if self._streaming_scale is not None:
            return self._finish_streaming(loss, scale, found_inf, unscaled)
        self._check_memory()
        if self._slices is not None and "found_inf" in self.__dict__:  # (torch agrees it for DTensors only)
            found_inf = self._ranks.any_nonfinite(found_inf)
        if found_inf:  # GradScaler's skip: nothing changes, the step count included
            self.last_step = {"skipped": True, "found_nonfinite": True, "step": self.step_count()}
            return loss
        self._sync_masters()
        self._push_hyperparameters()
        params = self._params()
        if len(self._shards) > 1 and self._options["on_nonfinite"] == "skip_step":
            # One shard must not step while another skips.
            grads = [g for g in map(local_grad, params) if g is not None]
            found = bool(grads) and self._any_nonfinite(grads)
            if self._ranks is not None:
                found = self._ranks.any_nonfinite(found)
            if found:
                self.last_step = {"skipped": True, "found_nonfinite": True, "step": self.step_count()}
                return loss
        results = []
        for key, shard in self._shards.items():
            grads = [self._mine_grad(i, params[i]) for i in self._members[key]]
            with _on(key[1]):
                results.append(shard.step(grads, scale, _stream(key[1])))
        self.last_step = self._combine(results)
        if self._slices is not None and not self.last_step["skipped"]:
            self._gather_params()
        self._note_versions()
        return loss

    @staticmethod
    def _any_nonfinite(grads: list[torch.Tensor]) -> bool:
        """Whether a gradient holds an inf or a NaN: CPU ones read once by tierstate's check,
        the others by torch (a sparse one is left to its shard, which refuses it by name)."""
        grads = [g for g in grads if g.layout == torch.strided]
        host = [g for g in grads if g.device.type == "cpu" and g.is_contiguous() and
                g.dtype in (torch.float32, torch.bfloat16, torch.float16)]
        if host and _ext().any_nonfinite(host):
            return True
        chosen = {id(g) for g in host}
        return not all(bool(torch.isfinite(g).all()) for g in grads if id(g) not in chosen)

    def _finish_streaming(self, loss, scale: float, found_inf: bool, unscaled: bool):
        """Ends the streaming step the hooks began. Whatever is refused here, the step is
        ended (every shard's finish_step runs), so the optimizer is never left inside it."""
        name = type(self).__name__
        used = self._streaming_scale
        params = self._params()
        problems = []
        refusal = None
        try:
            self._check_memory()
            changed_hyper = any(self._pushed.get(gi) != self._hyper(g) for gi, g in enumerate(self.param_groups))
            # A gradient's version when the last one sharing its memory was handed over: views of
            # one buffer (FSDP2's) share a version counter, which any of them bumps.
            final: dict[int, int] = {}
            for i, v in enumerate(self._grad_versions):
                if v is not None and i not in self._dropped and self._grad_storages[i] != 0:
                    final[self._grad_storages[i]] = max(v, final.get(self._grad_storages[i], v))
            # torch steps every param whose .grad is set: one used in fewer than micro_batches
            # backward passes (or given a .grad by hand) is handed over now, as it is.
            for i, p in enumerate(params):
                grad = local_grad(p)
                if grad is not None and self._arrivals[i] < self._micro_batches:
                    key, t = self._where[i]
                    with _on(key[1]):
                        while self._arrivals[i] < self._micro_batches:
                            self._shards[key].grad_ready(t, grad, _stream(key[1]))
                            self._arrivals[i] += 1
                elif self._grad_versions[i] is not None and i not in self._dropped and (
                        grad is None or grad._version != final.get(self._grad_storages[i], self._grad_versions[i])):
                    problems.append(i)
        except Exception as e:  # ended below all the same, then raised
            refusal, changed_hyper = e, False
        finally:
            self._streaming_scale = None
            results, failure = [], None
            for key, shard in self._shards.items():
                try:
                    with _on(key[1]):
                        results.append(shard.finish_step())
                except Exception as e:
                    failure = failure or e
            self._note_versions()
        if failure is not None:
            raise failure
        self.last_step = self._combine(results)
        if refusal is not None:
            raise refusal
        # What the update could not see: it ran on the gradients as backward handed them over.
        mixed = ("the update had already read some of them, so the state now mixes steps from the "
                 "gradients before and after the change (reload a checkpoint to undo it)")
        if problems:
            raise RuntimeError(
                f"{name}: with overlap_backward the update reads each gradient as backward hands it over, "
                f"but {len(problems)} gradient(s) (params {problems[:5]}) changed afterwards (clip_grad_norm_, "
                f"or another in-place edit): {mixed}. Clip with max_grad_norm=")
        if unscaled:
            raise RuntimeError(f"{name}: GradScaler.unscale_ was called on gradients the streaming step had "
                               f"already taken, scaled: {mixed}. With overlap_backward, pass the GradScaler as "
                               "grad_scaler= and do not call unscale_ (clip with max_grad_norm=)")
        if changed_hyper:
            raise RuntimeError(f"{name}: with overlap_backward the hyper-parameters are read at the first "
                               "gradient of the step, and a param group changed after it; this step used the "
                               "old values. Change them before backward (schedulers: sched.step() after "
                               "opt.step(), as usual)")
        if scale != 1.0 and scale != used:
            raise RuntimeError(f"{name}: GradScaler stepped with scale {scale}, but the gradients were "
                               f"handed over with scale {used}: pass the same GradScaler as grad_scaler=")
        if found_inf and not self.last_step["skipped"]:
            raise RuntimeError(f"{name}: GradScaler found an inf/NaN that the streaming step did not")
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        # (Replaced: the gradients are the newer optimizer's, maybe already handed over to it.)
        self._refuse_if("zero_grad", replaced=True)
        if self._streaming_scale is not None:
            raise RuntimeError(
                f"{type(self).__name__}: zero_grad during a streaming step: backward handed gradients "
                "over (overlap_backward) and step() has not been called; call step() after every backward "
                "pass (or micro_batches of them)")
        super().zero_grad(set_to_none)

    def flush(self) -> None:
        """delayed_update: finishes the update in flight and writes its params."""
        self._refuse_if("flush")
        if self._shards is not None:
            for key, shard in self._shards.items():
                with _on(key[1]):
                    shard.flush()

    def step_count(self, param: torch.Tensor | None = None) -> int:
        """The steps taken; with `param`, the steps that updated it (torch's state[p]["step"]),
        which overlap_backward's step in flight (backward done, step() not yet) refuses."""
        self._refuse_if("step_count")
        i = None if param is None else self._index(param)
        if self._shards is None:
            return 0
        if i is None:
            return next(iter(self._shards.values())).step_count()
        if self._where[i] is None:  # (partition: another rank's)
            return self.step_count()
        key, _ = self._where[i]
        return self._shards[key].tensor_step_count(f"p{i}")

    def trace(self, path: str | os.PathLike, capacity: int = 1 << 20) -> Trace:
        """The timeline of the steps (and saves and loads) taken inside `with opt.trace(path):`
        (or between its start() and stop()): each chunk's state read, the wait for it, its
        update on each thread, its write, the checks, with bytes; written to `path` at the
        end as Chrome trace-event JSON (ui.perfetto.dev opens it; bench/trace_png.py draws
        it). `capacity` events per shard (40 bytes each) are allocated at the start; more
        are dropped and counted (the Trace's `dropped`)."""
        self._refuse_if("trace")
        return Trace(self, path, capacity)

    def _trace_shards(self) -> list[tuple[Any, Any]]:
        self._build()
        return list(self._shards.items())

    def composition(self) -> list[str]:
        """The C++ type of each shard's optimizer."""
        self._refuse_if("composition")
        self._build()
        return [shard.composition() for shard in self._shards.values()]

    def get_state(self, param: torch.Tensor, slot: str) -> torch.Tensor:
        """One slot ("master", "exp_avg", "exp_avg_sq", "max_exp_avg_sq") of a param, as fp32."""
        self._refuse_if("get_state")
        self._build()
        i = self._index(param)
        if self._slices is not None:
            raise ValueError(f"{type(self).__name__}: get_state with partition=: each rank holds a slice of the "
                             "state (torch_state_dict() gathers the whole of it)")
        key, _ = self._where[i]
        with _on(key[1]):
            return self._shards[key].get_state(f"p{i}", slot).view(local(param).shape)

    def _index(self, param: torch.Tensor) -> int:
        for i, p in enumerate(self._params()):
            if p is param:
                return i
        raise ValueError(f"{type(self).__name__}: the tensor is not one of this optimizer's parameters")


class _OffloadedAdamBase(_OffloadedBase):
    """torch.optim.Adam and AdamW: the rules adam, adamw and their AMSGrad forms."""

    _decoupled: bool = True
    _torch_group_keys = ("lr", "betas", "eps", "weight_decay")
    _torch_flags = ("amsgrad", "maximize")

    def __init__(self, params: Iterable[Any], lr: float | torch.Tensor = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, *, maximize: bool = False, **options: Any) -> None:
        self._amsgrad = bool(amsgrad)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                                      maximize=maximize), **options)

    @property
    def _torch_slots(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if self._amsgrad else ())

    def _rule_name(self) -> str:
        return ("adamw" if self._decoupled else "adam") + ("_amsgrad" if self._amsgrad else "")

    def _check_rule_group(self, group: dict[str, Any]) -> None:
        if bool(group["amsgrad"]) != self._amsgrad:
            raise ValueError(f"{type(self).__name__}: every param group must have amsgrad={self._amsgrad} (the "
                             "rule is chosen once, when the optimizer is made)")

    def _validate_hyper(self, group: dict[str, Any]) -> None:
        """Refuses a group's numbers as torch.optim does (in its order, in its words)."""
        beta1, beta2 = group["betas"]
        lr, b1, b2 = _number(group["lr"], "lr"), _number(beta1, "betas[0]"), _number(beta2, "betas[1]")
        eps, wd = _number(group["eps"], "eps"), _number(group["weight_decay"], "weight_decay")
        name = type(self).__name__
        if not lr >= 0:
            raise ValueError(f"{name}: invalid learning rate {lr}")
        if not eps >= 0:
            raise ValueError(f"{name}: invalid epsilon value {eps}")
        if not 0 <= b1 < 1:
            raise ValueError(f"{name}: invalid beta parameter at index 0: {b1}")
        if not 0 <= b2 < 1:
            raise ValueError(f"{name}: invalid beta parameter at index 1: {b2}")
        if not wd >= 0:
            raise ValueError(f"{name}: invalid weight_decay value {wd}")


    def _torch_group_extras(self) -> dict[str, Any]:
        return dict(foreach=None, capturable=False, differentiable=False, fused=None,
                    decoupled_weight_decay=self._decoupled)

    def _check_torch_group(self, g: dict[str, Any]) -> None:
        name = type(self).__name__
        if bool(g.get("amsgrad", False)) != self._amsgrad:
            raise ValueError(f"{name}: the state_dict has amsgrad={g.get('amsgrad')}; this optimizer "
                             f"has amsgrad={self._amsgrad}")
        decoupled = bool(g.get("decoupled_weight_decay", False))
        if decoupled != self._decoupled and _number(g.get("weight_decay", 0), "weight_decay") != 0:
            raise ValueError(f"{name}: the state_dict is torch.optim."
                             f"{'AdamW' if decoupled else 'Adam'}'s with weight decay; this is "
                             f"{'AdamW' if self._decoupled else 'Adam'}")


class AdamW(_OffloadedAdamBase):
    """torch.optim.AdamW (decoupled weight decay, default 1e-2), state offloaded."""

    _decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                 **kwargs) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)


class ShardedAdamW(AdamW):
    """AdamW with partition=True (ZeRO-1) for a replicated model (DDP): each of torch.distributed's
    ranks keeps the state of its share of the elements (ranks::partition_elements: one
    contiguous range per rank cut at 4096-element blocks), steps that share from the reduced
    gradients DDP left in .grad, and all-gathers the updated params. The inf check and
    max_grad_norm's norm are every rank's (one process's norm, to the bit). partition= may
    be a process group instead of True."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                 **kwargs) -> None:
        kwargs.setdefault("partition", True)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, **kwargs)


class Adam(_OffloadedAdamBase):
    """torch.optim.Adam (L2 weight decay, default 0), state offloaded."""

    _decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False,
                 **kwargs) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)


class SGD(_OffloadedBase):
    """torch.optim.SGD, state offloaded: the rule sgd_momentum (a momentum buffer per param)
    when momentum > 0, else sgd (no state but the master of bf16/fp16 params). Every group
    must then agree on whether momentum is 0; changing it between 0 and > 0 later (a
    scheduler) is refused by name at the next step. torch keeps no step count for SGD: its
    state_dict converts both ways with the momentum buffers alone."""

    _torch_keeps_step = False
    _torch_group_keys = ("lr", "momentum", "dampening", "weight_decay")
    _torch_flags = ("nesterov", "maximize")

    def __init__(self, params: Iterable[Any], lr: float | torch.Tensor = 1e-3, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False, *,
                 maximize: bool = False, **options: Any) -> None:
        self._momentum = _number(momentum, "momentum") != 0
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                                      nesterov=nesterov, maximize=maximize), **options)

    @property
    def _torch_slots(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("momentum_buffer",) if self._momentum else ()

    def _rule_name(self) -> str:
        return "sgd_momentum" if self._momentum else "sgd"

    def _check_rule_group(self, group: dict[str, Any]) -> None:
        if (_number(group["momentum"], "momentum") != 0) != self._momentum:
            raise ValueError(f"{type(self).__name__}: every param group must have momentum "
                             f"{'> 0' if self._momentum else '= 0'}, as the defaults do (the rule, with or "
                             "without a momentum buffer, is chosen once, when the optimizer is made)")

    def _validate_hyper(self, group: dict[str, Any]) -> None:
        lr, momentum = _number(group["lr"], "lr"), _number(group["momentum"], "momentum")
        dampening, wd = _number(group["dampening"], "dampening"), _number(group["weight_decay"], "weight_decay")
        name = type(self).__name__
        if not lr >= 0:
            raise ValueError(f"{name}: invalid learning rate: {lr}")
        if not momentum >= 0:
            raise ValueError(f"{name}: invalid momentum value: {momentum}")
        if not wd >= 0:
            raise ValueError(f"{name}: invalid weight_decay value: {wd}")
        if not math.isfinite(dampening):
            raise ValueError(f"{name}: invalid dampening value: {dampening}")
        if group["nesterov"] and (momentum <= 0 or dampening != 0):
            raise ValueError(f"{name}: Nesterov momentum requires a momentum and zero dampening")

    def _torch_group_extras(self) -> dict[str, Any]:
        return dict(foreach=None, differentiable=False, fused=None)


class Lion(_OffloadedBase):
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms") as lion-pytorch
    applies it: decoupled weight decay, the sign of an interpolation of momentum and gradient,
    then the momentum's own decay; state offloaded. Its defaults are lion-pytorch's. PyTorch
    has no Lion: torch_state_dict() gives lion-pytorch's layout (exp_avg per param, no step),
    which load_state_dict() also takes."""

    _torch_keeps_step = False
    _torch_slots = ("exp_avg",)
    _torch_group_keys = ("lr", "betas", "weight_decay")

    def __init__(self, params: Iterable[Any], lr: float | torch.Tensor = 1e-4,
                 betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0, *,
                 maximize: bool = False, **options: Any) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay, maximize=maximize), **options)

    def _rule_name(self) -> str:
        return "lion"

    def _check_torch_group(self, g: dict[str, Any]) -> None:
        other = [k for k in ("eps", "amsgrad", "momentum", "dampening") if k in g]
        if other:
            raise ValueError(f"{type(self).__name__}: the state_dict's param groups have {other}: the state_dict "
                             "of another optimizer (Lion's has lr, betas and weight_decay)")

    def _validate_hyper(self, group: dict[str, Any]) -> None:
        beta1, beta2 = group["betas"]
        lr, b1, b2 = _number(group["lr"], "lr"), _number(beta1, "betas[0]"), _number(beta2, "betas[1]")
        wd = _number(group["weight_decay"], "weight_decay")
        name = type(self).__name__
        if not lr >= 0:
            raise ValueError(f"{name}: invalid learning rate {lr}")
        for i, b in enumerate((b1, b2)):
            if not 0 <= b <= 1:
                raise ValueError(f"{name}: invalid beta parameter at index {i}: {b} (must be in [0, 1])")
        if not wd >= 0:
            raise ValueError(f"{name}: invalid weight_decay value {wd}")


class Adafactor(_OffloadedBase):
    """torch.optim.Adafactor (PyTorch 2.11's semantics): a second moment factored into row and
    column statistics over the last two dimensions of every param of rank >= 2 (the leading
    ones a batch of matrices), kept whole for vectors; a relative step min(lr, 1/sqrt(t))
    scaled by the param's RMS; the update clipped by its RMS over d; decoupled weight decay
    lr * weight_decay. The params' master (bf16/fp16 params) is offloaded; the statistics, which
    are small (rows + columns per matrix), stay in host memory beside the optimizer. eps[0] =
    None is the machine epsilon of the dtype of the group's first param (torch's: of the first
    param with a gradient in that step; the two differ only for a group of several dtypes).
    state_dict() and torch_state_dict() give torch's layout (step, row_var and col_var, or
    variance), which load_state_dict() also takes. Unlike torch's, it takes a GradScaler's
    scale (the update divides it out)."""

    _torch_group_keys = ("lr", "beta2_decay", "eps", "d", "weight_decay")

    def __init__(self, params: Iterable[Any], lr: float | torch.Tensor = 1e-2, beta2_decay: float = -0.8,
                 eps: tuple[float | None, float] = (None, 1e-3), d: float = 1.0, weight_decay: float = 0.0, *,
                 foreach: bool | None = None, maximize: bool = False, **options: Any) -> None:
        super().__init__(params, dict(lr=lr, beta2_decay=beta2_decay, eps=eps, d=d, weight_decay=weight_decay,
                                      foreach=foreach, maximize=maximize), **options)

    def _rule_name(self) -> str:
        return "adafactor"

    def _hyper(self, group: dict[str, Any]) -> tuple:
        eps1, eps2 = group["eps"]
        if eps1 is None:  # torch: finfo(param.dtype).eps, of the first param it steps
            params = group.get("params") or []
            group = {**group, "eps": (torch.finfo(params[0].dtype if params else torch.float32).eps, eps2)}
        return super()._hyper(group)

    def _validate_hyper(self, group: dict[str, Any]) -> None:
        lr, beta2_decay = _number(group["lr"], "lr"), _number(group["beta2_decay"], "beta2_decay")
        if not isinstance(group["eps"], (tuple, list)) or len(group["eps"]) != 2:
            raise ValueError(f"{type(self).__name__}: eps must be a pair (epsilon1 or None, epsilon2), "
                             f"not {group['eps']!r}")
        eps1, eps2 = group["eps"]
        d, wd = _number(group["d"], "d"), _number(group["weight_decay"], "weight_decay")
        name = type(self).__name__
        if not 0.0 <= lr:
            raise ValueError(f"{name}: Learning rate should be >= 0 but is: {lr}")
        if not 0.0 >= beta2_decay:
            raise ValueError(f"{name}: beta2_decay should be <= 0 but is: {beta2_decay}")
        if eps1 is not None and not 0.0 <= _number(eps1, "eps[0]"):
            raise ValueError(f"{name}: epsilon1 should be >= 0 but is: {eps1}")
        if not 0.0 <= _number(eps2, "eps[1]"):
            raise ValueError(f"{name}: epsilon2 should be >= 0 but is: {eps2}")
        if not 1.0 <= d:
            raise ValueError(f"{name}: Clipping threshold d should be >= 1 but is: {d}")
        if not 0.0 <= wd:
            raise ValueError(f"{name}: weight_decay should be >= 0 but is: {wd}")

    def _check_torch_group(self, g: dict[str, Any]) -> None:
        other = [k for k in ("betas", "amsgrad", "momentum", "dampening") if k in g]
        if other:
            raise ValueError(f"{type(self).__name__}: the state_dict's param groups have {other}: the state_dict "
                             "of another optimizer (Adafactor's has lr, beta2_decay, eps, d and weight_decay)")

    # torch's state: row_var (..., R, 1) and col_var (..., 1, C) for a param of rank >= 2,
    # variance (its shape) for one of rank 0 or 1; the tensor state (rules/adafactor.hpp) is
    # rows, columns, each matrix's row mean and the step's scale, the last two made anew by
    # every step.

    @staticmethod
    def _matrices(p: torch.Tensor) -> tuple[int, int, int]:
        return math.prod(p.shape[:-2]), p.shape[-2], p.shape[-1]

    def _torch_tensor_keys(self, p: torch.Tensor) -> dict[str, int]:
        if p.dim() < 2:
            return {"variance": p.numel()}
        b, r, c = self._matrices(p)
        return {"row_var": b * r, "col_var": b * c}

    def _to_torch_tensor_state(self, p: torch.Tensor, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        out = lambda t, shape: t.reshape(shape).to(device=p.device, dtype=p.dtype)  # noqa: E731
        if p.dim() < 2:
            return {"variance": out(flat[:p.numel()], p.shape)}
        b, r, c = self._matrices(p)
        return {"row_var": out(flat[:b * r], (*p.shape[:-1], 1)),
                "col_var": out(flat[b * r:b * r + b * c], (*p.shape[:-2], 1, c))}

    def _from_torch_tensor_state(self, p: torch.Tensor, values: dict[str, torch.Tensor]) -> torch.Tensor:
        flat = lambda k, n: values[k].reshape(-1) if k in values else torch.zeros(n)  # noqa: E731
        if p.dim() < 2:
            return torch.cat([flat("variance", p.numel()), torch.zeros(1)])
        b, r, c = self._matrices(p)
        return torch.cat([flat("row_var", b * r), flat("col_var", b * c), torch.zeros(b + 1)])
