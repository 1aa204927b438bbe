"""Syncer scale: a real `diloco syncer` process at real model sizes, fed by fake islands.

Fake islands (this process) join a real syncer on loopback and push valid encoded bodies of random
pseudo-gradients, K = M (every island pushes every fragment each round). Measured, per case:

- idle RSS of the syncer (ready, nothing pending) and its peak RSS over the rounds (sampled from
  /proc every 10 ms, and the kernel's own high-water mark, VmHWM, which also covers start-up),
  both as a multiple of x = P x 4 bytes (one fp32 copy of the model);
- last push -> pullable: from the answer to a round's last push of a fragment to a long-polling
  pull of that fragment answering with the new version (its headers; the body's transfer is
  not counted). That pull asks as a learner does, with `have=<previous version>`, so it gets
  the one-update chain (publisher.py); after it, per round, a full-body pull (`have` left out)
  is timed whole (headers to the body's last byte) and its bytes reported; with --lagging also
  a lagging learner's 3-update chain (have = version - 3: the older updates read back from the
  syncer's state dir) once the fragment has 3 updates. That body (3 updates) is cached while
  its version is published, so it adds to the peak: off by default, as the memory target
  counts one update's body in flight;
- /healthz latency (p50, p99, max) from a poller hitting it every 20 ms while the rounds run;
- a plain-torch floor in the same run: one copy of the fragment's fp32 bytes plus the weighted sum
  of M fp32 pseudo-gradients of that fragment (what a merge must at least do), timed right
  before each round's pushes and right after its pull (both reported); each round's ratio is
  its time over the faster of the two;
- a checkpoint written and resumed: the syncer stopped (SIGTERM writes a checkpoint of what was
  merged; the time to its exit), then a new syncer on the same state dir until ready (resume
  time, its start-up peak) and whether it serves the same versions.

    python -m bench.syncer_scale --preset gpt-125m --islands 4 8 --fragments 2 --rounds 4
    (--fragments takes several values too: each M runs with each F)

With --shards N the job has N syncer processes (syncer.shards), each owning fragments f with
f mod N its index: the fake islands join every shard and push and pull each fragment at its
owner, and each process's memory is a multiple of x = its own share of P x 4 (the fp32 bytes of
its fragments); the figures are the largest over the shards.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from diloco_trainer import local as launch  # the local runner's public surface
from diloco_trainer.api.protocol import META_KIND, META_MERGE_SECONDS, ROUTE_HEALTHZ, PushMeta
from diloco_trainer.api.spec import JobSpec, parse_spec
from diloco_trainer.core.compress import encode_tensors
from diloco_trainer.core.fragments import split_fragments
from diloco_trainer.learner.syncer_client import SyncerClient
from diloco_trainer.models.model import build_model

SEQ_LEN = 256


def model_shapes(preset: str) -> dict[str, torch.Size]:
    """A preset's parameter shapes, built on the meta device (no memory)."""
    with torch.device("meta"):
        model = build_model(preset, SEQ_LEN)
    return {name: p.shape for name, p in model.named_parameters()}


def job_spec(
    preset: str,
    islands: int,
    fragments: int,
    codec: str,
    shards: int = 1,
    eval_every: int = 1,
    overlap_steps: int | None = None,
) -> JobSpec:
    return parse_spec(
        {
            "model": {"preset": preset, "seed": 0},
            "data": {"evalTokens": 1024},
            "islands": {"count": islands},
            "inner": {"steps": 10, "batchSize": 1, "seqLen": SEQ_LEN, "lr": 1e-3},
            "sync": {
                "quorum": islands,
                "fragments": fragments,
                "compression": codec,
                "heartbeatTimeoutSeconds": 3600,
                "graceSeconds": 600,
                # 0: learners apply merges at fixed steps, so K = M rounds fold in island order
                **({} if overlap_steps is None else {"overlapSteps": overlap_steps}),
            },
            "stopAfter": {"outerSteps": 1000},
            "syncer": {
                "checkpoint": {"everyOuterSteps": 1000, "keep": 1},
                "shards": shards,
                "evalEveryOuterSteps": eval_every,
            },
        }
    )


