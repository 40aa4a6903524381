# SPDX-License-Identifier: Apache-2.0
"""torch.optim.Adam and AdamW with their state offloaded by tierstate.

    opt = tierstate_torch.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1,
                                tier="nvme", path="/mnt/nvme/scratch")

A drop-in replacement for torch.optim.AdamW (and Adam): param groups, LR schedulers,
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

What differs from torch.optim.AdamW:
- The state is not in `optimizer.state` (it is not made of tensors); read a slot with
  `get_state(param, "exp_avg")`, convert the whole state with `torch_state_dict()`.
- `state_dict()` carries tierstate checkpoints (master included) plus the param groups;
  `load_state_dict()` takes those, or a torch.optim.Adam(W) state_dict.
- The step count is one per optimizer (all params must step together): a param whose
  `.grad` is None in a step is left as it is, but the bias correction of its next step
  counts the steps it missed (torch counts per param).
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
- `close()` removes the hooks and releases the state (pinned memory, the scratch file)
  without waiting for the garbage collector; every call but close() then raises.
"""
from __future__ import annotations

import contextlib
import functools
import weakref
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ._build import load_extension

_C = None

# Which optimizer drives each parameter: the newest one made over it (held weakly, keyed by
# the tensor's identity: a parameter outlives the optimizers made over it).
_owners: "WeakIdKeyDictionary" = WeakIdKeyDictionary()


def _ext():
    global _C
    if _C is None:
        _C = load_extension()
    return _C


_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_TIERS = ("pinned", "nvme", "device")
_COMPUTES = ("host", "device")
_POLICIES = ("skip_step", "report", "ignore")
_FORMAT = "tierstate_torch/1"


def _number(x: Any, what: str) -> float:
    if torch.is_tensor(x):
        if x.numel() != 1:
            raise ValueError(f"tierstate_torch: {what} must be a number, not a tensor of {x.numel()} elements")
        return float(x.item())
    return float(x)


def _key_name(key: tuple) -> str:
    """A shard's name for messages (its dtype and device)."""
    return f"{_DTYPES[key[0]]}@{key[1]}"


