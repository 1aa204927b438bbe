"""Where a learner computes and with how many intra-op threads: the device choice and the CPU
budget (affinity capped by the pod's cgroup quota)."""

from __future__ import annotations

import math
import os

import torch

from diloco_trainer.api.contract import ContractError


def pick_device(requested: str) -> str:
    """'auto' means CUDA when available, else CPU."""
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise ContractError(f"DILOCO_DEVICE={requested} but CUDA is not available")
    return requested


def cpu_budget() -> int:
    """CPUs this process may use: its affinity, capped by a cgroup v2 CPU quota (pod limits)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpus = cpus or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cpus


def configure_threads(device: str) -> None:
    """Intra-op threads: OMP_NUM_THREADS when set (diloco run sets it), else the CPU budget."""
    raw = os.environ.get("OMP_NUM_THREADS", "")
    if raw.isdigit() and int(raw) > 0:
        torch.set_num_threads(int(raw))
    elif device == "cpu":
        torch.set_num_threads(cpu_budget())
