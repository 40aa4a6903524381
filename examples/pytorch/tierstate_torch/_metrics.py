# SPDX-License-Identifier: Apache-2.0
"""Per-step metrics for TensorBoard or W&B (optimizer's metrics=f), and the drive's wear.

ZeRO-Infinity-style offload rewrites the whole optimizer state every step: a 7B model's
bf16-mixed AdamW state (12 bytes per parameter) is 84 GB written per step. `metrics` adds
to each step's numbers the bytes written so far and the rate per day at the pace of the run,
and `drive_wear(path)` says how much the drive under `path` has written and how worn it
reports itself, from its NVMe SMART log (nvme-cli's `nvme smart-log`, where installed and
permitted): a day's writes can then be set against the drive's life."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from typing import Any, Callable

Metrics = Callable[[dict], None]


class StepMetrics:
    """What metrics=f hears after each step: step()'s own numbers (optimizer.last_step), plus
    `state_bytes_written_total` and, from the second step on, `state_bytes_written_per_day`
    (the writes since the first step over the wall time since then, times a day)."""

    def __init__(self, f: Metrics):
        self._f = f
        self._first: float | None = None
        self._total = 0
        self._since_first = 0

    def __call__(self, last_step: dict[str, Any]) -> None:
        s = dict(last_step)
        written = int(s.get("tier_bytes_written", 0))
        now = time.monotonic()
        self._total += written
        if self._first is None:
            self._first = now
        else:
            self._since_first += written
            if now > self._first:
                s["state_bytes_written_per_day"] = self._since_first / (now - self._first) * 86400
        s["state_bytes_written_total"] = self._total
        self._f(s)


def _block_device(path: str) -> str | None:
    """The whole disk under `path` (e.g. "nvme0n1"), from sysfs."""
    dev = os.stat(path).st_dev
    sys_dev = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    if not os.path.exists(sys_dev):
        return None
    real = os.path.realpath(sys_dev)
    # A partition's directory sits inside its disk's.
    if os.path.exists(os.path.join(real, "partition")):
        real = os.path.dirname(real)
    return os.path.basename(real)


def drive_wear(path: str | os.PathLike) -> dict[str, Any]:
    """The wear of the drive holding `path`: {"device", "data_written_bytes", "percentage_used",
    "rated_bytes_estimate"} from its NVMe SMART log (the estimate: bytes written over the share
    of its life the drive says it has used), or {"device", "unavailable": why} where the drive
    is no NVMe drive, nvme-cli is missing, or the log cannot be read."""
    path = os.fspath(path)
    disk = _block_device(path)
    if disk is None:
        return {"device": None, "unavailable": f"no block device under {path} (a network or memory filesystem)"}
    if not disk.startswith("nvme"):
        return {"device": disk, "unavailable": f"{disk} is not an NVMe drive: it reports no SMART wear here"}
    nvme = shutil.which("nvme")
    if nvme is None:
        return {"device": disk, "unavailable": "nvme-cli is not installed (apt-get install nvme-cli)"}
    try:
        r = subprocess.run([nvme, "smart-log", f"/dev/{disk}", "-o", "json"], capture_output=True, text=True,
                           timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"device": disk, "unavailable": f"nvme smart-log /dev/{disk}: {e}"}
    if r.returncode != 0:
        return {"device": disk, "unavailable": f"nvme smart-log /dev/{disk} failed: {r.stderr.strip()[-300:]}"}
    try:
        log = json.loads(r.stdout)
    except ValueError as e:
        return {"device": disk, "unavailable": f"nvme smart-log /dev/{disk} printed no JSON: {e}"}
    units = int(log.get("data_units_written", 0))
    used = log.get("percent_used", log.get("percentage_used"))
    out: dict[str, Any] = {"device": disk, "data_written_bytes": units * 512_000, "percentage_used": used}
    if isinstance(used, (int, float)) and used > 0:
        out["rated_bytes_estimate"] = units * 512_000 * 100 / used
    return out
