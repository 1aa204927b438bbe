"""Which CPUs and how many intra-op threads each process of a local job gets (`diloco run`):
everything shared by default, or the learners and the syncer on CPUs of their own (GPU learners
on a machine of at least 4 CPUs, or DILOCO_SYNCER_CPUS on any device). Each process keeps to its
list through DILOCO_CPUS (cpus.py)."""

from __future__ import annotations

import os

from diloco_trainer.api.contract import (
    CPUS,
    SYNCER_CPUS,
    ContractError,
    format_cpu_list,
    parse_cpu_list,
)


def threads_per_learner(total_ranks: int) -> int:
    """Share the CPU budget between the local learner processes (at least one thread each)."""
    from diloco_trainer.cpus import cpu_budget

    return max(1, cpu_budget() // max(1, total_ranks))


def cpu_split(
    cpus: frozenset[int], device: str, syncer: frozenset[int] | None = None
) -> tuple[frozenset[int], frozenset[int]] | None:
    """(the learners' CPUs, the syncer's) for a local job. With `syncer` (DILOCO_SYNCER_CPUS):
    those are the syncer's and the rest the learners', on any device (ContractError unless they
    are CPUs of this process and leave at least one). Else separate halves when the learners
    are told to compute on a GPU (DILOCO_DEVICE cuda or cuda:N) and there are at least 4 CPUs,
    else None (all share every CPU: CPU learners need them for their steps, and the syncer is
    idle between merges; `auto` may be either, so it is not split). A GPU learner's steps are
    fed by one Python thread; beside a syncer merging on every core, an H100's gpt-125m steps
    ran 7-12% slower (bench/log/2026-11-27.md, "learner_overlap in a job on an NVIDIA H100"), where
    in a cluster the syncer has a pod of its own."""
    if syncer is not None:
        if not syncer <= cpus or not cpus - syncer:
            raise ContractError(
                f"{SYNCER_CPUS}={format_cpu_list(syncer)} must name CPUs of this process "
                f"({format_cpu_list(cpus)}) and leave at least one to the learners"
            )
        return cpus - syncer, syncer
    if not device.startswith("cuda") or len(cpus) < 4:
        return None
    ordered = sorted(cpus)
    half = len(ordered) // 2
    return frozenset(ordered[:half]), frozenset(ordered[half:])


def syncer_cpus_wanted() -> frozenset[int] | None:
    """DILOCO_SYNCER_CPUS from this command's environment, None when unset (ContractError
    naming it when it is not a CPU list)."""
    raw = os.environ.get(SYNCER_CPUS, "")
    return parse_cpu_list(raw, SYNCER_CPUS) if raw.strip() else None


def gpu_learner_threads(cpus: int) -> int:
    """Intra-op threads of a GPU learner with `cpus` CPUs of its own: two fewer, at least one.
    Its CPU work is the link's (decoding pulls on the host, beside the steps); a pool as wide as
    its CPUs would leave no core free for the training thread that feeds the GPU, nor for the
    link's event loop."""
    return max(1, cpus - 2)


def process_threads(
    role: str,
    device: str,
    ranks: int,
    cpus: frozenset[int],
    syncer: frozenset[int] | None,
    own: str | None = None,
) -> dict[str, str]:
    """The environment that sizes one process of the job (`role` learner or syncer): its
    intra-op threads, and its CPUs when the job's are split (cpu_split). `ranks`: the learner
    processes of the whole job, which share the learners' CPUs. `device` is the job's (it
    decides the split); `own`, a learner's own when its island is on another
    (`diloco run --island-device`, local/island_devices.py), sizes that learner's threads: a
    CPU island beside GPU islands computes with its whole share, a GPU one keeps two free."""
    split = cpu_split(cpus, device, syncer)
    if split is None:
        return {"OMP_NUM_THREADS": str(threads_per_learner(ranks))}
    mine = split[0] if role == "learner" else split[1]
    threads = len(mine)
    if role == "learner":
        share = max(1, len(mine) // max(1, ranks))
        threads = gpu_learner_threads(share) if (own or device).startswith("cuda") else share
    return {"OMP_NUM_THREADS": str(threads), CPUS: format_cpu_list(mine)}
