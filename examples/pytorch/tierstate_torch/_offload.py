# SPDX-License-Identifier: Apache-2.0
"""offload_parameters: a model's weights rest in pinned host memory or on NVMe (tierstate's
offloaded_params) and are brought back one layer at a time, just before the layer's forward
and its backward, by module hooks; the tierstate optimizers update the offloaded copies.

Between uses a parameter keeps its shape, dtype and device, but its data is a placeholder of
one NaN broadcast to its shape (reads give NaN, writes are refused by torch): its values are
in the store. Read and write them with `read()`, `write()`, the model's own `state_dict()` and
`load_state_dict()` (both hooked), `export_state_dict()`, or `save_safetensors()` (shard by
shard, for export).

Fetching copies a layer from the store's window (read ahead on the store's I/O thread) into
storage of the parameter's own, which is freed again when the layer's forward, or its
backward, is done: views of a parameter that autograd saved see the values again when
backward fetches the layer (the storage is resized in place, as FSDP2's is)."""
from __future__ import annotations

import json
import os
import sys
import weakref
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ._common import _DTYPES, _check_tier, _ext

_STORE_TIERS = ("pinned", "nvme")
_DYNAMO_FRAME = os.path.join("_dynamo", "eval_frame.py")  # (torch.compile's wrapper frames)


