# SPDX-License-Identifier: Apache-2.0
"""tierstate for PyTorch: torch.optim.Adam, AdamW, SGD and Adafactor, and Lion, with the
optimizer state offloaded to host memory or NVMe by tierstate's C++ library (compiled when
the package is installed; from a checkout, on first use)."""
from ._build import check_torch as _check_torch

_check_torch()  # an installed extension built for another torch is refused here, saying what to do

from .optim import SGD, Adafactor, Adam, AdamW, Lion  # noqa: E402

__all__ = ["Adam", "AdamW", "SGD", "Lion", "Adafactor"]
__version__ = "0.1.0"  # VERSION's (tests/check_version.py)
