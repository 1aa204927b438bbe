"""Adversaries against honest islands: does the model keep its quality at equal honest tokens?

M - 1 honest islands (real learner processes; --islands M, 3 by default, 2 and 5 too) train one
job while the M-th participant attacks the live syncer with its own island credential, as in
tests/e2e/test_adversary*.py (issues 22 and 46):

- flood: back-to-back near-zero pushes (1e-12 an element), to pull the learned norm bound down;
- ratchet: pushes in one fixed direction, five times larger every 30 pushes, up to the hard cap;
- fast_claims: zero pushes claiming one push's most steps and tokens at a 1 ms step time;
- faint_claims: the same claims, each push a fresh random sign vector of twice the least norm the
  work evidence of a job of two accepts for them (guards.WorkEvidence at its cap: the claimed
  steps x movementFactor 1.5 x 0.1 x inner.lr per element / 32): what an attacker that knows the
  rule pushes instead of zeros;
- credited_noise: the same at 1/4 of that reference per claimed step (eight times faint_claims'):
  the line a partial credit of a job of two credited in full (built and taken out again:
  docs/algorithm.md), kept to price any such rule; loud_claims at the whole reference (16 times
  faint_claims'), louder_claims at 3 times that (above an honest island's movement per claimed
  step at gpt-tiny, under the learned bound: what syncer.guards.pairClip, --pair-clip, holds);
- slot_holding: six push bodies trickled by the island's credential and six by the admin's;
- connection_flood: every connection one peer address may open, held idle (another address);
- merge_log: no participant, but the merge log unwritable (a directory) for the whole run;
- sign_flip: after every merge, three times the last merged update of the global weights, so the
  push points against the honest islands' pseudo-gradients (the direction check's case);
- step_time_claim: heartbeats claiming `stepTime: 86400` (refused) and the most the job's range
  allows (20 heartbeat timeouts), to raise the honest islands' work-rate floor (issue 46);
- paced_ratchet: pushes in one fixed direction, one step each, paced at a push per 0.05 s (inside
  any work rate), 1.5 times larger after each accepted push and half after each refused one: it
  rides the learned bound as high as the bound lets it (issue 46's two-island ratchet).

The baseline ('none') is the same job with the third island never joining, trained 25% longer;
'none_again' runs it again at the budget: its distance from the baseline is the run-to-run
variation (the merges' timing, and so their composition, differs between runs). Adversaries
start after the fragment's first ATTACK_AFTER merges.
Every other run stops at the same stopAfter.tokens; an adversary's accepted claims count towards
it, so the honest islands' merged tokens T_h can fall short: each run's final eval loss is
compared with the baseline's eval loss at T_h (piecewise linear between its evaluations, which
run after every outer step), measured in the same invocation with the same seed. Target: within
2%, read on the mean of those ratios over the seeds, beside the honest rerun's mean, with its noise
(bench/harness/adversary_report.py: at 200 steps one run's ratio moves by about 1% from the merges'
timing alone, so one seed cannot resolve 2%; five resolved three adversaries of six, eight all six).
A run cut short goes on with the same --workdir; one whose runs are all there only reports.

    python -m bench.adversary                    # 8 seeds, every adversary
    python -m bench.adversary --seeds 0 --variants none flood --no-record   # a smoke run
    python -m bench.adversary --islands 2 --variants none none_again paced_ratchet
    python -m bench.adversary --islands 2 --quality-guard 0.05/3/0 --variants none faint_claims
    python -m bench.adversary --islands 2 --end-on-faint --variants none none_again faint_claims
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import select
import shutil
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from diloco_trainer.api import credentials
from diloco_trainer.api.spec import JobSpec, parse_spec
from diloco_trainer.core import payloads
from diloco_trainer.local import free_port, start_learner, start_syncer, wait_ready, write_job_files

from bench.harness.adversary_report import Outcome, honest_tokens_upto, report
from bench.harness.common import (
    LoadMonitor,
    base_parser,
    install_signal_cleanup,
    publish,
    track,
    workdir,
)
from bench.harness.ours_harness import THREADS_ENV, OursRun

VARIANTS = (
    "none",
    "none_again",
    "flood",
    "ratchet",
    "fast_claims",
    "slot_holding",
    "connection_flood",
    "merge_log",
    "sign_flip",
    "step_time_claim",
    "paced_ratchet",
    "faint_claims",
    "credited_noise",
    "loud_claims",
    "louder_claims",
)
ISLANDS = (2, 3, 5)  # --islands: the job's islands, the adversary's included
# The honest islands and the adversary of a job of M islands (set by main from --islands).
HONEST: tuple[str, ...] = ("island-0", "island-1")
ADVERSARY = "island-2"
# The paced ratchet's pace (seconds between pushes) and its factors up and down.
PACE, GROW, SHRINK = 0.05, 1.5, 0.5


def set_islands(count: int) -> None:
    """HONEST and ADVERSARY for a job of `count` islands: the last is the adversary's."""
    global HONEST, ADVERSARY
    HONEST = tuple(f"island-{i}" for i in range(count - 1))
    ADVERSARY = f"island-{count - 1}"