def _on(device: torch.device):
    """The CUDA device current while a shard on it works (tierstate calls the runtime on the
    current device)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _stream(device: torch.device) -> int:
    """The stream PyTorch queues work on for `device` (its gradients are ready after it)."""
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


def _grad_hook(optimizer: "weakref.ref[_OffloadedAdamBase]", i: int, p: torch.Tensor) -> None:
    """The post-accumulate-grad hook. It holds its optimizer weakly: the params outlive an
    optimizer that is replaced, and a hook must neither keep it alive nor feed it steps (an
    optimizer replaced or closed removes its hooks, and ignores any that still runs)."""
    opt = optimizer()
    if opt is not None:
        opt._grad_hook(i, p)


class _OffloadedAdamBase(torch.optim.Optimizer):
    _decoupled: bool = True

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        tier: str = "pinned",
        path: str | os.PathLike | None = None,
        compute: str = "host",
        state_dtype: torch.dtype = torch.float32,
        chunk_elements: int = 1 << 20,
        threads: int = 0,
        max_grad_norm: float | None = None,
        on_nonfinite: str = "skip_step",
        delayed_update: bool = False,
        overlap_backward: bool = False,
        micro_batches: int = 1,
        grad_scaler: "torch.amp.GradScaler | None" = None,
    ) -> None:
        name = type(self).__name__
        if tier not in _TIERS:
            raise ValueError(f"{name}: tier must be one of {_TIERS}, not {tier!r}")
        if tier == "nvme":
            if path is None:
                raise ValueError(f"{name}: tier='nvme' needs path=, a directory for the scratch file")
            if not Path(path).is_dir():
                raise ValueError(f"{name}: path={str(path)!r} is not a directory")
        elif path is not None:
            raise ValueError(f"{name}: path= is for tier='nvme' (tier is {tier!r})")
        if compute not in _COMPUTES:
            raise ValueError(f"{name}: compute must be one of {_COMPUTES}, not {compute!r}")
        if tier == "device" and compute != "device":
            raise ValueError(f"{name}: tier='device' keeps the state where compute='device' updates it: "
                             "pass compute='device' (or offload to tier='pinned' or 'nvme')")
        if state_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"{name}: state_dtype must be torch.float32 or torch.bfloat16, not {state_dtype}")
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
        if grad_scaler is not None and on_nonfinite != "skip_step":
            raise ValueError(f"{name}: with a grad_scaler, on_nonfinite must be 'skip_step' (GradScaler "
                             "skips the steps whose gradients overflowed)")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize)
        self._shards: dict[torch.dtype, Any] | None = None
        self._closed = False
        self._replaced: str | None = None  # by what, over which params: for the messages
        super().__init__(params, defaults)
        self._options = dict(tier=tier, compute=compute, directory=str(path) if path is not None else "",
                             chunk_elements=int(chunk_elements), threads=int(threads),
                             max_grad_norm=float(max_grad_norm or 0.0), on_nonfinite=on_nonfinite,
                             delayed_update=bool(delayed_update))
        self._state_dtype = state_dtype
        self._emulated = os.environ.get("TIERSTATE_TORCH_EMULATED_DEVICE") == "1"
        self._amsgrad = bool(amsgrad)
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

    # -- one optimizer per parameter ----------------------------------------------------

    def _refuse_if(self, call: str, replaced: bool = False) -> None:
        """Raises when this optimizer was closed, or (`replaced`: for the calls that would
        touch the params or their gradients) replaced by a newer one."""
        name = f"{type(self).__name__}.{call}"
        if getattr(self, "_closed", False):
            raise RuntimeError(f"{name}: this optimizer was closed (close() removed its backward hooks and "
                               "released its state); make a new one over the parameters (load_state_dict "
                               "takes a state_dict() saved before close())")
        if replaced and getattr(self, "_replaced", None) is not None:
            raise RuntimeError(
                f"{name}: this optimizer was replaced by a newer tierstate_torch optimizer over the same "
                f"parameters ({self._replaced}): the newer one alone updates them now, and this one's backward "
                "hooks were removed. Step the newer one. This one's state can still be read (state_dict(), "
                "get_state(); new.load_state_dict(old.state_dict()) carries it over to a newer one with the same "
                "param groups); then close() this one")

    def _which(self, indices: list[int]) -> str:
        """Parameters by index (and name, when the groups were given named parameters)."""
        names = [n for g in self.param_groups for n in g.get("param_names", [None] * len(g["params"]))]
        shown = [f"{i} ({names[i]!r})" if i < len(names) and names[i] else str(i) for i in indices[:5]]
        more = f" and {len(indices) - 5} more" if len(indices) > 5 else ""
        return f"parameter{'s' if len(indices) > 1 else ''} {', '.join(shown)}{more}"

    def _owners_to_replace(self, params: list[torch.Tensor]) -> list[tuple["_OffloadedAdamBase", list[int]]]:
        """The live optimizers that drive some of `params` now, each with the indices (its
        own) of those params. Refuses, changing nothing, when one of them is in the middle
        of a streaming step: its update has begun, and only its step() can end it."""
        found: dict[int, tuple[_OffloadedAdamBase, list[int]]] = {}
        for j, p in enumerate(params):
            ref = _owners.get(p)
            other = None if ref is None else ref()
            if other is None or other is self or other._closed or other._replaced is not None:
                continue
            found.setdefault(id(other), (other, []))[1].append(j)
        out = []
        for other, mine in found.values():
            theirs = {id(q): i for i, q in enumerate(other._params())}
            at = sorted(theirs[id(params[j])] for j in mine)
            if other._streaming_scale is not None:
                ours = {id(q): i for i, q in enumerate(self._params())}
                which = self._which([ours[id(params[j])] for j in mine])
                raise RuntimeError(
                    f"{type(self).__name__}: {which} {'belong' if len(mine) > 1 else 'belongs'} to another "
                    f"tierstate_torch optimizer (an {type(other).__name__}: its {other._which(at)}), which is "
                    "in the middle of a streaming step: backward handed it gradients through its "
                    "overlap_backward hooks, and its step() has not been called, so its update has begun. "
                    "Call its step() first (or make this optimizer before backward); this one then replaces it")
            out.append((other, at))
        return out

    def _take_over(self, params: list[torch.Tensor],
                   replacing: list[tuple["_OffloadedAdamBase", list[int]]]) -> None:
        """Makes this optimizer the one that drives `params`; the ones it replaces write a
        delayed update in flight first, then stop (their hooks removed)."""
        for other, _ in replacing:
            other.flush()
        me = weakref.ref(self)
        for p in params:
            _owners[p] = me
        for other, theirs in replacing:
            other._remove_hooks()
            other._replaced = f"an {type(self).__name__} made over its {other._which(theirs)}"

    def _install_hooks(self) -> None:
        """overlap_backward: a post-accumulate-grad hook on every param that takes gradients."""
        for i, p in enumerate(self._params()):
            if p.requires_grad:  # a frozen param never gets a gradient (nor a hook)
                hook = functools.partial(_grad_hook, weakref.ref(self), i)
                self._hooks.append(p.register_post_accumulate_grad_hook(hook))

    def _remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def close(self) -> None:
        """Ends this optimizer: removes its backward hooks, gives up its parameters (a new
        optimizer over them is no replacement) and releases its state (the tier's memory, the
        NVMe scratch file) now rather than when it is garbage collected. A delayed update in
        flight is written into the params first, completing the step() it was given, as
        flush() does. During a streaming step (overlap_backward: backward handed gradients
        over and step() has not been called) close() is refused and changes nothing: the
        update has already begun on the params; call step() to finish it, then close().
        Closing twice is harmless; every other call on a closed optimizer raises."""
        if self._closed:
            return
        if self._streaming_scale is not None:
            raise RuntimeError(
                f"{type(self).__name__}.close: close() during a streaming step: backward handed gradients "
                "over (overlap_backward) and step() has not been called, and the update has already begun "
                "on the params; call step() to finish it, then close()")
        self.flush()
        self._remove_hooks()
        for p in self._params():
            ref = _owners.get(p)
            if ref is not None and ref() is self:
                del _owners[p]
        self._shards = None  # the C++ optimizers go with their last reference
        self._where, self._members, self._group_ids = [], {}, {}
        self._pushed.clear()
        self._closed = True

    def _check_group(self, group: dict[str, Any]) -> None:
        name = type(self).__name__
        if bool(group["amsgrad"]) != self._amsgrad:
            raise ValueError(f"{name}: every param group must have amsgrad={self._amsgrad} (the rule is "
                             "chosen once, when the optimizer is made)")
        for p in group["params"]:
            if self._options["compute"] == "device" and p.device.type == "cpu" and not self._emulated:
                raise ValueError(f"{name}: compute='device' updates CUDA parameters; a parameter is on cpu "
                                 "(use compute='host')")
            if p.dtype not in _DTYPES:
                raise ValueError(f"{name}: a parameter of dtype {p.dtype}: float32, bfloat16 and float16 are supported")
            if p.device.type not in ("cpu", "cuda"):
                raise ValueError(f"{name}: a parameter is on {p.device}; CPU and CUDA parameters are supported")
        self._hyper(group)  # validates now rather than at the first step

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _hyper(self, group: dict[str, Any]):
        beta1, beta2 = group["betas"]
        values = (_number(group["lr"], "lr"), _number(beta1, "betas[0]"), _number(beta2, "betas[1]"),
                  _number(group["eps"], "eps"), _number(group["weight_decay"], "weight_decay"),
                  bool(group["maximize"]))
        lr, b1, b2, eps, wd, _ = values
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
        return values

    def __del__(self) -> None:
        for handle in getattr(self, "_hooks", []):
            handle.remove()

    def _device_params(self, p: torch.Tensor) -> bool:
        return p.is_cuda or self._emulated

    def _build(self) -> None:
        """Makes one shard per parameter dtype and device, registers every param and its group."""
        if self._shards is not None:
            return
        C = _ext()
        name = type(self).__name__
        if self._emulated and not C.device_is_emulated():
            raise RuntimeError(f"{name}: TIERSTATE_TORCH_EMULATED_DEVICE=1 needs the build without CUDA "
                               "(TIERSTATE_TORCH_CUDA=0)")
        params = self._params()
        if len({id(p) for p in params}) != len(params):
            raise ValueError(f"{name}: a parameter appears twice")
        shards: dict[tuple, Any] = {}
        self._where: list[tuple[tuple, int]] = []  # per global index: (shard key, tensor)
        members: dict[tuple, list[int]] = {}
        defaults = self._hyper(self.defaults)
        for i, p in enumerate(params):
            if not p.is_contiguous():
                raise ValueError(f"{name}: parameter {i} is not contiguous")
            if p.is_cuda and C.device_is_emulated():
                raise ValueError(f"{name}: parameter {i} is on {p.device}, but the extension was built "
                                 "without CUDA (TIERSTATE_TORCH_CUDA=0, or torch.cuda was not available)")
            if self._options["compute"] == "device" and not self._device_params(p):
                raise ValueError(f"{name}: compute='device' updates CUDA parameters; parameter {i} is on "
                                 f"{p.device} (use compute='host')")
            key = (p.dtype, p.device)
            if key not in shards:
                with _on(p.device):
                    shards[key] = C.Shard(
                        decoupled=self._decoupled, amsgrad=self._amsgrad, param_dtype=p.dtype,
                        state_dtype=self._state_dtype, device_params=self._device_params(p),
                        defaults=C.Hyper(*defaults), **self._options)
                members[key] = []
            with _on(p.device):
                t = shards[key].add_tensor(f"p{i}", p.detach())
            self._where.append((key, t))
            members[key].append(i)
        self._group_ids: dict[tuple[tuple, int], int] = {}
        i = 0
        for gi, group in enumerate(self.param_groups):
            by_key: dict[tuple, list[str]] = {}
            for p in group["params"]:
                by_key.setdefault((p.dtype, p.device), []).append(f"p{i}")
                i += 1
            for key, names in by_key.items():
                self._group_ids[(key, gi)] = shards[key].add_group(C.Hyper(*self._hyper(group)), names)
        if len(shards) > 1 and self._options["max_grad_norm"] > 0:
            raise ValueError(f"{name}: max_grad_norm with parameters of several dtypes or devices "
                             f"({', '.join(_key_name(k) for k in shards)}): clip with "
                             "torch.nn.utils.clip_grad_norm_ before step() instead")
        if len(shards) > 1 and self._overlap:
            raise ValueError(f"{name}: overlap_backward with parameters of several dtypes or devices "
                             f"({', '.join(_key_name(k) for k in shards)}): each would check its own "
                             "gradients for inf/NaN and could step while another skips; use one dtype, "
                             "or overlap_backward=False")
        self._shards = shards
        self._members = members
        self._versions = [p._version for p in params]
        self._masters = any("master" in shard.slot_names() for shard in shards.values())
        if self._overlap:  # (the hooks: _install_hooks, once the params are this optimizer's)
            self._arrivals = [0] * len(params)
            self._grad_versions: list[int | None] = [None] * len(params)

    def _push_hyperparameters(self, force: bool = False) -> None:
        """Hands the groups' hyper-parameters to the shards when they changed (schedulers)."""
        C = _ext()
        for gi, group in enumerate(self.param_groups):
            values = self._hyper(group)
            if not force and self._pushed.get(gi) == values:
                continue
            for key, shard in self._shards.items():
                g = self._group_ids.get((key, gi))
                if g is not None:
                    shard.set_hyperparameters(g, C.Hyper(*values))
            self._pushed[gi] = values

    def _sync_masters(self) -> None:
        """A bf16/fp16 param changed in place since the last step (load_state_dict, a
        clamp, an EMA swap: anything that bumps its version counter; not edits through
        `.data`, which bypass it) gets its fp32 master from it where the two now disagree, so
        the next update starts from the param the user sees, as torch's would. Elements the
        edit left as they were keep their master's full precision."""
        params = self._params()
        for i, p in enumerate(params):
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
                self._versions[i] = p._version

    def _note_versions(self) -> None:
        self._versions = [p._version for p in self._params()]

    def _check_memory(self) -> None:
        for i, p in enumerate(self._params()):
            key, t = self._where[i]
            if (p.dtype, p.device) != key or not self._shards[key].same_memory(t, p):
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
            for key2, shard in self._shards.items():
                with _on(key2[1]):
                    shard.begin_step(scale, self._micro_batches)
            self._streaming_scale = scale
        with _on(key[1]):
            self._shards[key].grad_ready(t, p.grad, _stream(key[1]))
        self._arrivals[i] += 1
        self._grad_versions[i] = p.grad._version

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
            return self._step(closure)
        except BaseException:
            self._forget_amp()
            raise

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
        if found_inf:  # GradScaler's skip: nothing changes, the step count included
            self.last_step = {"skipped": True, "found_nonfinite": True, "step": self.step_count()}
            return loss
        self._sync_masters()
        self._push_hyperparameters()
        params = self._params()
        if len(self._shards) > 1 and self._options["on_nonfinite"] == "skip_step":
            # One shard must not step while another skips.
            grads = [p.grad for p in params if p.grad is not None]
            if grads and not all(bool(torch.isfinite(g).all()) for g in grads):
                self.last_step = {"skipped": True, "found_nonfinite": True, "step": self.step_count()}
                return loss
        results = []
        for key, shard in self._shards.items():
            grads = [params[i].grad for i in self._members[key]]
            with _on(key[1]):
                results.append(shard.step(grads, scale, _stream(key[1])))
        self._note_versions()
        self.last_step = self._combine(results)
        return loss

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
            # torch steps every param whose .grad is set: one used in fewer than micro_batches
            # backward passes (or given a .grad by hand) is handed over now, as it is.
            for i, p in enumerate(params):
                if p.grad is not None and self._arrivals[i] < self._micro_batches:
                    key, t = self._where[i]
                    with _on(key[1]):
                        while self._arrivals[i] < self._micro_batches:
                            self._shards[key].grad_ready(t, p.grad, _stream(key[1]))
                            self._arrivals[i] += 1
                elif self._grad_versions[i] is not None and (p.grad is None or
                                                             p.grad._version != self._grad_versions[i]):
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

    def step_count(self) -> int:
        self._refuse_if("step_count")
        return 0 if self._shards is None else next(iter(self._shards.values())).step_count()

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
        key, _ = self._where[i]
        with _on(key[1]):
            return self._shards[key].get_state(f"p{i}", slot).view(param.shape)

    def _index(self, param: torch.Tensor) -> int:
        for i, p in enumerate(self._params()):
            if p is param:
                return i
        raise ValueError(f"{type(self).__name__}: the tensor is not one of this optimizer's parameters")

    # -- state_dict ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The param groups (as torch.optim keeps them) and one tierstate checkpoint per dtype."""
        self._refuse_if("state_dict")
        self._build()
        sd = super().state_dict()
        shards = {}
        with tempfile.TemporaryDirectory(prefix="tierstate-sd-") as d:
            for n, (key, shard) in enumerate(self._shards.items()):
                f = Path(d) / f"{n}.tsck"
                with _on(key[1]):
                    shard.save(str(f))
                data = torch.frombuffer(bytearray(f.read_bytes()), dtype=torch.uint8)
                # Named by dtype and members, not device: it loads on another GPU, or the CPU.
                shards[self._saved_name(key)] = {"checkpoint": data, "params": list(self._members[key])}
        sd["tierstate"] = {"format": _FORMAT, "shards": shards}
        return sd

    def _saved_name(self, key: tuple) -> str:
        return f"{_DTYPES[key[0]]}/{self._members[key][0]}"

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Takes a state_dict() of this class, or a torch.optim.Adam/AdamW state_dict."""
        self._refuse_if("load_state_dict", replaced=True)
        if "tierstate" not in state_dict:
            self._load_torch_state_dict(state_dict)
            return
        ts = state_dict["tierstate"]
        if ts.get("format") != _FORMAT:
            raise ValueError(f"{type(self).__name__}: a state_dict of format {ts.get('format')!r}; "
                             f"this is {_FORMAT}")
        self._build()
        ours = {self._saved_name(key): key for key in self._shards}
        if set(ts["shards"]) != set(ours):
            raise ValueError(f"{type(self).__name__}: the state_dict has state for parameters of "
                             f"{sorted(ts['shards'])}; this optimizer's are {sorted(ours)}")
        for key, info in ts["shards"].items():
            if list(info["params"]) != self._members[ours[key]]:
                raise ValueError(f"{type(self).__name__}: the state_dict's {key} parameters are "
                                 f"{list(info['params'])}; this optimizer's are {self._members[ours[key]]}")
        sizes = [len(g["params"]) for g in state_dict["param_groups"]]
        if sizes != [len(g["params"]) for g in self.param_groups]:
            raise ValueError(f"{type(self).__name__}: the state_dict's param groups have {sizes} params; "
                             f"this optimizer's have {[len(g['params']) for g in self.param_groups]}")
        # Each shard's load checks everything before it changes anything; with several, the
        # ones loaded before a failing one are put back from a copy made first.
        with tempfile.TemporaryDirectory(prefix="tierstate-sd-") as d:
            backups = {}
            if len(self._shards) > 1:
                for n, (key, shard) in enumerate(self._shards.items()):
                    backups[key] = Path(d) / f"backup-{n}.tsck"
                    with _on(key[1]):
                        shard.save(str(backups[key]))
            done = []
            for n, (name, info) in enumerate(ts["shards"].items()):
                f = Path(d) / f"{n}.tsck"
                f.write_bytes(info["checkpoint"].cpu().numpy().tobytes())
                key = ours[name]
                try:
                    with _on(key[1]):
                        self._shards[key].load(str(f))
                except Exception as e:
                    for k in done:
                        with _on(k[1]):
                            self._shards[k].load(str(backups[k]))
                    raise type(e)(f"{type(self).__name__}.load_state_dict: the checkpoint of the "
                                  f"{_key_name(key)} parameters: {e}") from e
                done.append(key)
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        self._note_versions()
        self._pushed.clear()
        self._push_hyperparameters(force=True)

    def torch_state_dict(self) -> dict[str, Any]:
        """The state as torch.optim.Adam/AdamW keeps it, loadable by one over the same params.
        The moments are in each param's dtype, as torch keeps them; a master is not kept."""
        self._refuse_if("torch_state_dict")
        self._build()  # (get_state flushes a delayed update itself)
        groups = []
        index = 0
        for group in self.param_groups:
            g = {k: v for k, v in group.items() if k != "params"}
            g.update(foreach=None, capturable=False, differentiable=False, fused=None,
                     decoupled_weight_decay=self._decoupled)
            g["params"] = list(range(index, index + len(group["params"])))
            index += len(group["params"])
            groups.append(g)
        state: dict[int, dict[str, torch.Tensor]] = {}
        steps = self.step_count()
        if steps > 0:
            slots = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if self._amsgrad else [])
            for i, p in enumerate(self._params()):
                key, _ = self._where[i]
                s = {"step": torch.tensor(float(steps), dtype=torch.float32)}
                for slot in slots:
                    with _on(key[1]):
                        value = self._shards[key].get_state(f"p{i}", slot)
                    s[slot] = value.view(p.shape).to(device=p.device, dtype=p.dtype)
                state[i] = s
        return {"state": state, "param_groups": groups}

    def _load_torch_state_dict(self, sd: dict[str, Any]) -> None:
        name = type(self).__name__
        if "param_groups" not in sd or "state" not in sd:
            raise ValueError(f"{name}: not a state_dict (no 'state' and 'param_groups')")
        self._build()
        for g in sd["param_groups"]:
            if bool(g.get("amsgrad", False)) != self._amsgrad:
                raise ValueError(f"{name}: the state_dict has amsgrad={g.get('amsgrad')}; this optimizer "
                                 f"has amsgrad={self._amsgrad}")
            decoupled = bool(g.get("decoupled_weight_decay", False))
            if decoupled != self._decoupled and _number(g.get("weight_decay", 0), "weight_decay") != 0:
                raise ValueError(f"{name}: the state_dict is torch.optim."
                                 f"{'AdamW' if decoupled else 'Adam'}'s with weight decay; this is "
                                 f"{'AdamW' if self._decoupled else 'Adam'}")
        params = self._params()
        state = sd["state"]
        steps = {int(_number(s["step"], "step")) for s in state.values()}
        if len(steps) > 1 or (state and len(state) != len(params)):
            raise ValueError(f"{name}: the state_dict's params have different step counts "
                             f"({sorted(steps)}, {len(state)} of {len(params)} params with state); "
                             "this optimizer keeps one step count for all")
        super().load_state_dict({"state": {}, "param_groups": [
            {k: v for k, v in g.items() if k in ("lr", "betas", "eps", "weight_decay", "amsgrad",
                                                 "maximize", "params", "initial_lr", "param_names")}
            for g in sd["param_groups"]]})
        # The param indices now match (torch's load checked the group sizes).
        slots = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if self._amsgrad else [])
        for i, p in enumerate(params):
            key, _ = self._where[i]
            shard = self._shards[key]
            s = state.get(i, state.get(str(i)))
            with _on(key[1]):
                if "master" in shard.slot_names():
                    shard.set_state(f"p{i}", "master", p.detach().reshape(-1))
                for slot in slots:
                    value = torch.zeros(p.numel()) if s is None else s[slot].reshape(-1)
                    shard.set_state(f"p{i}", slot, value)
        n = steps.pop() if steps else 0
        for key, shard in self._shards.items():
            with _on(key[1]):
                shard.set_step_count(n)
        self._note_versions()
        self._pushed.clear()
        self._push_hyperparameters(force=True)


class AdamW(_OffloadedAdamBase):
    """torch.optim.AdamW (decoupled weight decay, default 1e-2), state offloaded."""

    _decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False,
                 **kwargs) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)


class Adam(_OffloadedAdamBase):
    """torch.optim.Adam (L2 weight decay, default 0), state offloaded."""

    _decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False,
                 **kwargs) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kwargs)
