# SPDX-License-Identifier: Apache-2.0
"""The progress of making the state (the first step), save and load (tierstate/core/progress.hpp):
a tqdm bar on stderr where tqdm is installed and stderr is a terminal, or the user's callable."""
from __future__ import annotations

import sys
from typing import Any, Callable

Progress = Callable[[str, int, int], None]

_TITLES = {"make_state": "tierstate: making the state", "save": "tierstate: saving",
           "verify": "tierstate: verifying the checkpoint", "load": "tierstate: loading"}


class _Bar:
    """One tqdm bar per phase, shown only when the phase lasts over half a second."""

    def __init__(self) -> None:
        self._bar: Any = None
        self._phase: str | None = None

    def __call__(self, phase: str, done: int, total: int) -> None:
        from tqdm import tqdm
        if self._bar is None or self._phase != phase or done < self._bar.n:  # (a new run of a phase that failed)
            if self._bar is not None:
                self._bar.close()
            self._bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, delay=0.5, leave=False,
                             desc=_TITLES.get(phase, phase), file=sys.stderr)
            self._phase = phase
        self._bar.update(done - self._bar.n)
        if done >= total:
            self._bar.close()
            self._bar = None


def resolve(progress: bool | Progress | None, name: str) -> Progress | None:
    """None: a tqdm bar where tqdm is installed and stderr is a terminal; True: a tqdm bar
    (tqdm must be installed); False: nothing; a callable: called as f(phase, done, total)."""
    if progress is False:
        return None
    if callable(progress):
        return progress
    if progress is not None and progress is not True:
        raise ValueError(f"{name}: progress must be None (a tqdm bar on a terminal), True, False or a callable "
                         f"f(phase, done, total), not {progress!r}")
    try:
        import tqdm  # noqa: F401
    except ImportError:
        if progress is True:
            raise ValueError(f"{name}: progress=True draws a tqdm bar: pip install tqdm (or pass a callable)") from None
        return None
    if progress is None and not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty()):
        return None
    return _Bar()
