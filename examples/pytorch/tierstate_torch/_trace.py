# SPDX-License-Identifier: Apache-2.0
"""optimizer.trace(path): the steps' timeline (tierstate/core/trace.hpp) as Chrome trace-event
JSON, which Perfetto (ui.perfetto.dev) and chrome://tracing open and bench/trace_png.py draws.

Each shard (one C++ optimizer per parameter dtype and device) records its own events; they
share the steady clock (time.monotonic_ns), so one file holds them all on one timeline: a
process per shard, a row per thread and per I/O staging buffer.

The events do not reach torch.profiler's traces: its Python API records only what runs under
record_function on the calling thread, at that moment, and the optimizer's events come from
its own threads (workers, the I/O thread) with their own times. The file's times count from
its first event; otherData's clock_origin_ns is that instant on time.monotonic_ns()'s clock."""
from __future__ import annotations

import json
import os
from typing import Any

from ._common import _key_name


def _write(path: str | os.PathLike, shards: list[tuple[str, list[tuple], int]], rank: int | None) -> int:
    """Writes the JSON; returns the number of events."""
    out: list[dict[str, Any]] = []
    origin = min((r[1] for _, records, _ in shards for r in records), default=0)
    dropped = sum(d for _, _, d in shards)
    for pid, (name, records, _) in enumerate(shards, start=1):
        label = f"tierstate {name}" + (f", rank {rank}" if rank is not None else "")
        out.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": label}})
        stepped = {r[5] for r in records if r[0] == "step" and not r[6]}
        tracks = sorted({(r[6], r[5]) for r in records})
        for io, track in tracks:
            tid = (1 << 31) + track if io else track
            kind = 2 if io else (0 if track in stepped else 1)
            title = (f"I/O, staging buffer {track}" if io else
                     f"{'step' if track in stepped else 'worker'} thread {track}")
            out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": title}})
            out.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                        "args": {"sort_index": (kind << 22) + track}})
        for phase, begin, end, nbytes, chunk, track, io in records:
            out.append({"name": phase, "cat": "io" if phase in ("read", "write") else ("chunk" if chunk >= 0 else "step"),
                        "ph": "X", "pid": pid, "tid": (1 << 31) + track if io else track,
                        "ts": (begin - origin) / 1e3, "dur": max(end - begin, 0) / 1e3,
                        "args": {"chunk": chunk, "bytes": nbytes}})
    doc = {"displayTimeUnit": "ms", "otherData": {"library": "tierstate_torch", "dropped_events": dropped,
                                                  "clock_origin_ns": origin},
           "traceEvents": out}
    tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return sum(len(r) for _, r, _ in shards)


class Trace:
    """The context manager optimizer.trace() returns: records from __enter__ to __exit__ (or
    start() to stop()), then writes `path`. `events` and `dropped` say what it wrote."""

    def __init__(self, optimizer: Any, path: str | os.PathLike, capacity: int):
        if not isinstance(capacity, int) or isinstance(capacity, bool) or not 1 <= capacity <= 1 << 28:
            raise ValueError(f"{type(optimizer).__name__}.trace: capacity={capacity!r} must be an int in 1..2**28 "
                             "(events per shard, 40 bytes each, allocated at the start)")
        parent = os.path.dirname(os.path.abspath(os.fspath(path)))
        if not os.path.isdir(parent):
            raise FileNotFoundError(f"{type(optimizer).__name__}.trace: the directory of {os.fspath(path)!r} "
                                    "does not exist")
        self._opt, self.path, self._capacity = optimizer, path, capacity
        self._started: list[tuple[Any, Any]] = []
        self.events = 0
        self.dropped = 0

    def start(self) -> "Trace":
        """Starts every shard's tracer, or none: a shard that refuses (a streaming step in
        progress) stops those already started, and the refusal is raised."""
        if self._started:
            raise RuntimeError(f"{type(self._opt).__name__}.trace: already recording")
        try:
            for key, shard in self._opt._trace_shards():
                shard.trace_start(self._capacity)
                self._started.append((key, shard))
        except BaseException:
            for _, shard in self._started:
                shard.trace_stop()
            self._started = []
            raise
        return self

    def stop(self) -> None:
        """Stops recording and writes the file; a second call does nothing. A streaming step
        in progress is refused before any shard stops (step() first)."""
        if not self._started:
            return
        for key, shard in self._started:
            if shard.in_step():
                raise RuntimeError(f"{type(self._opt).__name__}.trace: a streaming step is in progress "
                                   "(backward handed over gradients, step() not yet called): stop after step()")
        shards = []
        for key, shard in self._started:
            records, dropped = shard.trace_stop()
            shards.append((_key_name(key), records, dropped))
        self._started = []
        self.dropped = sum(d for _, _, d in shards)
        rank = None
        try:
            import torch.distributed as dist
            if dist.is_available() and dist.is_initialized():
                rank = dist.get_rank()
        except Exception:  # pragma: no cover (torch without distributed)
            rank = None
        self.events = _write(self.path, shards, rank)

    def __enter__(self) -> "Trace":
        return self.start()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.stop()
            return
        try:  # the body's exception is the one to see
            self.stop()
        except Exception:
            pass