ELSEWHERE = "127.0.0.3"  # the connection flood's own peer address
START_ATTEMPTS = 3
# The honest-only runs: the baseline and a second run of the same job, whose distance from the
# baseline is the run-to-run variation (merges' timing differs between runs: not deterministic).
HONEST_ONLY = ("none", "none_again")
# Merges of the fragment before an adversary starts.
ATTACK_AFTER = 4
OUTCOMES = "outcomes.jsonl"  # each finished run, in the workdir
# Seconds a status poll answered 503 is asked again before the run counts as failed.
STATUS_PATIENCE = 120.0
# The baseline trains this much longer than the budget (its final loss is not compared).
BASELINE_MARGIN = 1.25


def job_spec(args: argparse.Namespace, seed: int, variant: str) -> JobSpec:
    budget = len(HONEST) * args.steps * args.batch_size * args.seq_len
    if variant == "none":  # its curve must reach the honest tokens of every other run
        budget = int(budget * BASELINE_MARGIN)
    return parse_spec(
        {
            "model": {"preset": args.preset, "seed": seed},
            "data": {"evalTokens": args.eval_tokens, "seed": seed},
            "islands": {"count": len(HONEST) + 1},
            "inner": {
                "lr": args.inner_lr,
                "warmupSteps": args.warmup,
                "steps": args.inner_steps,
                "batchSize": args.batch_size,
                "seqLen": args.seq_len,
            },
            # fp32 pushes (the adversary writes them by hand); one fragment; a round of the
            # honest islands (the last is awaited, or the adversary).
            "sync": {"fragments": 1, "quorum": len(HONEST), "compression": "none"},
            "stopAfter": {"tokens": budget},
            # Checkpoints every 5 outer steps: the cadence at which the syncer's quality guard
            # keeps its best-evaluated model (jobs.py), which a job it ends exports.
            "syncer": {
                "evalEveryOuterSteps": 1,
                "checkpoint": {"everyOuterSteps": 5},
                **guard_spec(args.quality_guard),
                # syncer.guards.endOnFaint (a job of two ends at its best once an island is
                # named faint with merged pushes; off by default)
                "guards": {
                    **({"endOnFaint": True} if args.end_on_faint else {}),
                    # syncer.guards.pairClip (a job of two: a push's Δ per claimed step held to
                    # that x the other island's; 0, the default, off)
                    **({"pairClip": args.pair_clip} if args.pair_clip else {}),
                    # syncer.guards.pairCredit (a job of two: a push's merge credits one round
                    # of its island's own steps as work at most; off by default)
                    **({"pairCredit": True} if args.pair_credit else {}),
                },
            },
        }
    )


def guard_spec(setting: str | None) -> dict[str, Any]:
    """--quality-guard MARGIN/PATIENCE/WARMUP as the spec's syncer.qualityGuard (none: the
    defaults).

    >>> guard_spec("0.05/3/0")
    {'qualityGuard': {'margin': 0.05, 'patience': 3, 'warmupOuterSteps': 0}}
    >>> guard_spec(None)
    {}
    """
    if setting is None:
        return {}
    margin, patience, warmup = setting.split("/")
    guard = {"margin": float(margin), "patience": int(patience), "warmupOuterSteps": int(warmup)}
    return {"qualityGuard": guard}


