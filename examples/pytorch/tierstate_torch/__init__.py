# SPDX-License-Identifier: Apache-2.0
"""tierstate for PyTorch: torch.optim.Adam and AdamW with the optimizer state offloaded to
host memory or NVMe by tierstate's C++ library (compiled on first use)."""
from .optim import Adam, AdamW

__all__ = ["Adam", "AdamW"]
