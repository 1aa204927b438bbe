"""CPUs this process may use, and torch's intra-op threads set to match: its affinity capped by
the pod's cgroup CPU quota. torch's own default counts the host's cores, so a pod limited to 4
CPUs on a 64-core node ran 64 threads in 4 CPUs of quota: throttled, and on a loaded node slower
than one thread (the syncer's merge path measured 14.9-48 s with two threads against 2.5 s with
one, its many small operations per slice each waiting on a descheduled thread). Used by the
learner and the syncer alike."""

from __future__ import annotations

import math
import os

import torch

from diloco_trainer.api.contract import CPUS, format_cpu_list, parse_cpu_list

# cgroup v2 (one file: "QUOTA PERIOD" or "max PERIOD"), then cgroup v1's cpu controller
# (quota -1 without a limit): nodes still on cgroup v1 put a pod's CPU limit only there.
CGROUP_V2_CPU_MAX = "/sys/fs/cgroup/cpu.max"
CGROUP_V1_CPU = ("/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct")


def quota_cpus(quota: int, period: int) -> int | None:
    """Whole CPUs a CFS quota allows (rounded up), None without a limit (v2 max, v1 -1)."""
    if quota <= 0 or period <= 0:
        return None
    return max(1, math.ceil(quota / period))


def cgroup_cpu_limit() -> int | None:
    """CPUs the cgroup quota allows this process, None when unlimited or unreadable."""
    try:
        with open(CGROUP_V2_CPU_MAX) as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else quota_cpus(int(quota), int(period))
    except (OSError, ValueError):
        pass
    for root in CGROUP_V1_CPU:
        try:
            with open(f"{root}/cpu.cfs_quota_us") as q, open(f"{root}/cpu.cfs_period_us") as p:
                return quota_cpus(int(q.read()), int(p.read()))
        except (OSError, ValueError):
            continue
    return None


def cpu_budget() -> int:
    """CPUs this process may use: its affinity, capped by the cgroup's CPU quota (pod limits)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpus = cpus or 1
    limit = cgroup_cpu_limit()
    return min(cpus, limit) if limit is not None else cpus


def configure_threads(device: str = "cpu") -> None:
    """Keep to DILOCO_CPUS when set (diloco run sets it), then intra-op threads: OMP_NUM_THREADS
    when set (diloco run sets it), else the CPU budget (on a CPU device: a GPU's work does not
    run on these threads)."""
    keep = os.environ.get(CPUS, "")
    if keep and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, parse_cpu_list(keep))
    raw = os.environ.get("OMP_NUM_THREADS", "")
    if raw.isdigit() and int(raw) > 0:
        torch.set_num_threads(int(raw))
    elif device == "cpu":
        torch.set_num_threads(cpu_budget())


def cpus_here() -> str:
    """This process's CPUs as a list ("0-7"), for its log."""
    if not hasattr(os, "sched_getaffinity"):
        return f"0-{(os.cpu_count() or 1) - 1}"
    return format_cpu_list(frozenset(os.sched_getaffinity(0)))