class Adversary(threading.Thread):
    """The third participant: one of the attacks above, until `stop` is set."""

    def __init__(self, kind: str, job: OursRun) -> None:
        super().__init__(daemon=True, name=f"adversary-{kind}")
        assert job.files is not None
        self.kind, self.job = kind, job
        self.stop = threading.Event()
        self.answers: dict[str, int] = {}  # its requests' answers, by status
        self.sent = 0
        self.root = job.files.token
        self.token = credentials.island_token(self.root, ADVERSARY)

    def count(self, what: str) -> None:
        self.answers[what] = self.answers.get(what, 0) + 1

    def request(self, method: str, path: str, body: bytes | None, token: str) -> tuple[int, Any]:
        req = urllib.request.Request(self.job.url + path, data=body, method=method)
        req.add_header("Authorization", f"Bearer {token}")
        req.add_header("Content-Type", "application/octet-stream" if body else "application/json")
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()

    def push(self, tensors: dict[str, torch.Tensor], **meta: Any) -> bool:
        base = self.job.status()["versions"][0]
        # A loss of its own each time: the same body again would be answered as a replay.
        self.sent += 1
        loss = 5.0 + self.sent * 1e-6
        full = {"island": ADVERSARY, "baseVersion": base, "codec": "none", "loss": loss}
        full |= {"steps": 1, "tokens": 1, "stepTime": 0.01} | meta
        body = payloads.encode_body(tensors, full)
        code, raw = self.request("POST", "/v1/fragments/0/push", body, self.token)
        # 200 is also the answer once the job has finished: only "accepted" counts as taken.
        accepted = code == 200 and b'"accepted": true' in raw
        self.count("accepted" if accepted else str(code))
        return accepted

    def shapes(self) -> dict[str, torch.Tensor]:
        join = b'{"island": "%s", "replicas": 1}' % ADVERSARY.encode()
        self.request("POST", "/v1/join", join, self.token)
        code, raw = self.request("GET", "/v1/fragments/0?after=-1", None, self.token)
        assert code == 200, code
        return payloads.decode_body(raw)[0]

    def run(self) -> None:
        try:
            getattr(self, self.kind)()
        except OSError as err:  # the job finished and the syncer went away
            self.count(type(err).__name__)

    def flood(self) -> None:
        tiny = {n: torch.full_like(t, 1e-12) for n, t in self.shapes().items()}
        while not self.stop.is_set():
            self.push(tiny)

    def ratchet(self) -> None:
        gen = torch.Generator().manual_seed(0)
        sign = {
            n: torch.sign(torch.randn(t.shape, generator=gen)) for n, t in self.shapes().items()
        }
        k = 0
        while not self.stop.is_set():
            value = 1e-4 * 5 ** min(k // 30, 6)  # up to 1.56 an element: past the hard cap
            self.push({n: value * s for n, s in sign.items()})
            k += 1

    def paced_ratchet(self) -> None:
        gen = torch.Generator().manual_seed(0)
        sign = {
            n: torch.sign(torch.randn(t.shape, generator=gen)) for n, t in self.shapes().items()
        }
        value = 1e-4
        while not self.stop.wait(PACE):
            if self.push({n: value * s for n, s in sign.items()}):
                value *= GROW
            else:
                value *= SHRINK

    def step_time_claim(self) -> None:
        self.shapes()
        most = 20 * self.job.spec.sync.heartbeat_timeout_seconds  # validation.step_time_limit
        while not self.stop.wait(0.5):
            for claim in (86400.0, min(most, 86400.0)):
                doc = {"island": ADVERSARY, "step": 1, "tokens": 1, "stepTime": claim}
                raw = json.dumps(doc).encode()
                code, _ = self.request("POST", "/v1/heartbeat", raw, self.token)
                self.count(f"heartbeat {code}")

    def weights(self) -> dict[str, torch.Tensor]:
        code, raw = self.request("GET", "/v1/fragments/0?after=-1", None, self.token)
        assert code == 200, code
        return payloads.decode_body(raw)[0]

    def sign_flip(self) -> None:
        self.shapes()
        version, before = self.job.status()["versions"][0], self.weights()
        while not self.stop.wait(0.2):
            now = self.job.status()["versions"][0]
            if now == version:
                continue
            after = self.weights()
            # θ moved by -lr x the merged Δ: 3 x (after - before) points against the honest Δs.
            self.push({n: 3.0 * (after[n] - before[n]) for n in after})
            version, before = now, after

    def fast_claims(self) -> None:
        spec = self.job.spec
        zero = {n: torch.zeros_like(t) for n, t in self.shapes().items()}
        steps = 4 * spec.inner.steps  # guards.STEP_ROUNDS x H (no overlap)
        tokens = steps * spec.inner.tokens_per_step
        while not self.stop.is_set():
            self.push(zero, steps=steps, tokens=tokens, stepTime=0.001)

    def faint_claims(self, share: float = 2.0 / 32.0) -> None:
        spec = self.job.spec
        shapes = self.shapes()
        steps = 4 * spec.inner.steps
        tokens = steps * spec.inner.tokens_per_step
        # `share` of guards.WorkEvidence's reference at its highest (its step cap: movementFactor
        # x 0.1 x lr per element and step): twice its bar (EVIDENCE_RATIO 32) by default.
        factor = spec.syncer.guards.movement_factor
        value = share * steps * factor * 0.1 * spec.inner.lr
        gen = torch.Generator().manual_seed(1)
        while not self.stop.is_set():
            noise = {n: torch.sign(torch.randn(t.shape, generator=gen)) for n, t in shapes.items()}
            self.push(
                {n: value * s for n, s in noise.items()}, steps=steps, tokens=tokens, stepTime=0.001
            )

    def credited_noise(self) -> None:
        self.faint_claims(share=1.0 / 4.0)  # the taken-out partial credit's full-credit line

    def loud_claims(self) -> None:
        self.faint_claims(share=1.0)  # the reference's cap: the other island's bar at its highest

    def louder_claims(self) -> None:
        # 3 x loud_claims: a push's norm ~19 at gpt-tiny (H = 10), under the learned bound
        # (normFactor 10 x the honest island's median push, 16-32 early) while the honest
        # pushes stay above ~1.9: noise louder than an honest island per claimed step (loud's
        # is below it), which syncer.guards.pairClip holds to the honest figure (issue 46)
        self.faint_claims(share=3.0)

    def slot_holding(self) -> None:
        self.shapes()
        head = (
            "POST /v1/fragments/0/push HTTP/1.1\r\nHost: s\r\nAuthorization: Bearer {}\r\n"
            "Content-Type: application/octet-stream\r\nContent-Length: 100000000\r\n\r\n\0"
        )
        tokens = [self.token] * 6 + [credentials.admin_token(self.root)] * 6

        def open_one(token: str) -> socket.socket:
            sock = socket.create_connection(("127.0.0.1", self.job.port), timeout=10)
            sock.sendall(head.format(token).encode())
            return sock

        held = [open_one(t) for t in tokens]
        self._hold(held, lambda i: open_one(tokens[i]), trickle=b"\0")

    def connection_flood(self) -> None:
        size = self.job.spec.syncer.limits.max_connections

        def open_one(_: int) -> socket.socket:
            return socket.create_connection(
                ("127.0.0.1", self.job.port), timeout=10, source_address=(ELSEWHERE, 0)
            )

        self._hold([open_one(i) for i in range(size)], open_one, trickle=b"")

    def _hold(
        self, socks: list[socket.socket], reopen: Callable[[int], socket.socket], trickle: bytes
    ) -> None:
        """Keep `socks` open: one closed by the syncer (answered, timed out) is opened again;
        `trickle` is sent on each every second (a body that never ends)."""
        try:
            while not self.stop.wait(1.0):
                readable, _, _ = select.select(socks, [], [], 0)
                for sock in readable:
                    i = socks.index(sock)
                    sock.close()
                    self.count("reopened")
                    socks[i] = reopen(i)
                for sock in socks:
                    if trickle:
                        with contextlib.suppress(OSError):  # reopened at the next turn
                            sock.sendall(trickle)
        finally:
            for sock in socks:
                sock.close()

    def merge_log(self) -> None:
        log_file = self.job.workdir / "syncer" / "merges.jsonl"
        if log_file.exists():
            log_file.rename(log_file.with_name("merges.jsonl.aside"))
        log_file.mkdir(parents=True)


@dataclass
class ObservedRun(OursRun):
    """The job, its status polled as an operator would: a 503 (the syncer busy, e.g. its
    connections held by a flood) is counted and asked again, not a failed run."""

    busy: int = 0  # status polls answered 503

    def status(self) -> dict[str, Any]:
        deadline = time.monotonic() + STATUS_PATIENCE
        while True:
            try:
                return super().status()
            except urllib.error.HTTPError as err:
                if err.code != 503 or time.monotonic() > deadline:
                    raise
                self.busy += 1
            time.sleep(0.5)


def start_job(spec: JobSpec, where: Path, variant: str) -> ObservedRun:
    """The syncer, then the two honest islands' learners (the third island's slot is the
    adversary's, or empty)."""
    job = ObservedRun(spec=spec, workdir=where, job_name=f"adversary-{variant}")
    # A run cut short left its syncer's state (its stop checkpointed): a fresh job, not a resume.
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    job.files = write_job_files(spec, where)
    for attempt in range(START_ATTEMPTS):
        job.port = free_port()  # another process may take it before the syncer binds: retry
        job.syncer = track(
            start_syncer(
                job.files,
                port=job.port,
                state_dir=where / "syncer",
                job_name=job.job_name,
                log_file=where / f"syncer.{attempt}.log",
                extra_env=THREADS_ENV,
            )
        )
        try:
            wait_ready(job.url, job.files.token, 120, proc=job.syncer)
            return job
        except RuntimeError:
            job.syncer.stop(timeout=10)
            if attempt + 1 == START_ATTEMPTS:
                raise
    raise AssertionError("unreachable")


def start_learners(job: OursRun) -> None:
    assert job.files is not None
    for i, name in enumerate(HONEST):
        job.learners[i] = track(
            start_learner(
                job.files,
                syncer_url=job.url,
                island=name,
                island_index=i,
                log_file=job.workdir / f"{name}.log",
                master_port=free_port(),
                job_name=job.job_name,
                extra_env=THREADS_ENV,
            )
        )


def run_variant(args: argparse.Namespace, seed: int, variant: str, where: Path) -> Outcome:
    spec = job_spec(args, seed, variant)
    began = time.monotonic()
    job = start_job(spec, where, variant)
    adversary = None if variant in HONEST_ONLY else Adversary(variant, job)
    named: dict[str, list[str]] = {}  # health problem kind -> islands it named (polled)
    try:
        if adversary is not None and variant == "merge_log":
            adversary.start()
            adversary.join()  # the fault is in place before the first merge
        start_learners(job)
        if adversary is not None and variant != "merge_log":
            # Attacks begin once training has (the learned bound warmed up): before the
            # learners join, an adversary only gets itself dropped.
            job.wait_finished(args.timeout, until=lambda st: st["versions"][0] >= ATTACK_AFTER)
            adversary.start()
        status = job.wait_finished(args.timeout, on_status=lambda st: note_named(st, named))
        # The final evaluation runs after the last merge (jobs.py); wait for it.
        deadline = time.monotonic() + 60
        while status["evalHistory"][-1]["outerStep"] < status["outerStep"]:
            if time.monotonic() > deadline:
                raise TimeoutError("no evaluation of the final outer step")
            time.sleep(0.5)
            status = job.status()
    finally:
        if adversary is not None:
            adversary.stop.set()
            adversary.join(timeout=30)
        job.stop()
    islands = status["islands"]
    eval_loss, ended = kept_model(status)
    kept_tokens = None
    if ended:  # the guard's end: the honest tokens its kept checkpoint holds (the merge log)
        merges = (where / "syncer" / "merges.jsonl").read_text().splitlines()
        kept = status.get("checkpoint")
        step = 0 if kept is None else int(kept["outerStep"])
        kept_tokens = honest_tokens_upto([json.loads(m) for m in merges], HONEST, step)
    return Outcome(
        variant=variant,
        seed=seed,
        honest_tokens=sum(int(islands[i]["mergedTokens"]) for i in HONEST if i in islands),
        eval_loss=eval_loss,
        history=sorted(
            (float(p["tokens"]), float(p["evalLoss"]))
            for p in status["evalHistory"]
            if p.get("evalLoss") is not None
        ),
        answers=dict(adversary.answers) if adversary is not None else {},
        refusals=status.get("refusals") or {},
        honest_states=[islands[i]["state"] if i in islands else "-" for i in HONEST],
        seconds=time.monotonic() - began,
        status_busy=job.busy,
        ended=ended,
        kept_tokens=kept_tokens,
        named=named,
    )


# A detection's message names its island first ("island island-0's last 8 pushes ...").
NAMED_ISLAND = re.compile(r"island (\S+?)'s last")
NAMING_KINDS = ("islandWorkUnsupported", "islandAtBound")


def note_named(status: dict[str, Any], named: dict[str, list[str]]) -> None:
    """Add the islands the status's detection problems name now to `named` (kind -> islands,
    in the order first seen): polled every half second, so a naming shorter than that can be
    missed.

    >>> named: dict[str, list[str]] = {}
    >>> msg = "island island-1's last 8 pushes to fragment 0 moved less than 1/4 ..."
    >>> note_named({"health": {"problems": [{"kind": "islandWorkUnsupported", "message": msg}]}},
    ...            named)
    >>> named
    {'islandWorkUnsupported': ['island-1']}
    """
    for p in (status.get("health") or {}).get("problems") or []:
        if p.get("kind") in NAMING_KINDS:
            seen = named.setdefault(p["kind"], [])
            for island in NAMED_ISLAND.findall(p.get("message") or ""):
                if island not in seen:
                    seen.append(island)


def kept_model(status: dict[str, Any]) -> tuple[float, str]:
    """The eval loss of the model the job keeps, and how it ended ("" at its budget): the
    final evaluation's, or after the syncer's quality guard ended the job (health problem
    evalLossRose) or the syncer ended a job of two for an island's faint claims
    (faintIslandEnded), the evaluation of the checkpoint it kept (its final one, the exported
    one)."""
    history = status["evalHistory"]
    problems = (status.get("health") or {}).get("problems") or []
    kinds = {p.get("kind") for p in problems}
    if not kinds & {"evalLossRose", "faintIslandEnded"}:
        return float(history[-1]["evalLoss"]), ""
    kept = status.get("checkpoint")
    step = 0 if kept is None else int(kept["outerStep"])
    loss = min(float(e["evalLoss"]) for e in history if int(e["outerStep"]) == step)
    who = "faint claims named" if "faintIslandEnded" in kinds else "quality guard"
    return loss, f"{who} at outer step {status['outerStep']} (kept {step})"


def load_outcomes(path: Path) -> dict[tuple[int, str], Outcome]:
    """The runs a previous invocation with the same --workdir finished."""
    if not path.exists():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        doc = json.loads(line)
        doc["history"] = [tuple(p) for p in doc["history"]]
        o = Outcome(**doc)
        out[(o.seed, o.variant)] = o
    return out


def main() -> int:
    p = base_parser(
        __doc__ or "",
        preset="gpt-tiny",
        inner_steps=10,
        steps=200,
        batch_size=8,
        seq_len=64,
        inner_lr=3e-3,
        warmup=20,
        eval_tokens=8192,
        seeds=[0, 1, 2, 3, 4, 5, 6, 7],
        timeout=900.0,
        islands=3,  # the adversary's included: M - 1 honest learners (2, 3 or 5)
    )
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument(
        "--quality-guard",
        default=None,
        metavar="MARGIN/PATIENCE/WARMUP",
        help="syncer.qualityGuard of every run (default: the spec's defaults), e.g. 0.05/3/0: "
        "a tighter guard's trips and kept models (issue 46; bench/studies/guard_signal.py "
        "replays the rule on finished runs)",
    )
    p.add_argument(
        "--end-on-faint",
        action="store_true",
        help="syncer.guards.endOnFaint in every run (off by default): a job of two ends at "
        "its best-evaluated checkpoint once an island is named faint with merged pushes",
    )
    p.add_argument(
        "--pair-clip",
        type=float,
        default=0.0,
        metavar="FACTOR",
        help="syncer.guards.pairClip in every run (0, the default: off): in a job of two a "
        "push's pseudo-gradient per claimed step is held to FACTOR x the other island's recent "
        "median (issue 46's loud claims)",
    )
    p.add_argument(
        "--pair-credit",
        action="store_true",
        help="syncer.guards.pairCredit in every run (off by default): in a job of two a push's "
        "merge credits at most one round of its island's own steps (H_i + overlap) as work, so "
        "claimed rounds fold the outer momentum no more than one round does",
    )
    p.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: report the runs --workdir holds (of --seeds and --variants)",
    )
    args = p.parse_args()
    if args.report_only and args.workdir is None:
        p.error("--report-only reads the runs of a --workdir")
    if args.islands not in ISLANDS:
        p.error(f"--islands is one of {list(ISLANDS)}, got {args.islands}")
    if "none" not in args.variants:
        args.variants = ["none", *args.variants]
    set_islands(args.islands)
    install_signal_cleanup()
    outcomes = []
    with LoadMonitor() as load, workdir(args.workdir, "adversary") as root:
        saved = load_outcomes(root / OUTCOMES)  # a run cut short goes on from these (--workdir)
        for seed in args.seeds:
            for variant in args.variants:
                if args.report_only and (seed, variant) not in saved:
                    continue
                o = saved.get((seed, variant)) or run_variant(
                    args, seed, variant, root / f"{variant}-{seed}"
                )
                if (seed, variant) not in saved:
                    with (root / OUTCOMES).open("a") as f:
                        f.write(json.dumps(asdict(o)) + "\n")
                print(
                    f"seed {seed} {variant}: eval loss {o.eval_loss:.4f}, "
                    f"honest tokens {o.honest_tokens}, {o.seconds:.0f}s",
                    flush=True,
                )
                outcomes.append(o)
    return publish(report(outcomes, args), args, load)


if __name__ == "__main__":
    raise SystemExit(main())
