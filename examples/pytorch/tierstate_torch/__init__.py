# SPDX-License-Identifier: Apache-2.0
"""tierstate for PyTorch: torch.optim.Adam, AdamW, SGD and Adafactor, and Lion, with the
optimizer state offloaded to host memory or NVMe by tierstate's C++ library (compiled when
the package is installed; from a checkout, on first use)."""
from ._build import check_torch as _check_torch

_check_torch()  # an installed extension built for another torch is refused here, saying what to do

from ._offload import OffloadedParameters, offload_parameters  # noqa: E402
from .optim import SGD, Adafactor, Adam, AdamW, Lion, ShardedAdamW  # noqa: E402
from ._metrics import drive_wear  # noqa: E402
from ._plan import Plan, plan  # noqa: E402


def host_kernels() -> str:
    """The level of the host kernels the optimizers run: in a package build, the x86-64 level
    chosen at load from what this CPU has ("x86-64-v2", "x86-64-v3", "x86-64-v4" or
    "x86-64-v4-bf16"; TIERSTATE_ARCH=<level> forces one, and a level this CPU lacks is refused
    with ValueError); in a just-in-time build, "native <its SIMD architecture>"."""
    from ._common import _ext
    return _ext().host_kernels()


__all__ = ["Adam", "AdamW", "ShardedAdamW", "SGD", "Lion", "Adafactor", "host_kernels", "offload_parameters", "OffloadedParameters",
           "drive_wear", "plan", "Plan"]
__version__ = "0.1.0"  # VERSION's (tests/check_version.py)
