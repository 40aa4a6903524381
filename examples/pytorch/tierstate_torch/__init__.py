# SPDX-License-Identifier: Apache-2.0
"""tierstate for PyTorch: torch.optim.Adam, AdamW, SGD and Adafactor, and Lion, with the
optimizer state offloaded to host memory or NVMe by tierstate's C++ library (compiled on
first use)."""
from .optim import SGD, Adafactor, Adam, AdamW, Lion

__all__ = ["Adam", "AdamW", "SGD", "Lion", "Adafactor"]
__version__ = "0.1.0"  # VERSION's (tests/check_version.py)
