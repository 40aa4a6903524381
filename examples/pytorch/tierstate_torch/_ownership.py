# SPDX-License-Identifier: Apache-2.0
"""One optimizer per parameter: the newest tierstate_torch optimizer made over a parameter
drives it (an older one is told it was replaced), the overlap_backward hooks, and close()."""
from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

# Which optimizer drives each parameter: the newest one made over it (held weakly, keyed by
# the tensor's identity: a parameter outlives the optimizers made over it).
_owners: "WeakIdKeyDictionary" = WeakIdKeyDictionary()


def _grad_hook(optimizer: "weakref.ref[Any]", i: int, p: torch.Tensor) -> None:
    """The post-accumulate-grad hook. It holds its optimizer weakly: the params outlive an
    optimizer that is replaced, and a hook must neither keep it alive nor feed it steps (an
    optimizer replaced or closed removes its hooks, and ignores any that still runs)."""
    opt = optimizer()
    if opt is not None:
        opt._grad_hook(i, p)


class _Ownership:
    """The optimizer's side of ownership (a mixin of _OffloadedBase)."""

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

    def _owners_to_replace(self, params: list[torch.Tensor]) -> list[tuple["_Ownership", list[int]]]:
        """The live optimizers that drive some of `params` now, each with the indices (its
        own) of those params. Refuses, changing nothing, when one of them is in the middle
        of a streaming step: its update has begun, and only its step() can end it."""
        found: dict[int, tuple[_Ownership, list[int]]] = {}
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
                   replacing: list[tuple["_Ownership", list[int]]]) -> None:
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
        self._remove_made_dir()
        if getattr(self, "_ranks", None) is not None:  # (its shards, which call its hooks, are gone)
            self._ranks.close()