def _stream_of(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


def _in_backward() -> bool:
    return torch._C._current_autograd_node() is not None


class _Layer:
    """One layer of one store: the params it holds, each with the storage it is fetched into."""

    def __init__(self, store: Any, lid: int, device: torch.device) -> None:
        self.store, self.lid, self.device = store, lid, device
        self.params: list[nn.Parameter] = []
        self.fulls: list[torch.Tensor] = []
        self.holds = 0


class _Unit:
    """A module whose forward and backward fetch the layers of its params (its own, and
    those it shares with an earlier unit: tied weights)."""

    def __init__(self, name: str, module: nn.Module, direct: bool) -> None:
        self.name, self.module = name, module
        self.direct = direct  # not a layer: a module that owns params itself (its own only)
        self.layers: list[_Layer] = []
        self.own: list[nn.Parameter] = []      # params whose layer is this unit's
        self.foreign: list[nn.Parameter] = []  # params of an earlier unit's layer it uses too
        self.pending = 0                       # holds its backward releases when done
        self.signals_left = 0                  # input signals (_BackwardDone) its backward still awaits
        self.call_wrapped: list[bool] = []     # per forward in progress: its inputs carry the signal
        self.grads_left: set[int] = set()
        self.pass_id = -1
        self.open_calls = 0  # forwards begun (fetched) and not ended


class _BackwardDone(torch.autograd.Function):
    """Identity on a unit's inputs: its backward runs once the unit's backward has made every
    input's gradient, which says the unit's params are no longer read."""

    @staticmethod
    def forward(ctx, signal, *tensors):
        ctx.signal = signal
        return tensors if len(tensors) != 1 else tensors[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.signal()
        return (None, *grads)


class OffloadedParameters:
    """What offload_parameters() returns: the stores, the hooks, and the model's values."""

    def __init__(self, model: nn.Module, *, tier: str, path: str | os.PathLike | None, window: int,
                 layers: Iterable[type] | None, persistence_threshold: int, write_behind_bytes: int,
                 init: Callable[[nn.Module], None] | None, state_dict: Mapping[str, torch.Tensor] | str | os.PathLike | None,
                 device: torch.device | str | None) -> None:
        name = "offload_parameters"
        if not isinstance(model, nn.Module):
            raise TypeError(f"{name}: model must be a torch.nn.Module, not {type(model).__name__}")
        _check_tier(name, tier, path, _STORE_TIERS)
        if not (isinstance(window, int) and 1 <= window <= 64):
            raise ValueError(f"{name}: window must be an int in 1..64 (layers read ahead), not {window!r}")
        if not (isinstance(persistence_threshold, int) and persistence_threshold >= 0):
            raise ValueError(f"{name}: persistence_threshold must be an int >= 0, not {persistence_threshold!r}")
        params = dict(model.named_parameters(remove_duplicate=True))
        if not params:
            raise ValueError(f"{name}: the model has no parameters")
        for pname, p in params.items():
            if getattr(p, "_tierstate_offload", None) is not None:
                raise ValueError(f"{name}: parameter {pname!r} is offloaded already")
            if p.dtype not in _DTYPES:
                raise ValueError(f"{name}: parameter {pname!r} is {p.dtype}; float32, bfloat16 and float16 are offloaded")
        devices = {p.device.type for p in params.values()}
        meta = devices == {"meta"}
        if len(devices) != 1 or not devices <= {"cpu", "cuda", "meta"}:
            raise ValueError(f"{name}: the parameters are on {sorted(devices)}: all on the CPU, all on one CUDA "
                             "device, or all on the meta device (with init= or state_dict=)")
        if not meta and (init is not None or state_dict is not None):
            raise ValueError(f"{name}: init= and state_dict= build a model made on the meta device; this one's "
                             f"parameters are on {next(iter(devices))} (they are offloaded with their values)")
        self._emulated = os.environ.get("TIERSTATE_TORCH_EMULATED_DEVICE") == "1"
        if meta:
            device = torch.device(device if device is not None else "cpu")
            if device.type not in ("cpu", "cuda"):
                raise ValueError(f"{name}: device= must be the CPU or a CUDA device, not {device}")
        elif device is not None:
            raise ValueError(f"{name}: device= is for a model on the meta device (the parameters are on "
                             f"{next(iter(devices))})")
        else:
            device = next(iter(params.values())).device
        self.device = device
        self._model = weakref.ref(model)
        # (a bad state_dict= is refused before any store or file is made)
        source = _lazy_state_dict(state_dict) if state_dict is not None else None
        self._options = dict(tier=tier, directory=str(path) if path is not None else "", window=window,
                             persistence_threshold=persistence_threshold, write_behind_bytes=write_behind_bytes,
                             device_buffers=device.type == "cuda" or self._emulated)
        self._stores: dict[torch.dtype, Any] = {}
        self._where: dict[int, tuple[Any, int, str]] = {}  # id(param): (store, tensor id, name)
        self._names: dict[str, nn.Parameter] = {}          # every name of a param (tied ones too)
        self._meta_of: dict[int, nn.Parameter] = {}
        self._meta_buffers: list[tuple[nn.Module, str, torch.Tensor]] = []
        # (a refusal puts each param back as it was: its data, or the meta param it replaced)
        originals = {id(p): p.data for p in params.values()} if not meta else {}
        try:
            if meta:
                self._adopt(model)
            self._units = self._find_units(model, layers)
            self._register(model)
            for store in self._stores.values():
                store.materialize()
            self._fill(model, meta, init, source)
        except BaseException:
            self._undo(model, meta, originals)
            self._stores.clear()  # (their files go with them)
            raise
        self._pass = 0
        self._in_pass = False
        self._edited: set[int] = set()
        self._handles: list[Any] = []
        self._install(model)

    def _adopt(self, model: nn.Module) -> None:
        """A model on the meta device: each param becomes one on this device holding the
        placeholder (the same object wherever it is tied)."""
        made: dict[int, nn.Parameter] = {}
        for m in model.modules():
            for k, p in m._parameters.items():
                if p is not None and p.is_meta:
                    if id(p) not in made:
                        made[id(p)] = nn.Parameter(self._placeholder(p), requires_grad=p.requires_grad)
                        self._meta_of[id(made[id(p)])] = p
                    m._parameters[k] = made[id(p)]

    # -- the layout ---------------------------------------------------------------------

    @staticmethod
    def _find_units(model: nn.Module, layers: Iterable[type] | None) -> list[_Unit]:
        """The layers: the modules of the classes given, or the children of every ModuleList
        and Sequential (a transformer's blocks), outermost first; then every other module
        that owns params directly (embeddings, the final norm, the head)."""
        if layers is not None:
            classes = tuple(layers)
            if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
                raise ValueError("offload_parameters: layers= must name nn.Module classes")
            chosen = [(n, m) for n, m in model.named_modules() if isinstance(m, classes) and m is not model]
        else:
            chosen = [(f"{n}.{c}" if n else c, child) for n, m in model.named_modules()
                      if isinstance(m, (nn.ModuleList, nn.Sequential)) for c, child in m.named_children()]
        units: list[_Unit] = []
        inside: set[int] = set()
        for n, m in chosen:  # named_modules is pre-order: an outer layer comes before its insides
            if id(m) in inside or not any(True for _ in m.parameters()):
                continue  # (inside another, or without params: a ReLU, a Dropout)
            units.append(_Unit(n, m, direct=False))
            inside.update(id(x) for x in m.modules())
        for n, m in model.named_modules():
            if id(m) not in inside and any(True for _ in m.parameters(recurse=False)):
                units.append(_Unit(n or "<root>", m, direct=True))
        if not units:
            raise ValueError("offload_parameters: no layer of the classes given holds a parameter")
        return units

    def _register(self, model: nn.Module) -> None:
        C = _ext()
        owner: dict[int, _Layer] = {}
        qualified = {id(p): n for n, p in model.named_parameters(remove_duplicate=True)}
        for n, p in model.named_parameters(remove_duplicate=False):
            self._names[n] = p
        for u in self._units:
            mine: dict[torch.dtype, _Layer] = {}
            for p in u.module.parameters(recurse=not u.direct):
                if id(p) in owner:
                    if owner[id(p)] not in u.layers:
                        u.layers.append(owner[id(p)])
                    if all(p is not q for q in u.foreign + u.own):
                        u.foreign.append(p)
                    continue
                if p.dtype not in self._stores:
                    self._stores[p.dtype] = C.ParamStore(param_dtype=p.dtype, **self._options)
                store = self._stores[p.dtype]
                if p.dtype not in mine:
                    mine[p.dtype] = _Layer(store, store.add_layer(u.name), self.device)
                    u.layers.insert(len(mine) - 1, mine[p.dtype])
                layer = mine[p.dtype]
                tid = store.add_tensor(layer.lid, qualified[id(p)], p.numel())
                layer.params.append(p)
                owner[id(p)] = layer
                u.own.append(p)
                self._where[id(p)] = (store, tid, qualified[id(p)])

    def _undo(self, model: nn.Module, meta: bool, originals: dict[int, torch.Tensor]) -> None:
        """A refused offload_parameters: each param as it was (a meta model's its meta param
        and meta buffers; the others their own data)."""
        for m in model.modules():
            for k, p in m._parameters.items():
                if p is None:
                    continue
                p.__dict__.pop("_tierstate_offload", None)
                if meta:
                    m._parameters[k] = self._meta_of.get(id(p), p)
                elif id(p) in originals:
                    p.data = originals[id(p)]
        for m, k, b in self._meta_buffers:
            m._buffers[k] = b

    # -- values -------------------------------------------------------------------------

    def _placeholder(self, p: torch.Tensor) -> torch.Tensor:
        nan = torch.full((1,) if p.dim() else (), float("nan"), dtype=p.dtype, device=self.device)
        return nan.expand(p.shape) if p.dim() else nan

    def _fill(self, model: nn.Module, meta: bool, init: Callable[[nn.Module], None] | None,
              state_dict: Any) -> None:
        """Writes every param's first values into its store, unit by unit, and leaves its
        placeholder: from the param itself, or, for a model on the meta device, from
        `state_dict` (a mapping, or a torch.save file read lazily) or `init` (each module of the
        unit made on the device empty, then init(module); default: its reset_parameters())."""
        source = state_dict  # (a Mapping: __init__'s _lazy_state_dict)
        names_of: dict[int, list[str]] = {}
        for n, p in self._names.items():
            names_of.setdefault(id(p), []).append(n)
        done = self._filled = set()
        for u in self._units:
            todo = [p for layer in u.layers for p in layer.params if id(p) not in done]
            if not todo:
                continue
            if meta and source is None:  # made empty, then initialized, module by module
                modules = [u.module] if u.direct else list(u.module.modules())
                ours = {id(p) for p in todo}
                for m in modules:
                    for p in m.parameters(recurse=False):
                        if id(p) in ours:
                            p.data = torch.empty(p.shape, dtype=p.dtype, device=self.device)
                        elif id(p) in self._where:  # an earlier layer's (tied): its values, not written again
                            store, tid, _ = self._where[id(p)]
                            p.data = store.read(tid).view(p.shape).to(self.device)
                    for k, b in m._buffers.items():
                        if b is not None and b.is_meta:
                            self._meta_buffers.append((m, k, b))
                            m._buffers[k] = torch.empty_like(b, device=self.device)
                with torch.no_grad():
                    for m in modules:
                        if init is not None:
                            init(m)
                        elif hasattr(m, "reset_parameters"):
                            m.reset_parameters()
                        elif any(id(p) in ours for p in m.parameters(recurse=False)):
                            first = next(n for n, q in model.named_parameters() if any(q is p for p in
                                                                                     m.parameters(recurse=False)))
                            raise ValueError(f"offload_parameters: parameter {first!r} belongs to a "
                                             f"{type(m).__name__}, which has no reset_parameters() to make its "
                                             "values: pass init= (called on each module) or state_dict=")
            for p in todo:
                store, tid, qname = self._where[id(p)]
                if meta and source is not None:
                    value = None
                    for n in names_of[id(p)]:
                        if n in source:
                            value = source[n]
                            break
                    if value is None:
                        raise KeyError(f"offload_parameters: state_dict has no entry for {qname!r}")
                    if tuple(value.shape) != tuple(p.shape):
                        raise ValueError(f"offload_parameters: state_dict's {qname!r} has shape {tuple(value.shape)}; "
                                         f"the parameter's is {tuple(p.shape)}")
                else:
                    value = p.detach()
                store.write(tid, value.reshape(-1))
                done.add(id(p))
            self._empty(u)
        for layer in {id(layer): layer for u in self._units for layer in u.layers}.values():
            layer.fulls = [torch.empty(p.shape, dtype=p.dtype, device=self.device) for p in layer.params]
            for f in layer.fulls:
                f.untyped_storage().resize_(0)
        if meta:  # the buffers still on the meta device: from state_dict, else made by init or reset_parameters
            for n, m in model.named_modules():
                missing = []
                for bn, b in list(m._buffers.items()):
                    if b is not None and b.is_meta:
                        full = f"{n}.{bn}" if n else bn
                        self._meta_buffers.append((m, bn, b))
                        if source is not None and full in source:
                            m._buffers[bn] = source[full].to(self.device, copy=True)
                        else:
                            m._buffers[bn] = torch.empty_like(b, device=self.device)
                            missing.append(full)
                if missing:
                    with torch.no_grad():
                        if init is not None:
                            init(m)
                        elif hasattr(m, "reset_parameters") and not any(True for _ in m.parameters(recurse=False)):
                            m.reset_parameters()
                        else:
                            raise ValueError(
                                f"offload_parameters: buffer {missing[0]!r} is on the meta device and nothing gives "
                                "it a value: state_dict= has no entry for it, and its module has no "
                                "reset_parameters() (a buffer made in __init__, such as rotary frequencies, is lost "
                                "on the meta device): pass init=, called on its module, to make it")
        for store in self._stores.values():
            store.flush()

    def _empty(self, u: _Unit) -> None:
        for layer in u.layers:
            for p in layer.params:
                p.data = self._placeholder(p)
                p._tierstate_offload = self  # type: ignore[attr-defined]

    # -- fetch and release ----------------------------------------------------------------

    def _fetch(self, u: _Unit) -> None:
        taken: list[_Layer] = []
        try:
            for layer in u.layers:
                if layer.holds == 0:
                    for f in layer.fulls:
                        f.untyped_storage().resize_(f.numel() * f.element_size())
                    stream = _stream_of(layer.device)
                    try:
                        layer.store.fetch(layer.lid, layer.fulls, stream)
                    except BaseException:
                        for f in layer.fulls:
                            f.untyped_storage().resize_(0)
                        raise
                    layer.store.release(layer.lid, stream)  # (copied: the window may reuse its buffer)
                    for p, f in zip(layer.params, layer.fulls):
                        p.data = f
                layer.holds += 1
                taken.append(layer)
        except BaseException:
            for layer in taken:  # (a fetch that failed holds nothing)
                layer.holds -= 1
                if layer.holds == 0:
                    self._drop(layer)
            raise

    def _drop(self, layer: _Layer) -> None:
        layer.holds = 0
        for p, f in zip(layer.params, layer.fulls):
            p.data = self._placeholder(p)
            f.untyped_storage().resize_(0)

    def _release(self, u: _Unit, times: int = 1) -> None:
        for layer in u.layers:
            if layer.holds < times:
                raise RuntimeError(f"offload_parameters: layer {u.name!r} released more often than fetched")
            layer.holds -= times
            if layer.holds == 0:
                self._drop(layer)

    # -- hooks --------------------------------------------------------------------------

    def _install(self, model: nn.Module) -> None:
        for u in self._units:
            self._handles.append(u.module.register_forward_pre_hook(
                lambda m, args, kwargs, u=u: self._pre_forward(u, args, kwargs), with_kwargs=True, prepend=True))
            self._handles.append(u.module.register_forward_hook(
                lambda m, args, out, u=u: self._post_forward(u, out), always_call=True))
            for p in u.own + u.foreign:
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(
                        lambda p, u=u: self._accumulated(u, p)))
        # (first of the root's pre-hooks: a pass's order begins before its first fetch)
        self._handles.append(model.register_forward_pre_hook(self._root_pre_forward, prepend=True))
        self._loaded: set[str] = set()  # (keys the load in progress wrote: not missing)
        self._handles.append(model._register_load_state_dict_pre_hook(lambda *a: self._loaded.clear()))
        for m in model.modules():  # (each module with offloaded params of its own: a submodule's state_dict too)
            if any(id(p) in self._where for p in m.parameters(recurse=False)):
                self._handles.append(m._register_state_dict_hook(self._state_dict_hook))
                self._handles.append(m._register_load_state_dict_pre_hook(self._load_pre_hook, with_module=True))
                self._handles.append(m.register_load_state_dict_post_hook(self._load_post_hook))

    def _refuse_compile(self, look: bool = False) -> None:
        """Refuses torch.compile: tracing (is_compiling), or (`look`: the root's forward) a
        compiled module's frames on the stack, whose graph breaks run the hooks eagerly."""
        compiled = torch.compiler.is_compiling()
        frame = sys._getframe(1) if look and not compiled else None
        while frame is not None and not compiled:
            compiled = frame.f_code.co_filename.endswith(_DYNAMO_FRAME)
            frame = frame.f_back
        if compiled:
            raise RuntimeError("offload_parameters: a model with offloaded parameters runs eagerly: its hooks "
                               "swap each parameter's storage, which torch.compile cannot trace (compile the "
                               "layers' insides instead, or do not compile)")

    def _root_pre_forward(self, module: nn.Module, args: Any) -> None:
        self._refuse_compile(look=True)
        if not _in_backward():
            if self._in_pass:  # the last backward raised before its end: what it held is let go
                self._end_backward()
            if any(u.open_calls for u in self._units) or any(layer.holds for layer in self._layers()):
                self._reset_holds()  # a forward interrupted (KeyboardInterrupt): fetched again from the store
            for store in self._stores.values():
                store.end_iteration()  # a new pass: the last one's order is the one read ahead

    def _layers(self) -> list[_Layer]:
        return list({id(layer): layer for u in self._units for layer in u.layers}.values())

    def _reset_holds(self) -> None:
        for u in self._units:
            u.open_calls, u.pending, u.signals_left = 0, 0, 0
            u.call_wrapped.clear()
        for layer in self._layers():
            if layer.holds:
                layer.holds = 1
                self._drop(layer)

    def _pre_forward(self, u: _Unit, args: Any, kwargs: Any):
        self._refuse_compile()
        self._fetch(u)
        u.open_calls += 1
        wrapped = False
        result = None
        if torch.is_grad_enabled():
            flat, spec = tree_flatten((args, kwargs))
            where = [i for i, x in enumerate(flat) if torch.is_tensor(x) and x.requires_grad]
            if where:
                out = _BackwardDone.apply(lambda u=u: self._inputs_done(u), *[flat[i] for i in where])
                for i, x in zip(where, out if len(where) != 1 else (out,)):
                    flat[i] = x
                wrapped = True
                result = spec.unflatten(flat)
        u.call_wrapped.append(wrapped)
        return result

    def _post_forward(self, u: _Unit, out: Any) -> None:
        if u.open_calls == 0:
            return  # (always_call: a forward refused before this unit's pre-hook fetched)
        u.open_calls -= 1
        wrapped = u.call_wrapped.pop() if u.call_wrapped else False
        node = torch._C._current_autograd_node()
        if node is not None:
            # A recomputation (activation checkpointing): held until the unit's backward is done.
            # Non-reentrant (inside a built-in node, unpacking what it saved): the original
            # forward's signal says so. Reentrant (inside a Function's backward, which runs a
            # backward of its own over what it recomputed): this forward's signal, or its params'
            # gradients.
            self._start_backward(u, wrapped)
            u.pending += 1
            if isinstance(node, torch.autograd.function.BackwardCFunction):
                if wrapped:
                    u.signals_left += 1
                else:
                    u.grads_left |= {id(p) for p in u.own + u.foreign if p.requires_grad}
            return
        self._release(u)
        outputs = [x for x in tree_flatten(out)[0] if torch.is_tensor(x) and x.requires_grad]
        if outputs and torch.is_grad_enabled():
            fired = {"pass": -1}  # once per backward pass over this call (retain_graph: again)

            def pre_backward(grad, u=u, fired=fired, wrapped=wrapped):
                if fired["pass"] != self._pass or not self._in_pass:
                    fired["pass"] = self._pass
                    self._pre_backward(u, wrapped)
                return grad

            for x in outputs:
                x.register_hook(pre_backward)

    def _start_backward(self, u: _Unit, wrapped: bool) -> None:
        if not self._in_pass:
            self._in_pass = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        if u.pass_id != self._pass:
            u.pass_id = self._pass
            u.signals_left = 0
            u.grads_left = {id(p) for p in u.own if p.requires_grad}
        if not wrapped:  # no input signal: the params it reads (tied ones too) must have their gradients
            u.grads_left |= {id(p) for p in u.foreign if p.requires_grad}

    def _pre_backward(self, u: _Unit, wrapped: bool) -> None:
        if torch.is_grad_enabled():
            raise RuntimeError(f"offload_parameters: a backward with create_graph=True through layer {u.name!r}: "
                               "its double backward would read the offloaded parameters after their release, "
                               "which is not supported (gradient penalties need the parameters in memory)")
        self._start_backward(u, wrapped)
        self._fetch(u)
        u.pending += 1
        if wrapped:
            u.signals_left += 1

    def _inputs_done(self, u: _Unit) -> None:
        u.signals_left = max(0, u.signals_left - 1)
        self._try_release(u)

    def _accumulated(self, u: _Unit, p: torch.Tensor) -> None:
        u.grads_left.discard(id(p))
        self._try_release(u)

    def _try_release(self, u: _Unit) -> None:
        if u.pending and u.signals_left == 0 and not u.grads_left and u.pass_id == self._pass:
            self._release(u, u.pending)
            u.pending = 0

    def _end_backward(self) -> None:
        """The end of a backward pass: what is still held is released (a unit whose backward
        gave no signal: one without inputs or params needing gradients, or with a param that
        got none in this pass)."""
        for u in self._units:
            if u.pending:
                self._release(u, u.pending)
                u.pending = 0
            u.signals_left = 0
        self._in_pass = False
        self._pass += 1

    # -- values, for users ----------------------------------------------------------------

    def _entry(self, name: str) -> tuple[nn.Parameter, Any, int]:
        p = self._names.get(name)
        if p is None:
            raise KeyError(f"offload_parameters: no offloaded parameter named {name!r}")
        store, tid, _ = self._where[id(p)]
        return p, store, tid

    def read(self, name: str) -> torch.Tensor:
        """The values of parameter `name` (a copy, on the CPU, in the parameter's shape)."""
        p, store, tid = self._entry(name)
        return store.read(tid).view(p.shape)

    def write(self, name: str, value: torch.Tensor) -> None:
        """Replaces parameter `name`'s values (the optimizers' masters follow at their next step)."""
        p, store, tid = self._entry(name)
        if tuple(value.shape) != tuple(p.shape):
            raise ValueError(f"offload_parameters: {name!r} has shape {tuple(p.shape)}, the value {tuple(value.shape)}")
        if any(layer.holds for u in self._units for layer in u.layers if any(q is p for q in layer.params)):
            raise RuntimeError(f"offload_parameters: {name!r} is in use (inside its layer's forward or backward)")
        store.write(tid, value.detach().reshape(-1))
        self._edited.add(id(p))

    def take_edited(self, p: torch.Tensor) -> bool:
        """Whether `p` was written (write(), load_state_dict) since the last call for it."""
        if id(p) in self._edited:
            self._edited.discard(id(p))
            return True
        return False

    def source(self, p: torch.Tensor) -> tuple[Any, int, str]:
        """(store, tensor id, name) of an offloaded parameter: what an optimizer registers."""
        return self._where[id(p)]

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state_dict with every offloaded parameter's values (CPU copies)."""
        model = self._model()
        return model.state_dict() if model is not None else {}

    def save_safetensors(self, directory: str | os.PathLike, *, max_shard_bytes: int = 1 << 30) -> list[Path]:
        """Writes the model's parameters and persistent buffers to `directory` as safetensors,
        one shard at a time: each offloaded weight read from its store, a tied weight once (under
        its first name in the model's module order), the other params and the buffers as they
        are. Shards hold at most `max_shard_bytes` (a larger tensor alone in its own); while one
        is written, about twice that is in memory (safetensors' save_file copies each tensor
        into its bytes). One shard is model.safetensors, several are
        model-0000k-of-0000n.safetensors with model.safetensors.index.json (Hugging Face's
        layout, which offload_parameters(state_dict=directory) and transformers read). Each file
        is written under a temporary name and renamed into place when all are written, and then
        an earlier export's files that this one does not replace (its shards, its index, or its
        single file) are removed, so that no reader finds stale weights: an error while writing
        (a full disk) leaves what was there before. Returns the files."""
        from safetensors.torch import save_file  # (PyPI's safetensors: needed for this alone)

        model = self._model()
        if model is None:
            raise RuntimeError("save_safetensors: the model is gone")
        if not (isinstance(max_shard_bytes, int) and max_shard_bytes > 0):
            raise ValueError(f"save_safetensors: max_shard_bytes must be a positive int, not {max_shard_bytes!r}")
        out = Path(directory)
        if not out.is_dir():
            raise ValueError(f"save_safetensors: {str(out)!r} is not a directory")
        entries: list[tuple[str, Any, int]] = []  # (name, tensor or param, bytes)
        seen: set[int] = set()
        for prefix, m in model.named_modules():
            dot = prefix + "." if prefix else ""
            for k, p in m._parameters.items():
                if p is not None and id(p) not in seen:
                    seen.add(id(p))
                    entries.append((dot + k, p, p.numel() * p.element_size()))
            for k, b in m._buffers.items():
                if b is not None and k not in m._non_persistent_buffers_set and id(b) not in seen:
                    seen.add(id(b))
                    entries.append((dot + k, b, b.numel() * b.element_size()))
        shards: list[list[tuple[str, Any, int]]] = [[]]
        for e in entries:
            if shards[-1] and sum(x[2] for x in shards[-1]) + e[2] > max_shard_bytes:
                shards.append([])
            shards[-1].append(e)
        n = len(shards)
        names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        temps: list[Path] = []
        try:
            for name, shard in zip(names, shards):
                values = {}
                for key, t, _ in shard:
                    if id(t) in self._where:
                        store, tid, _ = self._where[id(t)]
                        values[key] = store.read(tid).view(t.shape)
                    else:
                        values[key] = t.detach().to("cpu").contiguous()
                temps.append(out / f".{name}.tmp")
                save_file(values, temps[-1], metadata={"format": "pt"})
                del values
            if n > 1:
                index = {"metadata": {"total_size": sum(e[2] for e in entries)},
                         "weight_map": {key: name for name, shard in zip(names, shards) for key, _, _ in shard}}
                temps.append(out / ".model.safetensors.index.json.tmp")
                temps[-1].write_text(json.dumps(index, indent=2))
                names.append("model.safetensors.index.json")
        except BaseException:
            for t in temps:
                t.unlink(missing_ok=True)
            raise
        index_name = "model.safetensors.index.json"
        if n == 1:  # (an earlier index first: a reader prefers it to model.safetensors)
            (out / index_name).unlink(missing_ok=True)
        for t, name in zip(temps, names):
            os.replace(t, out / name)
        stale = [f for f in out.glob("model-*-of-*.safetensors") if f.name not in names]
        if n > 1:
            stale.append(out / "model.safetensors")
        for f in stale:
            f.unlink(missing_ok=True)
        return [out / name for name in names]

    def flush(self) -> None:
        for store in self._stores.values():
            store.flush()

    def stats(self) -> dict[str, Any]:
        """The stores' window statistics and memory, summed over dtypes."""
        out: dict[str, Any] = {}
        for store in self._stores.values():
            for k, v in store.stats().items():
                out[k] = out.get(k, 0) + v
        return out

    def _state_dict_hook(self, module, state_dict, prefix, local_metadata):
        for k, p in module._parameters.items():
            if p is not None and id(p) in self._where and prefix + k in state_dict:
                store, tid, _ = self._where[id(p)]
                state_dict[prefix + k] = store.read(tid).view(p.shape).to(self.device)
        return state_dict

    def _load_pre_hook(self, module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        for k, p in module._parameters.items():
            key = prefix + k
            if p is None or id(p) not in self._where or key not in state_dict:
                continue
            value = state_dict.pop(key)
            if not torch.is_tensor(value) or tuple(value.shape) != tuple(p.shape):
                got = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
                errors.append(f"size mismatch for {key}: copying a param with shape {got} from checkpoint, the "
                              f"shape in current model is {tuple(p.shape)}.")
                continue
            self.write(self._where[id(p)][2], value)
            self._loaded.add(key)

    def _load_post_hook(self, module, incompatible):
        incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if k not in self._loaded]

    def close(self) -> None:
        """Removes the hooks (the params keep their placeholders: the values stay in the stores)."""
        for h in self._handles:
            h.remove()
        self._handles = []


class _LazyFile(Mapping):
    """A torch.save file's tensors, memory-mapped: each read when asked for."""

    def __init__(self, path: str | os.PathLike) -> None:
        self._sd = torch.load(path, map_location="cpu", mmap=True, weights_only=True)

    def __getitem__(self, k):
        return self._sd[k]

    def __iter__(self):
        return iter(self._sd)

    def __len__(self):
        return len(self._sd)

    def __contains__(self, k) -> bool:
        return k in self._sd


class _Safetensors(Mapping):
    """safetensors files' tensors (a file, or the shards an index names): each read when asked for."""

    def __init__(self, file_of: dict[str, Path]) -> None:
        self._file_of = file_of
        self._path: Path | None = None
        self._handle: Any = None  # (one file open at a time: its mapped pages count as memory)

    def __getitem__(self, k):
        from safetensors import safe_open

        path = self._file_of[k]
        if path != self._path:
            self._handle = None
            self._handle, self._path = safe_open(str(path), framework="pt"), path
        try:
            return self._handle.get_tensor(k)
        except Exception as e:  # noqa: BLE001 (safetensors' own error types vary by version)
            raise KeyError(f"offload_parameters: the safetensors index names {path.name!r} for {k!r}, which "
                           f"does not hold it: {e}") from None

    def __contains__(self, k) -> bool:
        return k in self._file_of

    def __iter__(self):
        return iter(self._file_of)

    def __len__(self):
        return len(self._file_of)


def _safetensors(path: Path) -> _Safetensors:
    """A .safetensors file, an index (.json, Hugging Face's weight_map), or a directory that
    holds model.safetensors.index.json or *.safetensors files."""
    try:
        from safetensors import safe_open
    except ImportError:
        raise ImportError(f"offload_parameters: state_dict={str(path)!r} is safetensors, and reading it needs the "
                          "safetensors package (pip install safetensors)") from None
    if path.is_dir():
        index = path / "model.safetensors.index.json"
        files = [index] if index.is_file() else sorted(path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"offload_parameters: state_dict={str(path)!r} is a directory with no "
                             "model.safetensors.index.json and no .safetensors file")
    else:
        files = [path]
    file_of: dict[str, Path] = {}
    for f in files:
        if f.suffix == ".json":
            try:
                weight_map = json.loads(f.read_text())["weight_map"]
                if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                    raise TypeError("its weight_map is not an object of file names")
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"offload_parameters: {str(f)!r} is not a safetensors index (a JSON object with "
                                 f"a weight_map): {e}") from None
            for k, shard in weight_map.items():
                if not (f.parent / shard).is_file():
                    raise ValueError(f"offload_parameters: {str(f)!r} names {shard!r} for {k!r}, and there is no "
                                     "such file beside it")
                file_of[k] = f.parent / shard
        else:
            try:
                with safe_open(str(f), framework="pt") as h:
                    keys = list(h.keys())
            except Exception as e:  # noqa: BLE001 (safetensors' own error types vary by version)
                raise ValueError(f"offload_parameters: {str(f)!r} is not a readable safetensors file: {e}") from None
            file_of.update((k, f) for k in keys)
    return _Safetensors(file_of)


