# SPDX-License-Identifier: Apache-2.0
"""bitsandbytes' optimizer state_dicts as torch's, so that load_state_dict takes a checkpoint of
bnb.optim.AdamW8bit, Adam8bit, Lion8bit or SGD8bit (and their 32-bit and paged forms): each
param's state1/state2 (8-bit codes with their map, qmap, and one absmax per block, or fp32
for a tensor under min_8bit_size) decoded to fp32 moments under torch's names, and each param
group's numbers under torch's keys. bitsandbytes need not be installed: the decoding is
codes -> qmap[code] * absmax[block]."""
from __future__ import annotations

import math
from typing import Any

import torch

_QUANT_KEY = "__bnb_optimizer_quant_state__"  # bnb >= 0.44 wraps a param's state under it
#: block sizes bitsandbytes' blockwise 8-bit optimizers have used (256 today, 2048 before)
_BLOCK_SIZES = (256, 2048, 4096, 1024, 512, 128, 64)
#: what a bnb param state holds besides the moments and the step: read (the maps and
#: scales) or without meaning here (max_unorm's norm, percentile clipping's history)
_AUX = {"qmap1", "qmap2", "absmax1", "absmax2", "max1", "max2", "new_max1", "new_max2", "unorm_vec",
        "gnorm_vec"}


def is_bitsandbytes(sd: Any) -> bool:
    """Whether `sd` is a bitsandbytes optimizer's state_dict (a param state with state1)."""
    if not isinstance(sd, dict) or not isinstance(sd.get("state"), dict):
        return False
    return any(isinstance(s, dict) and (_QUANT_KEY in s or "state1" in s) for s in sd["state"].values())


def _decode(name: str, where: str, s: dict[str, Any], i: int) -> torch.Tensor:
    """state{i} as fp32 values (their count is checked against the param's by the torch load)."""
    codes = s[f"state{i}"]
    if not torch.is_tensor(codes):
        raise ValueError(f"{name}: the bitsandbytes state_dict's {where}['state{i}'] is not a tensor")
    codes = codes.detach().reshape(-1)
    if codes.is_floating_point():
        return codes.to("cpu", torch.float32)
    if codes.dtype != torch.uint8 or f"qmap{i}" not in s:
        raise ValueError(f"{name}: the bitsandbytes state_dict's {where}['state{i}'] is {codes.dtype} without "
                         f"qmap{i}: neither fp32 state nor 8-bit codes with their map")
    qmap = s[f"qmap{i}"].detach().to("cpu", torch.float32).reshape(-1)
    if qmap.numel() != 256:
        raise ValueError(f"{name}: the bitsandbytes state_dict's {where}['qmap{i}'] has {qmap.numel()} values, "
                         "not 256")
    values = qmap[codes.to("cpu").long()]
    n = values.numel()
    if f"absmax{i}" in s:  # blockwise: one scale per block
        absmax = s[f"absmax{i}"].detach().to("cpu", torch.float32).reshape(-1)
        size = next((b for b in _BLOCK_SIZES if math.ceil(n / b) == absmax.numel()), None)
        if size is None:
            raise ValueError(f"{name}: the bitsandbytes state_dict's {where}['absmax{i}'] has {absmax.numel()} "
                             f"blocks for {n} elements: no block size of {list(_BLOCK_SIZES)} gives that")
        return values * absmax.repeat_interleave(size)[:n]
    if f"max{i}" in s:  # one scale for the tensor (block_wise=False)
        return values * s[f"max{i}"].detach().to("cpu", torch.float32).reshape(-1)[0]
    raise ValueError(f"{name}: the bitsandbytes state_dict's {where} has 8-bit state{i} but neither absmax{i} "
                     f"nor max{i}")


def to_torch(opt: Any, sd: dict[str, Any]) -> dict[str, Any]:
    """`sd` (a bitsandbytes optimizer's state_dict) as the state_dict of the torch optimizer
    that `opt` stands in for; nothing in `sd` is changed. Raises ValueError naming what does
    not fit."""
    name = type(opt).__name__
    rule = opt._rule_name()
    family = "adam" if rule.startswith("adam") else rule
    if family not in ("adam", "lion", "sgd_momentum") or rule.endswith("amsgrad"):
        raise ValueError(f"{name}: a bitsandbytes state_dict loads into AdamW, Adam (without amsgrad), Lion and SGD "
                         f"with momentum; this optimizer's rule is {rule!r}")
    slots = opt._torch_slots
    groups = []
    for g in sd.get("param_groups", []):
        if "betas" not in g:
            raise ValueError(f"{name}: the bitsandbytes state_dict's param groups have no 'betas'")
        out = {k: g[k] for k in ("lr", "weight_decay", "params", "initial_lr", "param_names") if k in g}
        if family == "adam":
            # bitsandbytes' Adam8bit, like its AdamW8bit, decays the weights decoupled.
            out.update(betas=tuple(g["betas"]), eps=g.get("eps", 1e-8), amsgrad=False, maximize=False,
                       decoupled_weight_decay=True)
        elif family == "lion":
            out.update(betas=tuple(g["betas"]))
        else:  # SGD8bit keeps (momentum, dampening) as betas, but its update uses neither
            # dampening nor Nesterov (buf = momentum * buf + g): what it ran, not what it was given
            out.update(momentum=g["betas"][0], dampening=0.0, nesterov=False, maximize=False)
        groups.append(out)
    state: dict[Any, dict[str, Any]] = {}
    for key, raw in sd["state"].items():
        if not isinstance(raw, dict):
            raise ValueError(f"{name}: the bitsandbytes state_dict's state[{key!r}] is not a dict")
        s = {k: v for k, v in raw.items() if k != _QUANT_KEY}
        s.update(raw.get(_QUANT_KEY, {}))
        where = f"state[{key!r}]"
        moments = sorted(k for k in s if k.startswith("state") and k[5:].isdigit())
        if moments != [f"state{i + 1}" for i in range(len(slots))]:
            raise ValueError(f"{name}: the bitsandbytes state_dict's {where} has {moments}; {name} keeps "
                             f"{len(slots)} moment{'s' if len(slots) != 1 else ''} ({list(slots)}): the state of "
                             "another optimizer")
        extra = sorted(set(s) - set(moments) - _AUX - {"step"})
        if extra:
            raise ValueError(f"{name}: the bitsandbytes state_dict's {where} has {extra}, which no bitsandbytes "
                             "optimizer that this one stands in for keeps")
        t = {slot: _decode(name, where, s, i + 1) for i, slot in enumerate(slots)}
        if opt._torch_keeps_step:
            t["step"] = torch.tensor(float(s.get("step", 0)))
        state[key] = t
    return {"state": state, "param_groups": groups}
