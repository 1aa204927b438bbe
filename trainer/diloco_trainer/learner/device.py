"""Where a learner computes: the device choice (its threads: diloco_trainer/cpus.py)."""

from __future__ import annotations

import torch

from diloco_trainer.api.contract import ContractError


def pick_device(requested: str) -> str:
    """'auto' means CUDA when available, else CPU."""
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise ContractError(f"DILOCO_DEVICE={requested} but CUDA is not available")
    return requested
