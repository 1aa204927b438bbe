"""Start torchft's DiLoCo on loopback: a lighthouse process and M replica-group processes.

The lighthouse is torchft's own `torchft_lighthouse` binary (shipped in the wheel), run as a
process so it can be killed, restarted, or put in a network namespace like the replicas.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from diloco_trainer.api.spec import JobSpec
from diloco_trainer.local import Proc, free_port

from bench.harness.common import poll_until, start_module


def lighthouse_binary() -> str:
    """Path of torchft's lighthouse next to this interpreter (or on PATH)."""
    local = Path(sys.executable).parent / "torchft_lighthouse"
    found = str(local) if local.exists() else shutil.which("torchft_lighthouse")
    if not found:
        raise RuntimeError("torchft_lighthouse not found: pip install torchft==0.2.0")
    return found


@dataclass
class TorchftJob:
    """What one torchft run trains and how its replicas are started."""

    spec_file: Path
    workdir: Path
    num_replicas: int
    min_replicas: int
    outer_steps: int = 0
    max_seconds: float = 0.0
    slowdowns: dict[int, float] = field(default_factory=dict)
    sync_delay: int = 0  # DiLoCo fragment_sync_delay: inner steps that overlap the all-reduce
    timeout: float = 60.0
    join_timeout_ms: int = 1000
    heartbeat_timeout_ms: int = 5000
    prefix: Sequence[str] = ()  # e.g. ["ip", "netns", "exec", NS]
    port: int = 0

    def progress_file(self, replica: int, incarnation: int = 0) -> Path:
        """Progress of one process of a replica (a restarted replica is a new incarnation)."""
        return self.workdir / f"torchft-replica{replica}.{incarnation}.progress.jsonl"

    def progress_files(self, replica: int) -> list[Path]:
        """Progress files of every incarnation of a replica."""
        return sorted(self.workdir.glob(f"torchft-replica{replica}.*.progress.jsonl"))

    def save_dir(self, replica: int) -> Path:
        return self.workdir / f"torchft-replica{replica}-global"

    def result_file(self, replica: int) -> Path:
        return self.workdir / f"torchft-replica{replica}.json"

    @property
    def lighthouse_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def start_lighthouse(job: TorchftJob) -> Proc:
    """Start the lighthouse; quorum needs `min_replicas` replica groups."""
    if not job.port:
        job.port = free_port()
    import subprocess

    from bench.harness.common import track

    log = job.workdir / "torchft-lighthouse.log"
    with log.open("ab") as out:
        popen = subprocess.Popen(
            [
                *job.prefix,
                lighthouse_binary(),
                "--bind",
                f"127.0.0.1:{job.port}",
                "--min_replicas",
                str(job.min_replicas),
                "--join_timeout_ms",
                str(job.join_timeout_ms),
                "--quorum_tick_ms",
                "100",
                "--heartbeat_timeout_ms",
                str(job.heartbeat_timeout_ms),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    return track(Proc("torchft-lighthouse", popen, log))


def start_replica(
    job: TorchftJob,
    replica: int,
    *,
    evaluate: bool = False,
    incarnation: int = 0,
    save_global: bool = False,
) -> Proc:
    """Start replica group `replica` (data shard `replica` of num_replicas).

    `incarnation` numbers restarts (own progress and log files); `save_global` makes it save
    the global weights after every commit (see TorchftJob.save_dir).
    """
    args = [
        "--spec",
        str(job.spec_file),
        "--replica",
        str(replica),
        "--num-shards",
        str(job.num_replicas),
        "--lighthouse",
        job.lighthouse_url,
        "--min-replicas",
        str(job.min_replicas),
        "--outer-steps",
        str(job.outer_steps),
        "--max-seconds",
        str(job.max_seconds),
        "--slowdown",
        str(job.slowdowns.get(replica, 1.0)),
        "--timeout",
        str(job.timeout),
        "--sync-delay",
        str(job.sync_delay),
        "--progress",
        str(job.progress_file(replica, incarnation)),
        "--out",
        str(job.result_file(replica)),
    ]
    if evaluate:
        args.append("--eval")
    if save_global:
        args += ["--save-dir", str(job.save_dir(replica))]
    return start_module(
        f"torchft-replica{replica}",
        "bench.harness.torchft_worker",
        args,
        env={"RUST_LOG": "warn", "OMP_NUM_THREADS": "1"},
        log_file=job.workdir / f"torchft-replica{replica}.{incarnation}.log",
        prefix=job.prefix,
    )


def job_of_every_replica(
    spec: JobSpec,
    workdir: Path,
    replicas: int,
    *,
    outer_steps: int = 0,
    slowdowns: dict[int, float] | None = None,
    sync_delay: int = 0,
    timeout: float = 300.0,
    prefix: Sequence[str] = (),
) -> TorchftJob:
    """A torchft run whose every sync needs all `replicas` (K = M, as the benchmarks compare it),
    its job spec written where the replicas read it (workdir/spec.json)."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec_file = workdir / "spec.json"
    spec_file.write_text(spec.to_json())
    return TorchftJob(
        spec_file=spec_file,
        workdir=workdir,
        num_replicas=replicas,
        min_replicas=replicas,
        outer_steps=outer_steps,
        slowdowns=slowdowns or {},
        sync_delay=sync_delay,
        timeout=timeout,
        prefix=prefix,
    )


def start_job(
    job: TorchftJob, *, evaluate_replica: int | None = 0, save_replica: int | None = None
) -> tuple[Proc, list[Proc]]:
    """Start the lighthouse and every replica; replica `evaluate_replica` evaluates at the end,
    replica `save_replica` saves the global weights after every commit."""
    job.workdir.mkdir(parents=True, exist_ok=True)
    lighthouse = start_lighthouse(job)
    poll_until(
        lambda: "listening" in lighthouse.log_text().lower() or not lighthouse.alive,
        timeout=30,
        what="the torchft lighthouse to listen",
    )
    if not lighthouse.alive:
        raise RuntimeError("torchft lighthouse exited:\n" + lighthouse.log_text()[-2000:])
    replicas = [
        start_replica(job, i, evaluate=(i == evaluate_replica), save_global=(i == save_replica))
        for i in range(job.num_replicas)
    ]
    return lighthouse, replicas


def read_result(job: TorchftJob, replica: int) -> dict[str, object]:
    """The JSON result a replica wrote when it finished."""
    return json.loads(job.result_file(replica).read_text())
