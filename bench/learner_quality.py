"""Quality of sharded, mixed-precision islands: fsdp + bf16 against ddp + fp32 at equal tokens.

The same job twice per seed, on real processes as `diloco run` starts them (a syncer and M
islands of R learner ranks each, gloo inside an island on the CPU): once with
`islands.parallelism: ddp` and `inner.precision: fp32`, once with `fsdp` and `bf16`; nothing else
differs (model and data seeds, batches, schedule, sync settings). Both jobs stop after the same
outer steps, so the syncer merges the same tokens (checked); the figure is the ratio of the
syncer's final eval losses, fsdp + bf16 over ddp + fp32 (issue 21's target: within 2%).

    python -m bench.learner_quality --preset gpt-mini --seeds 0 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diloco_trainer.api.contract import island_name
from diloco_trainer.api.spec import JobSpec, parse_spec
from diloco_trainer.learner.syncer_client import SyncerClient
from diloco_trainer.local import (
    JobFiles,
    Proc,
    free_port,
    start_learner,
    start_syncer,
    wait_ready,
    write_job_files,
)

from bench.harness.common import (
    LoadMonitor,
    Report,
    Table,
    base_parser,
    fmt_ratio,
    install_signal_cleanup,
    publish,
    track,
    verdict,
    workdir,
)
from bench.harness.flags import inner_section

# The two learners compared: (islands.parallelism, inner.precision).
BASELINE = ("ddp", "fp32")
CANDIDATE = ("fsdp", "bf16")
TARGET = 0.02  # issue 21: within 2% of the baseline's eval loss
# One intra-op thread per process: M x R learners and the syncer share a few cores.
THREADS_ENV = {"OMP_NUM_THREADS": "1", "DILOCO_DEVICE": "cpu"}


def job_manifest(args: argparse.Namespace, parallelism: str, precision: str, seed: int) -> dict:
    """The job's spec (manifest form) for one learner kind and seed: everything but
    `islands.parallelism` and `inner.precision` is the same for both kinds."""
    return {
        "model": {"preset": args.preset, "seed": seed},
        "data": {"evalTokens": args.eval_tokens, "seed": seed},
        "islands": {"count": args.islands, "replicas": args.replicas, "parallelism": parallelism},
        "inner": {
            **inner_section(args),
            "precision": precision,
            "microBatches": args.micro_batches,
        },
        # Every merge waits for every island (K = M), so both jobs merge the same work; the
        # job's defaults otherwise (fragments, overlap, int8 pushes), as a user would run it.
        "sync": {"quorum": args.islands, "graceSeconds": "auto", "heartbeatTimeoutSeconds": 120},
        "stopAfter": {"outerSteps": args.rounds},
        "syncer": {"checkpoint": {"everyOuterSteps": 1000}, "evalEveryOuterSteps": args.rounds},
    }


@dataclass
class Outcome:
    """What one job reached: the syncer's final status, and its wall time."""

    parallelism: str
    precision: str
    seed: int
    tokens: int
    eval_loss: float
    initial_eval_loss: float
    seconds: float


def outcome_of(status: dict[str, Any], kind: tuple[str, str], seed: int, seconds: float) -> Outcome:
    """An Outcome from the syncer's /v1/status document of a finished job."""
    loss, initial = status.get("evalLoss"), status.get("initialEvalLoss")
    if loss is None or initial is None:
        raise RuntimeError(f"{kind} seed {seed}: the finished job has no eval loss ({status})")
    return Outcome(kind[0], kind[1], seed, int(status["tokens"]), loss, initial, seconds)


@dataclass
class Comparison:
    """One seed's pair, candidate over baseline."""

    seed: int
    baseline: Outcome
    candidate: Outcome

    @property
    def ratio(self) -> float:
        return self.candidate.eval_loss / self.baseline.eval_loss

    @property
    def met(self) -> bool:
        return abs(self.ratio - 1) <= TARGET


def compare(outcomes: Sequence[Outcome]) -> list[Comparison]:
    """Pair each seed's baseline and candidate; raises when a seed misses one of them or when
    the two merged different tokens (then the comparison would not be at equal tokens)."""
    by_seed: dict[int, dict[tuple[str, str], Outcome]] = {}
    for o in outcomes:
        by_seed.setdefault(o.seed, {})[(o.parallelism, o.precision)] = o
    pairs = []
    for seed in sorted(by_seed):
        kinds = by_seed[seed]
        if BASELINE not in kinds or CANDIDATE not in kinds:
            raise ValueError(
                f"seed {seed}: needs both {BASELINE} and {CANDIDATE}, has {sorted(kinds)}"
            )
        base, cand = kinds[BASELINE], kinds[CANDIDATE]
        if base.tokens != cand.tokens:
            raise ValueError(f"seed {seed}: unequal tokens, {base.tokens} and {cand.tokens}")
        pairs.append(Comparison(seed, base, cand))
    return pairs