def _lazy_state_dict(sd: Any) -> Mapping:
    if isinstance(sd, Mapping):
        return sd
    if isinstance(sd, (str, os.PathLike)):
        path = Path(sd)
        if path.is_dir() or path.suffix in (".safetensors", ".json"):
            if not path.exists():
                raise ValueError(f"offload_parameters: state_dict={str(sd)!r} does not exist")
            return _safetensors(path)
        if not path.is_file():
            raise ValueError(f"offload_parameters: state_dict={str(sd)!r} is not a file")
        return _LazyFile(sd)
    raise TypeError(f"offload_parameters: state_dict= is a mapping of tensors, a torch.save file's path, or "
                    "safetensors (a .safetensors file, an index .json, or a directory of them), "
                    f"not {type(sd).__name__}")


def offload_parameters(model: nn.Module, tier: str = "pinned", path: str | os.PathLike | None = None, *,
                       window: int = 2, layers: Iterable[type] | None = None, persistence_threshold: int = 0,
                       write_behind_bytes: int = 64 << 20, init: Callable[[nn.Module], None] | None = None,
                       state_dict: Mapping[str, torch.Tensor] | str | os.PathLike | None = None,
                       device: torch.device | str | None = None) -> OffloadedParameters:
    """Moves `model`'s parameters into a tier ("pinned": host memory; "nvme": files in `path`)
    and installs the hooks that bring each layer back for its forward and backward, `window`
    layers read ahead. Call it before making the optimizer; the tierstate optimizers then
    update the offloaded copies (with overlap_backward=True, each layer's gradient goes to the
    store as backward makes it, and the trainer's copy is freed).

    layers: the classes whose modules are layers (default: the children of each ModuleList and
    Sequential); every other module that owns parameters is a layer of its own.
    A model made on the meta device is built layer by layer in the tier, never whole in memory:
    from `state_dict` (a mapping; a torch.save file, read memory-mapped; or safetensors: a
    .safetensors file, an index .json, or a directory of them, read tensor by tensor) or `init` (called
    on each module of a layer, made empty; default: the module's reset_parameters), its params
    then computed on `device` (default: the CPU)."""
    return OffloadedParameters(model, tier=tier, path=path, window=window, layers=layers,
                               persistence_threshold=persistence_threshold, write_behind_bytes=write_behind_bytes,
                               init=init, state_dict=state_dict, device=device)