def rss_bytes(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of a process, in bytes."""
    rss = hwm = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
        elif line.startswith("VmHWM:"):
            hwm = int(line.split()[1]) * 1024
    return rss, hwm


class Sampler(threading.Thread):
    """Samples the syncer's RSS and /healthz latency until stopped."""

    def __init__(self, pid: int, url: str) -> None:
        super().__init__(daemon=True)
        self.pid, self.url = pid, url
        self.peak = 0
        self.probe: list[float] = []
        self.failures = 0
        self.done = threading.Event()

    def run(self) -> None:
        last_probe = 0.0
        while not self.done.is_set():
            self.peak = max(self.peak, rss_bytes(self.pid)[0])
            now = time.perf_counter()
            if now - last_probe >= 0.02:
                last_probe = now
                t0 = time.perf_counter()
                try:
                    with urllib.request.urlopen(self.url + ROUTE_HEALTHZ, timeout=60) as resp:
                        resp.read()
                except OSError:  # a refused or dropped probe counts, as a failure
                    self.failures += 1
                    continue
                self.probe.append(time.perf_counter() - t0)
            self.done.wait(0.01)


class Floor:
    """Plain torch: one copy of a fragment's fp32 bytes plus the weighted sum of `islands` fp32
    vectors of that size (what a merge must at least do). Its buffers are made once (touched, so
    no page faults are timed) and it is timed right before each round's pushes and right after
    its new version is pullable, so the floor and the syncer's time see the same load."""

    def __init__(self, numel: int, islands: int) -> None:
        self.vs = [torch.full((numel,), 1e-3 * (i + 1)) for i in range(islands)]
        self.out, self.copy = torch.zeros(numel), torch.zeros(numel)

    def seconds(self, numel: int, repeats: int = 3) -> float:
        """The median of `repeats` timings over the first `numel` elements."""
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = self.out[:numel]
            self.copy[:numel].copy_(self.vs[0][:numel])
            out.zero_()
            for i, v in enumerate(self.vs):
                out.add_(v[:numel], alpha=1.0 / (i + 1))
            times.append(time.perf_counter() - t0)
        return statistics.median(times)


@dataclass
class Timings:
    """Per round and fragment: last push answered -> pullable, push sent -> pullable, and the
    floor timed right before the pushes and right after the pull."""

    to_pullable: list[float] = field(default_factory=list)
    sent_to_pullable: list[float] = field(default_factory=list)
    floor_before: list[float] = field(default_factory=list)
    floor_after: list[float] = field(default_factory=list)
    # the syncer's own mergeSeconds (the pull body's metadata): round taken -> body built
    merge_seconds: list[float] = field(default_factory=list)
    # Whole pulls by what was asked (chain: have = previous version, the timed long-poll one;
    # full: no have; lag3: have = version - 3): (kind served, bytes, seconds headers..last byte)
    pulls: dict[str, list[tuple[str, int, float]]] = field(
        default_factory=lambda: {"chain": [], "full": [], "lag3": []}
    )

    def ratios(self) -> list[float]:
        """Each round's time over the faster of its two floors (the after one may share the
        machine with the syncer's evaluation: taking the faster never flatters the ratio)."""
        return [
            t / min(a, b)
            for t, a, b in zip(self.to_pullable, self.floor_before, self.floor_after, strict=True)
        ]


@dataclass
class CaseResult:
    preset: str
    params: int
    islands: int
    fragments: int
    codec: str
    shards: int
    share_bytes: list[int]  # each shard's share of P x 4 (x below is each process's own)
    startup_s: float
    idle_x: float
    startup_hwm_x: float
    peak_x: float
    peak_x_per_shard: list[float]
    to_pullable_s: list[float]
    sent_to_pullable_s: list[float]
    floor_before_s: list[float]  # timed right before each round's pushes
    floor_after_s: list[float]  # and right after its pull
    ratio_to_floor: list[float]  # each round's time over the faster of its two floors
    merge_seconds: list[float]  # the syncer's own, per round (the pull body's mergeSeconds)
    pulls: dict[str, list[tuple[str, int, float]]]  # Timings.pulls
    healthz_p50_ms: float
    healthz_p99_ms: float
    healthz_max_ms: float
    healthz_failures: int
    stop_with_checkpoint_s: float
    resume_s: float
    resume_hwm_x: float
    resumed_versions: list[int]
    versions_before: list[int]


async def versions_of(url: str, token: str) -> list[int]:
    async with SyncerClient(url, token, request_timeout=600) as client:
        return list((await client.status()).versions)


async def run_rounds(
    url: str,
    token: str,
    islands: list[str],
    shapes: dict[str, torch.Size],
    codec: str,
    rounds: int,
    only: tuple[int, int] | None = None,
    lagging: bool = False,
) -> Timings:
    """Every island pushes every fragment, `rounds` times; the times from the last push's answer
    and from its sending to the new version being pullable, and the floor right before and
    right after each. `only` = (shard, shards): `url` is that one shard's, and only its
    fragments are pushed."""
    gen = torch.Generator().manual_seed(0)
    out = Timings()
    floor: Floor | None = None
    urls = url.split(",")  # one per syncer shard: fragment f is shard f mod N's
    async with SyncerClient(url, token, request_timeout=600) as client:
        shards = client.shard_clients()
        info = [await client.join(name, 1) for name in islands][-1]
        versions = list(info.versions)
        numels = [sum(shapes[n].numel() for n in names) for names in info.fragments]
        floor = Floor(max(numels), len(islands))
        for r in range(rounds):
            for f, names in enumerate(info.fragments):
                if only is not None and f % only[1] != only[0]:
                    continue
                # Bodies are encoded before the timed part (a real island does that on its side).
                encoded = encode_tensors(
                    {n: torch.randn(shapes[n], generator=gen) * 1e-3 for n in names}, codec
                )
                metas = [
                    PushMeta(
                        island=name,
                        base_version=versions[f],
                        tokens=1000,
                        steps=10,
                        loss=2.0,
                        step_time=0.1,
                        codec=codec,
                        push_id=uuid.uuid4().hex,
                    )
                    for name in islands
                ]
                out.floor_before.append(floor.seconds(numels[f]))
                # The pull waits for the new version from before the pushes start.
                owner = 0 if only is not None else f % len(urls)
                pull = asyncio.ensure_future(
                    pull_headers(
                        urls[owner], token, f, after=versions[f], wait=600, have=versions[f]
                    )
                )
                for meta in metas:
                    sent = time.perf_counter()
                    await shards[owner].push_pseudo_gradient(f, encoded, meta)
                last = time.perf_counter()
                pulled_at, version, merge_seconds, chain = await pull
                out.pulls["chain"].append(chain)
                out.pulls["full"].append((await pull_headers(urls[owner], token, f))[3])
                if (
                    lagging and version >= 3
                ):  # a learner 3 versions behind: 2 of its updates from disk
                    lag = await pull_headers(urls[owner], token, f, have=version - 3)
                    out.pulls["lag3"].append(lag[3])
                out.floor_after.append(floor.seconds(numels[f]))
                out.merge_seconds.append(merge_seconds)
                out.to_pullable.append(pulled_at - last)
                out.sent_to_pullable.append(pulled_at - sent)
                versions[f] = version
                print(
                    f"  round {r} fragment {f}: pullable {pulled_at - last:.2f}s after the last "
                    f"push's answer, {pulled_at - sent:.2f}s after it was sent (the syncer's "
                    f"mergeSeconds {merge_seconds:.2f}s); floor "
                    f"{out.floor_before[-1]:.2f}s before, {out.floor_after[-1]:.2f}s after "
                    f"({out.ratios()[-1]:.1f}x); pulls "
                    + ", ".join(
                        f"{what} {got[-1][0]} {got[-1][1] / 2**20:.1f} MiB {got[-1][2]:.2f}s"
                        for what, got in out.pulls.items()
                        if got and (what != "lag3" or (lagging and version >= 3))
                    ),
                    flush=True,
                )
                del encoded
    del floor
    return out


async def pull_headers(
    url: str, token: str, f: int, *, after: int = -1, wait: float = 0, have: int = -1
) -> tuple[float, int, float, tuple[str, int, float]]:
    """(when the answer's headers came, its version, the syncer's mergeSeconds from its body's
    metadata, (the body's kind, its bytes, the seconds from the headers to its last byte)) of
    a long-polling pull of fragment f, asking as a learner holding version `have` does."""

    def get() -> tuple[float, int, float, tuple[str, int, float]]:
        req = urllib.request.Request(
            f"{url}/v1/fragments/{f}?after={after}&wait={wait}&have={have}",
            headers={"Authorization": f"Bearer {token}"},
        )
        while True:  # the syncer answers a long-poll 304 after at most 60 s: ask again
            try:
                with urllib.request.urlopen(req, timeout=wait + 60) as resp:
                    at = time.perf_counter()
                    head = resp.read(8)
                    n = int.from_bytes(head, "little")
                    meta = json.loads(resp.read(n))["__metadata__"]
                    size = 8 + n + len(resp.read())
                    whole = (meta[META_KIND], size, time.perf_counter() - at)
                return at, after + 1, float(meta.get(META_MERGE_SECONDS, "nan")), whole
            except urllib.error.HTTPError as err:
                if err.code != 304:
                    raise

    return await asyncio.to_thread(get)


class Syncers:
    """The job's syncer processes (one, or one per shard), started and stopped together."""

    def __init__(self, files: Any, workdir: Path, shards: int) -> None:
        self.files, self.workdir, self.shards = files, workdir, shards
        self.ports = [launch.free_port() for _ in range(shards)]
        self.procs: list[Any] = []

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}" for port in self.ports]

    def start(self, label: str, only: int | None = None) -> float:
        """Start every shard (or shard `only`), one after the other (each builds the whole model
        once at start-up: docs/shards.md), until each is ready; the seconds it took."""
        t0 = time.perf_counter()
        self.procs = []
        for i, port in enumerate(self.ports):
            if only is not None and i != only:
                continue
            state = self.workdir / "state" / (f"shard-{i}" if self.shards > 1 else "")
            proc = launch.start_syncer(
                self.files,
                port=port,
                state_dir=state,
                job_name="bench",
                log_file=self.workdir / f"syncer-{label}-{i}.log",
                extra_env={"OMP_NUM_THREADS": "1"},
                shard=i if self.shards > 1 else None,
            )
            self.procs.append(proc)
            launch.wait_ready(self.urls[i], self.files.token, timeout=1800, proc=proc)
        return time.perf_counter() - t0

    def stop(self) -> float:
        """SIGTERM every shard at once (each writes a checkpoint of what it merged); the
        seconds until every one exited."""
        t0 = time.perf_counter()
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.stop(timeout=900)
        return time.perf_counter() - t0

    def hwm(self) -> list[int]:
        return [rss_bytes(proc.pid)[1] for proc in self.procs]


