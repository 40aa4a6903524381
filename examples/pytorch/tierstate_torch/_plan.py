# SPDX-License-Identifier: Apache-2.0
"""tierstate_torch.plan(model): what fits where and how fast, before a long job starts. The model
is tierstate's planner (include/tierstate/plan/plan.hpp, the one `tierstate-plan` prints); this
side counts the model's parameters, reads the GPU's and the host's memory, and measures PCIe with
torch where a GPU is."""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_RULES = {"adamw": "adamw", "adam": "adam", "adam_amsgrad": "adam_amsgrad", "adamw_amsgrad": "adamw_amsgrad",
          "sgd": "sgd", "sgd_momentum": "sgd_momentum", "lion": "lion"}


@dataclass
class Plan:
    """The planner's answer. `compositions`: one dict per composition (name, fits, gpu_bytes,
    host_bytes, nvme_bytes, memlock_bytes, step_seconds or None, bound); `machine`: the memories
    and bandwidths it assumed, each bandwidth with its source; str(plan) is the table that
    `tierstate-plan` prints, and plan.json() its JSON lines."""
    compositions: list[dict[str, Any]]
    machine: dict[str, Any]
    params: int
    table: str = field(repr=False)
    json_lines: str = field(repr=False)

    def __str__(self) -> str:
        return self.table

    def json(self) -> str:
        """One JSON line per composition, for the record."""
        return self.json_lines

    @property
    def recommended(self) -> dict[str, Any] | None:
        """The first composition that fits, in the order of least offload (everything on the
        GPU, the state in host memory, the state on NVMe, the weights on NVMe too); None when
        none fits."""
        return next((c for c in self.compositions if c["fits"]), None)


def _count(model: Any) -> tuple[int, str | None, int | None]:
    """(parameters, their dtype's name, the length of the longest block list) of a module, or of
    an iterable of tensors; a number is a count."""
    if isinstance(model, (int, float)):
        if not model > 0 or model != model:
            raise ValueError(f"plan: a parameter count must be positive, not {model!r}")
        return int(model), None, None
    if isinstance(model, (str, bytes)):
        raise TypeError(f"plan: a model (torch.nn.Module), an iterable of parameters or a count, not str ({model!r}: "
                        "a count is a number, such as 7e9)")
    if isinstance(model, torch.nn.Module):
        params = [p for p in model.parameters() if p.requires_grad]
        blocks = [len(m) for m in model.modules() if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential))]
        layers = max(blocks) if blocks else None
    else:
        try:
            params = [p for p in model if p.requires_grad]
        except (TypeError, AttributeError):
            raise TypeError(f"plan: a model (torch.nn.Module), an iterable of parameters or a count, "
                            f"not {type(model).__name__}") from None
        layers = None
    if not params:
        raise ValueError("plan: the model has no parameter that requires a gradient")
    bytes_by_dtype: dict[torch.dtype, int] = {}
    for p in params:
        bytes_by_dtype[p.dtype] = bytes_by_dtype.get(p.dtype, 0) + p.numel()
    dtype = max(bytes_by_dtype, key=bytes_by_dtype.__getitem__)
    if dtype not in _DTYPES:
        raise ValueError(f"plan: parameters of {dtype} (tierstate keeps bfloat16, float16 or float32 params)")
    return sum(p.numel() for p in params), _DTYPES[dtype], layers


def _pcie_gb_s(nbytes: int = 256 << 20) -> float:
    """PCIe between pinned host memory and the current GPU, as the planner counts it: `nbytes` to
    the device and back on one stream, bytes moved per second, median of 5 after a warm-up."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    times = []
    for r in range(6):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()
        if r:
            times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times) / 1e9


def plan(model: Any, *, param: str | None = None, state: str = "fp32", master: str = "fp32", rule: str = "adamw",
         gpu_memory: float | None = None, host_memory: float | None = None, nvme: str | os.PathLike | None = None,
         nvme_capacity: float | None = None, layers: int | None = None, chunk_elements: int = 1 << 20,
         probe: bool = True, host_gb_s: float | None = None, disk_gb_s: float | None = None,
         pcie_gb_s: float | None = None, scratch_bytes: int = 256 << 20) -> Plan:
    """Which composition fits, the bytes on each tier, the pinned memory and memlock it needs, and
    a predicted step time, for `model` (a torch.nn.Module, its parameters, or a count).

    param: the params' format (bf16, fp16, fp32); by default the model's most common dtype.
    state: the rule's slots (fp32, bf16, int8); master: fp32, kahan or none; rule: adamw, adam,
    adam_amsgrad, adamw_amsgrad, sgd, sgd_momentum or lion. gpu_memory: bytes (the current GPU's
    by default, 24 GiB without one); host_memory: bytes (this machine's); nvme: a folder on the
    drive for the state (its free space from statvfs, or nvme_capacity); layers: blocks of the
    model (offloaded weights keep two on the GPU; by default the longest ModuleList or
    Sequential, else 32). probe: measure host memory, the disk under `nvme` through tierstate's
    engine, and PCIe (where a GPU is), a few seconds; a bandwidth given is not measured.
    Bad values raise ValueError naming them."""
    count, dtype, found_layers = _count(model)
    param = param or dtype or "bf16"
    rule = _RULES.get(str(rule).lower(), str(rule))
    if gpu_memory is None:
        gpu_memory = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory \
            if torch.cuda.is_available() else 24 * (1 << 30)
    if host_memory is None:
        host_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for name, value in (("gpu_memory", gpu_memory), ("host_memory", host_memory), ("nvme_capacity", nvme_capacity),
                        ("host_gb_s", host_gb_s), ("disk_gb_s", disk_gb_s), ("pcie_gb_s", pcie_gb_s)):
        if value is not None and not (isinstance(value, (int, float)) and value > 0):
            raise ValueError(f"plan: {name} must be a positive number, not {value!r}")
    pcie_source = "given"
    if pcie_gb_s is None and probe:
        if torch.cuda.is_available():
            pcie_gb_s, pcie_source = _pcie_gb_s(), f"measured ({torch.cuda.get_device_name()})"
        else:
            pcie_gb_s, pcie_source = 25.0, "assumed: torch sees no GPU"
    compositions, machine, table, lines = _ext().plan(
        params=float(count), param=param, state=state, master=master, rule=rule,
        layers=int(layers) if layers is not None else (found_layers or 32), chunk_elements=int(chunk_elements), gpu_bytes=float(gpu_memory),
        host_bytes=float(host_memory), nvme=os.fspath(nvme) if nvme is not None else "",
        nvme_free=float(nvme_capacity) if nvme_capacity is not None else None,
        host_gb_s=float(host_gb_s or 0), disk_gb_s=float(disk_gb_s or 0), pcie_gb_s=float(pcie_gb_s or 0),
        pcie_source=pcie_source, probe=bool(probe), scratch_bytes=int(scratch_bytes))
    return Plan(compositions=compositions, machine=machine, params=count, table=table, json_lines=lines)


def _ext():
    from ._common import _ext as ext
    return ext()


__all__ = ["Plan", "plan"]
