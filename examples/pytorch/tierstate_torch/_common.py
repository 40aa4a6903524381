# SPDX-License-Identifier: Apache-2.0
"""What the optimizer's parts share: the extension, the options' vocabularies, and small
helpers for numbers, devices and streams."""
from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import Any

import torch

from ._build import load_extension

_C = None


def _ext():
    global _C
    if _C is None:
        _C = load_extension()
    return _C


_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
#: state_dtype's choices (the moments: fp32, bf16, or 8-bit blocks), as dtypes and as strings
_STATE_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.int8: "int8"}
_STATE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                "bf16": torch.bfloat16, "int8": torch.int8}
#: master's choices: an fp32 master, a bf16 Kahan compensation slot, or stochastic rounding
_MASTERS = ("fp32", "kahan", "stochastic")
_TIERS = ("pinned", "nvme", "device")
_COMPUTES = ("host", "device")
_POLICIES = ("skip_step", "report", "ignore")
_FORMAT = "tierstate_torch/1"


def _check_tier(name: str, tier: str, path: Any, tiers: tuple[str, ...]) -> None:
    """A tier among `tiers`, with path= (an existing directory) for "nvme" only; ValueError
    naming `name`'s option otherwise."""
    if tier not in tiers:
        raise ValueError(f"{name}: tier must be one of {tiers}, not {tier!r}")
    if tier == "nvme":
        if path is None:
            raise ValueError(f"{name}: tier='nvme' needs path=, a directory for the scratch files")
        if not Path(path).is_dir():
            raise ValueError(f"{name}: path={str(path)!r} is not a directory")
    elif path is not None:
        raise ValueError(f"{name}: path= is for tier='nvme' (tier is {tier!r})")


def _number(x: Any, what: str) -> float:
    if torch.is_tensor(x):
        if x.numel() != 1:
            raise ValueError(f"tierstate_torch: {what} must be a number, not a tensor of {x.numel()} elements")
        return float(x.item())
    return float(x)


def _table_values(group: dict[str, Any], names: list[str]) -> tuple:
    """A param group's numbers in the order of the rule's hyper-parameter table, whose names
    are torch.optim's keys ("lr", "betas[0]": an element of a tuple); a flag as 0 or 1."""
    values = []
    for n in names:
        m = re.fullmatch(r"(\w+)\[(\d+)\]", n)
        v = group[m[1]][int(m[2])] if m else group[n]
        values.append(float(v) if isinstance(v, bool) else _number(v, n))
    return tuple(values)


def _state_dtype(x: Any, what: str) -> torch.dtype:
    """A state_dtype given as a dtype or its name; ValueError naming `what` otherwise."""
    if isinstance(x, str) and x in _STATE_NAMES:
        return _STATE_NAMES[x]
    if isinstance(x, torch.dtype) and x in _STATE_DTYPES:
        return x
    raise ValueError(f"{what} must be torch.float32, torch.bfloat16 or torch.int8 (or 'float32', 'bfloat16', "
                     f"'int8'), not {x!r}")


def _checked_format(state_dtype: Any, master: Any, least: Any, where: str) -> tuple[torch.dtype, str, int]:
    """state_dtype (a dtype or its name), master and min_8bit_size, checked; ValueError naming
    each as `where` + its name (the optimizer's, or a param group's) otherwise."""
    state = _state_dtype(state_dtype, f"{where}state_dtype")
    if master not in _MASTERS:
        raise ValueError(f"{where}master must be one of {_MASTERS}, not {master!r}")
    if not (isinstance(least, int) and not isinstance(least, bool) and least >= 0):
        raise ValueError(f"{where}min_8bit_size must be an int >= 0, not {least!r}")
    return state, master, least


def _format_suffix(key: tuple, compact_only: bool = False) -> str:
    """A shard key's state format where it is not the default (fp32 state, fp32 master); with
    `compact_only`, only 8-bit state and a master other than fp32 (a state_dict's shard names:
    those of bf16 state kept the plain name, which checkpoints made before these formats have)."""
    state, master = key[2], key[3]
    named = state == torch.int8 or (state != torch.float32 and not compact_only)
    return ((f", {_STATE_DTYPES[state]} state" if named else "") +
            (f", {master} master" if master != "fp32" else ""))


def _key_name(key: tuple) -> str:
    """A shard's name for messages: its dtype and device, and its state's format."""
    return f"{_DTYPES[key[0]]}@{key[1]}{_format_suffix(key)}"


def _on(device: torch.device):
    """The CUDA device current while a shard on it works (tierstate calls the runtime on the
    current device)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _stream(device: torch.device) -> int:
    """The stream PyTorch queues work on for `device` (its gradients are ready after it)."""
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