@dataclass
class IslandsRun:
    """One job on loopback: the syncer and every rank of every island."""

    spec: JobSpec
    workdir: Path
    files: JobFiles | None = None
    syncer: Proc | None = None
    learners: list[Proc] = field(default_factory=list)
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """The syncer; every island joined before any learner starts (so even the first merge
        waits for the full quorum); then every rank of every island."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.files = write_job_files(self.spec, self.workdir)
        self.port = free_port()
        self.syncer = track(
            start_syncer(
                self.files,
                port=self.port,
                state_dir=self.workdir / "syncer",
                job_name="bench",
                log_file=self.workdir / "syncer.log",
                extra_env=THREADS_ENV,
            )
        )
        wait_ready(self.url, self.files.token, 120, proc=self.syncer)
        asyncio.run(self._prejoin())
        for i in range(self.spec.islands.count):
            self._start_island(i)

    async def _prejoin(self) -> None:
        assert self.files is not None
        async with SyncerClient(self.url, self.files.token) as client:
            for i in range(self.spec.islands.count):
                await client.join(island_name(self.spec.islands.name_prefix, i), 1)

    def _start_island(self, i: int) -> None:
        assert self.files is not None
        name = island_name(self.spec.islands.name_prefix, i)
        master_port = free_port()
        replicas = self.spec.islands.replicas_of(i)
        for rank in range(replicas):
            proc = start_learner(
                self.files,
                syncer_url=self.url,
                island=name,
                island_index=i,
                log_file=self.workdir / f"{name}-rank{rank}.log",
                rank=rank,
                world_size=replicas,
                master_port=master_port,
                job_name="bench",
                extra_env=THREADS_ENV,
            )
            self.learners.append(track(proc))

    def status(self) -> dict[str, Any]:
        assert self.files is not None
        req = urllib.request.Request(
            self.url + "/v1/status", headers={"Authorization": f"Bearer {self.files.token}"}
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())

    def wait_finished(self, timeout: float) -> dict[str, Any]:
        """Poll until the syncer says finished with its final evaluation; raise with log tails
        when a process died first or the time ran out."""
        deadline = time.monotonic() + timeout
        while True:
            assert self.syncer is not None
            if not self.syncer.alive:
                raise RuntimeError(f"the syncer exited:\n{self.syncer.log_text()[-3000:]}")
            st = self.status()
            if st.get("finished") and st.get("evalLoss") is not None:
                return st
            dead = [p for p in self.learners if not p.alive]
            if dead:
                raise RuntimeError(f"{dead[0].name} exited early:\n{dead[0].log_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"job not finished after {timeout:.0f}s (status {st})")
            time.sleep(1.0)

    def stop(self) -> None:
        for proc in self.learners:
            proc.stop(timeout=10)
        if self.syncer is not None:
            self.syncer.stop(timeout=10)


def run_one(args: argparse.Namespace, kind: tuple[str, str], seed: int, where: Path) -> Outcome:
    spec = parse_spec(job_manifest(args, kind[0], kind[1], seed))
    run = IslandsRun(spec, where / f"seed{seed}-{kind[0]}-{kind[1]}")
    started = time.monotonic()
    try:
        run.start()
        status = run.wait_finished(args.timeout)
    finally:
        run.stop()
    out = outcome_of(status, kind, seed, time.monotonic() - started)
    print(
        f"seed {seed} {kind[0]} + {kind[1]}: eval loss {out.eval_loss:.4f} (from "
        f"{out.initial_eval_loss:.4f}) at {out.tokens} tokens, {out.seconds:.0f} s",
        flush=True,
    )
    return out


def report(args: argparse.Namespace, pairs: Sequence[Comparison]) -> Report:
    table = Table(
        f"{args.preset}: {args.islands} islands of {args.replicas} ranks, equal tokens",
        [
            "seed",
            "tokens merged",
            "ddp + fp32 eval loss",
            "fsdp + bf16 eval loss",
            "fsdp+bf16 / ddp+fp32",
            "within 2%",
            "wall s (ddp / fsdp)",
        ],
    )
    for c in pairs:
        table.add(
            c.seed,
            f"{c.baseline.tokens:,}",
            f"{c.baseline.eval_loss:.4f}",
            f"{c.candidate.eval_loss:.4f}",
            fmt_ratio(c.ratio, 4),
            verdict(c.met),
            f"{c.baseline.seconds:.0f} / {c.candidate.seconds:.0f}",
        )
    mean = statistics.fmean(c.ratio for c in pairs)
    summary = (
        f"fsdp + bf16 against ddp + fp32 (islands.parallelism, inner.precision), everything else "
        f"equal: mean ratio of final eval losses {mean:.4f} over {len(pairs)} seed(s); target "
        f"within 2% in every seed: **{verdict(all(c.met for c in pairs))}**."
    )
    notes = [
        f"Job: H = {args.inner_steps}, {args.rounds} outer steps, batch {args.batch_size} x "
        f"{args.micro_batches} micro-batch(es) x {args.seq_len} tokens per rank, inner lr "
        f"{args.inner_lr} (warm-up {args.warmup}), K = M, the job's sync defaults otherwise; "
        f"evaluation on {args.eval_tokens} held-out tokens at the finish.",
        "Initial eval loss per seed (the same for both kinds): "
        + ", ".join(f"{c.baseline.initial_eval_loss:.4f}" for c in pairs),
    ]
    return Report("learner_quality (issue 21)", summary, [table], notes)


def parser() -> argparse.ArgumentParser:
    p = base_parser(
        __doc__.split("\n\n")[0],
        preset="gpt-mini",
        islands=2,
        inner_steps=20,
        batch_size=8,
        seq_len=64,
        inner_lr=3e-3,
        warmup=20,
        eval_tokens=8192,
        seeds=[0],
        timeout=900.0,
    )
    p.add_argument("--replicas", type=int, default=2, help="R: ranks per island")
    p.add_argument("--micro-batches", type=int, default=1, help="inner.microBatches")
    p.add_argument("--rounds", type=int, default=10, help="outer steps per job")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    install_signal_cleanup()
    outcomes = []
    with LoadMonitor() as load, workdir(args.workdir, "learner-quality") as where:
        for seed in args.seeds:
            for kind in (BASELINE, CANDIDATE):
                outcomes.append(run_one(args, kind, seed, where))
    return publish(report(args, compare(outcomes)), args, load)


if __name__ == "__main__":
    sys.exit(main())
