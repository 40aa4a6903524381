# SPDX-License-Identifier: Apache-2.0
"""Compiles the extension on first use with torch.utils.cpp_extension.load.

The build is cached (by PyTorch, under TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions)
and redone when a source or header changes. It needs g++ >= 12 (C++20), tierstate's
headers, and the headers of xsimd, liburing (and its library) and xxHash:
    apt-get install g++ libxsimd-dev liburing-dev libxxhash-dev pkg-config

Environment:
    TIERSTATE_INCLUDE       tierstate's include directory (default: this checkout's, else
                            what `pkg-config --cflags tierstate` says)
    TIERSTATE_TORCH_CFLAGS  the optimization flags (default: -O3 -march=native: the host
                            kernels use the widest SIMD this CPU has)
    TIERSTATE_TORCH_VERBOSE=1  print the compiler's command lines
"""
from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCES = ["bindings.cpp", "shards_adam.cpp", "shards_adamw.cpp",
            "shards_adam_amsgrad.cpp", "shards_adamw_amsgrad.cpp"]


def _pkg_config(*args: str) -> list[str]:
    try:
        out = subprocess.run(["pkg-config", *args], check=True, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        raise RuntimeError(
            f"tierstate_torch: `pkg-config {' '.join(args)}` failed ({detail.strip()}); install "
            "pkg-config, liburing-dev and libxxhash-dev") from e
    return shlex.split(out.stdout)


def _include_flags() -> list[str]:
    given = os.environ.get("TIERSTATE_INCLUDE")
    if given:
        return [f"-I{given}"]
    checkout = _CSRC.parents[3] / "include"
    if (checkout / "tierstate" / "optimizer.hpp").is_file():
        return [f"-I{checkout}"]
    return _pkg_config("--cflags", "tierstate")


def load_extension():
    from torch.utils.cpp_extension import load

    cflags = ["-std=c++20", "-DNDEBUG", "-Wno-deprecated-declarations"]
    cflags += shlex.split(os.environ.get("TIERSTATE_TORCH_CFLAGS", "-O3 -march=native"))
    cflags += _include_flags()
    cflags += [f for f in _pkg_config("--cflags", "liburing", "libxxhash")]
    return load(
        name="tierstate_torch_C",
        sources=[str(_CSRC / s) for s in _SOURCES],
        extra_cflags=cflags,
        extra_ldflags=_pkg_config("--libs", "liburing"),
        verbose=os.environ.get("TIERSTATE_TORCH_VERBOSE") == "1",
    )