def shard_shares(shapes: dict[str, torch.Size], fragments: int, shards: int) -> list[int]:
    """Each shard's share of P x 4 bytes: the fp32 bytes of the fragments it owns."""
    split = split_fragments({n: s.numel() * 4 for n, s in shapes.items()}, fragments)
    return [
        sum(shapes[n].numel() * 4 for f in range(i, fragments, shards) for n in split[f])
        for i in range(shards)
    ]


def run_case(
    preset: str,
    islands: int,
    fragments: int,
    codec: str,
    rounds: int,
    workdir: Path,
    shards: int = 1,
    eval_every: int = 1,
    lagging: bool = False,
    reverse: bool = False,
    overlap_steps: int | None = None,
) -> CaseResult:
    shapes = model_shapes(preset)
    params = sum(s.numel() for s in shapes.values())
    shares = shard_shares(shapes, fragments, shards)
    spec = job_spec(preset, islands, fragments, codec, shards, eval_every, overlap_steps)
    files = launch.write_job_files(spec, workdir / "job")
    syncers = Syncers(files, workdir, shards)
    url = ",".join(syncers.urls)
    try:
        startup = syncers.start("first")
        time.sleep(1.0)
        idle = [rss_bytes(proc.pid) for proc in syncers.procs]
        samplers = [
            Sampler(proc.pid, u) for proc, u in zip(syncers.procs, syncers.urls, strict=True)
        ]
        for sampler in samplers:
            sampler.start()
        names = [f"island-{i}" for i in range(islands)]
        if reverse:  # island-0 last: a K = M round folds every push after it (folding.py)
            names.reverse()
        job = run_rounds(url, files.token, names, shapes, codec, rounds, lagging=lagging)
        timed = asyncio.run(job)
        for sampler in samplers:
            sampler.done.set()
            sampler.join()
        peaks = [max(s.peak, hwm) for s, hwm in zip(samplers, syncers.hwm(), strict=True)]
        before = asyncio.run(versions_of(url, files.token))
        stopped = syncers.stop()
        resumed = syncers.start("resumed")
        resume_hwm = syncers.hwm()
        after = asyncio.run(versions_of(url, files.token))
    finally:
        syncers.stop()
    probe = sorted(p for s in samplers for p in s.probe)
    return CaseResult(
        preset=preset,
        params=params,
        islands=islands,
        fragments=fragments,
        codec=codec,
        shards=shards,
        share_bytes=shares,
        startup_s=startup,
        idle_x=max(i[0] / x for i, x in zip(idle, shares, strict=True)),
        startup_hwm_x=max(i[1] / x for i, x in zip(idle, shares, strict=True)),
        peak_x=max(p / x for p, x in zip(peaks, shares, strict=True)),
        peak_x_per_shard=[p / x for p, x in zip(peaks, shares, strict=True)],
        to_pullable_s=timed.to_pullable,
        sent_to_pullable_s=timed.sent_to_pullable,
        floor_before_s=timed.floor_before,
        floor_after_s=timed.floor_after,
        ratio_to_floor=timed.ratios(),
        merge_seconds=timed.merge_seconds,
        pulls=timed.pulls,
        healthz_p50_ms=1000 * probe[len(probe) // 2],
        healthz_p99_ms=1000 * probe[min(len(probe) - 1, int(len(probe) * 0.99))],
        healthz_max_ms=1000 * probe[-1],
        healthz_failures=sum(s.failures for s in samplers),
        stop_with_checkpoint_s=stopped,
        resume_s=resumed,
        resume_hwm_x=max(h / x for h, x in zip(resume_hwm, shares, strict=True)),
        resumed_versions=after,
        versions_before=before,
    )


def run_serial_shards(
    preset: str, islands: int, fragments: int, codec: str, rounds: int, workdir: Path, shards: int
) -> list[dict[str, Any]]:
    """Each shard of the job in turn, alone on the machine (for a model whose shards do not fit
    in memory side by side here): its own fragments' rounds, its stop with a checkpoint and its
    resume; one result per shard (x = its share)."""
    shapes = model_shapes(preset)
    shares = shard_shares(shapes, fragments, shards)
    spec = job_spec(preset, islands, fragments, codec, shards)
    files = launch.write_job_files(spec, workdir / "job")
    syncers = Syncers(files, workdir, shards)
    names = [f"island-{i}" for i in range(islands)]
    out = []
    for shard in range(shards):
        url, x = syncers.urls[shard], shares[shard]
        try:
            startup = syncers.start(f"first-{shard}", only=shard)
            time.sleep(1.0)
            idle = rss_bytes(syncers.procs[0].pid)
            sampler = Sampler(syncers.procs[0].pid, url)
            sampler.start()
            job = run_rounds(url, files.token, names, shapes, codec, rounds, (shard, shards))
            timed = asyncio.run(job)
            sampler.done.set()
            sampler.join()
            peak = max(sampler.peak, syncers.hwm()[0])
            before = asyncio.run(versions_of(url, files.token))
            stopped = syncers.stop()
            resumed = syncers.start(f"resumed-{shard}", only=shard)
            resume_hwm = syncers.hwm()[0]
            after = asyncio.run(versions_of(url, files.token))
        finally:
            syncers.stop()
        probe = sorted(sampler.probe)
        out.append(
            {
                "shard": shard,
                "share_bytes": x,
                "startup_s": startup,
                "idle_x": idle[0] / x,
                "startup_hwm_x": idle[1] / x,
                "peak_x": peak / x,
                "to_pullable_s": timed.to_pullable,
                "sent_to_pullable_s": timed.sent_to_pullable,
                "floor_before_s": timed.floor_before,
                "floor_after_s": timed.floor_after,
                "ratio_to_floor": timed.ratios(),
                "merge_seconds": timed.merge_seconds,
                "pulls": timed.pulls,
                "healthz_p99_ms": 1000 * probe[min(len(probe) - 1, int(len(probe) * 0.99))],
                "healthz_max_ms": 1000 * probe[-1],
                "stop_with_checkpoint_s": stopped,
                "resume_s": resumed,
                "resume_hwm_x": resume_hwm / x,
                "versions_before": before,
                "resumed_versions": after,
            }
        )
        print(json.dumps(out[-1]), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="gpt-125m")
    p.add_argument("--islands", nargs="+", type=int, default=[4, 8])
    p.add_argument("--fragments", nargs="+", type=int, default=[2])
    p.add_argument("--codec", default="int8")
    p.add_argument(
        "--rounds",
        type=int,
        default=4,
        help="rounds of pushes (4, the default: from the third on every fragment's update "
        "history is full, its steady state)",
    )
    p.add_argument("--shards", type=int, default=1, help="syncer.shards (x: each one's share)")
    p.add_argument(
        "--serial-shards",
        action="store_true",
        help="run the shards one at a time (each alone: its fragments' rounds, stop, resume)",
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=1,
        help="syncer.evalEveryOuterSteps (1, the default: a merge after an outer step waits "
        "for its evaluation, which reads the live weights under the merge lock)",
    )
    p.add_argument(
        "--lagging",
        action="store_true",
        help="also pull a 3-behind update chain per round (read back from disk; cached while "
        "its version is published, so in the peak)",
    )
    p.add_argument(
        "--push-order",
        choices=["ids", "reverse"],
        default="ids",
        help="the order each round's pushes come in: ids (island-0 first: a K = M round folded "
        "in island order folds each push as it comes) or reverse (island-0 last: with "
        "--overlap-steps 0 every fold waits for it, the worst case for the merge's path)",
    )
    p.add_argument(
        "--overlap-steps",
        type=int,
        default=None,
        help="sync.overlapSteps of the job (default: the job default, its fitted overlap); 0: "
        "learners that apply merges at fixed steps, whose K = M rounds the syncer folds in "
        'island order, not arrival order (docs/algorithm.md, "What a seed repeats")',
    )
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rev = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    results: list[dict[str, Any]] = []
    print(f"revision {rev}, load {Path('/proc/loadavg').read_text().split()[:3]}", flush=True)
    if args.serial_shards:
        for m, f in [(m, f) for m in args.islands for f in args.fragments]:
            with tempfile.TemporaryDirectory(prefix="syncer-scale-") as tmp:
                results.extend(
                    run_serial_shards(
                        args.preset, m, f, args.codec, args.rounds, Path(tmp), args.shards
                    )
                )
        if args.out is not None:
            args.out.write_text(json.dumps({"revision": rev, "results": results}, indent=1))
        return 0
    for m, f in [(m, f) for m in args.islands for f in args.fragments]:
        with tempfile.TemporaryDirectory(prefix="syncer-scale-") as tmp:
            r = run_case(
                args.preset,
                m,
                f,
                args.codec,
                args.rounds,
                Path(tmp),
                args.shards,
                args.eval_every,
                args.lagging,
                reverse=args.push_order == "reverse",
                overlap_steps=args.overlap_steps,
            )
        results.append(asdict(r))
        pullable = statistics.median(r.to_pullable_s)
        print(
            f"{r.preset} ({r.params / 1e6:.0f}M) M={m} F={r.fragments} {r.codec} "
            f"shards={r.shards} (x = each one's share; peaks {r.peak_x_per_shard}): "
            f"start-up {r.startup_s:.1f}s, idle {r.idle_x:.2f}x, start-up peak "
            f"{r.startup_hwm_x:.2f}x, peak {r.peak_x:.2f}x; last push -> pullable median "
            f"{pullable:.2f}s (max {max(r.to_pullable_s):.2f}s; from sending it "
            f"{statistics.median(r.sent_to_pullable_s):.2f}s), floor before/after median "
            f"{statistics.median(r.floor_before_s):.2f}/{statistics.median(r.floor_after_s):.2f}s, "
            f"ratio median {statistics.median(r.ratio_to_floor):.1f}x (max "
            f"{max(r.ratio_to_floor):.1f}x; the syncer's mergeSeconds median "
            f"{statistics.median(r.merge_seconds):.2f}s); pulls (kind, MiB, s median) "
            + "; ".join(
                f"{what} {got[-1][0]} {statistics.median(g[1] for g in got) / 2**20:.1f} "
                f"{statistics.median(g[2] for g in got):.2f}"
                for what, got in r.pulls.items()
                if got
            )
            + "; /healthz p50 "
            f"{r.healthz_p50_ms:.0f} ms, p99 "
            f"{r.healthz_p99_ms:.0f} ms, max {r.healthz_max_ms:.0f} ms, "
            f"{r.healthz_failures} failed; stop with checkpoint {r.stop_with_checkpoint_s:.1f}s, "
            f"resume {r.resume_s:.1f}s (peak {r.resume_hwm_x:.2f}x), versions "
            f"{r.versions_before} -> {r.resumed_versions}",
            flush=True,
        )
    print(f"load after {Path('/proc/loadavg').read_text().split()[:3]}", flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps({"revision": rev, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
