"""The learner's per-step plan between sync points, timed without a training run (issue 45).

The learners' exit line splits the training thread's sync path by part (docs/learner.md, "sync
path by part"); its "plan" is `Learner._sync_after_step` less the pushes, receipts and waits in
it: the drain trigger's checks and `FragmentSync.after_step`'s schedule, polls and holds. On
gpt-tiny's 35-55 ms CPU steps busy_link measured it at 0.35-0.85 ms a step, the largest part of
the sync path that capped utilisation near 0.975 with no waits at all.

This study builds rank 0's objects as the learner does, for the job busy_link trains (gpt-tiny,
M = 4 islands, H = 30, F = 2 fragments, the job's sync defaults, at K = M and K = 1): a real
SyncerLink (its thread and loop; its client points at a port nothing answers, and nothing is
sent), a FragmentSync that has joined (each fragment's base taken from the model's weights, as
`take_joined` takes the pulled ones) and the learner's DrainTrigger. Each step calls what the
loop calls: `count` and the link's `report` (untimed: the "report" part), then
`Learner._sync_after_step` itself, timed. The steps run between two sync points, positions
H + 1 .. H + H/F − 1 over and over. At K = 1 fragment 0's push at H is in flight and its merge
not back (a pending future: polled from its first poll on, as a merge that takes more than those
steps is); at K = M nothing is (its learner waits for a merge τ steps after the push, and
busy_link's merges are back by then: the stretch after it polls nothing); at the end of each
stretch the schedule, the push's step count and the fragments' counters go back to where the
stretch began, so the same positions repeat without a push, a receipt or a hold.

The baseline, in the same run, is the same loop calling a method that does nothing (the timer
and call overhead). Figures: the median, mean and p99 µs a step, the median's ratio to the
baseline's and its share of a 40 ms step; the switch interval is set as the learner sets it.
`--neighbour`: a thread beside the plan runs Python without a break (the link's thread while it
encodes or decodes), so the plan's figure holds its waits for the interpreter lock.
`--profile`: cProfile over the same steps, the functions with the most own time (the table in
the log says where the time goes).

    python -m bench.studies.plan_cost                       # 3 x 2,000 steps per quorum
    python -m bench.studies.plan_cost --steps 5000 --profile
"""

from __future__ import annotations

import concurrent.futures
import cProfile
import pstats
import statistics
import sys
import threading
import time
from typing import Any

import torch
from diloco_trainer.api.spec import JobSpec, parse_spec
from diloco_trainer.core.fragments import fragment_offsets, split_fragments
from diloco_trainer.core.payloads import PulledFragment
from diloco_trainer.learner.drain import DrainTrigger, share_steps
from diloco_trainer.learner.fragment_state import FragmentCounters, FragmentState, InFlight
from diloco_trainer.learner.fragment_sync import FragmentSync
from diloco_trainer.learner.loop import TRAINING_SWITCH_INTERVAL, Learner
from diloco_trainer.learner.step_costs import SyncPathPhases
from diloco_trainer.learner.syncer_client import SyncerClient
from diloco_trainer.learner.syncer_link import SyncerLink, SyncResult
from diloco_trainer.models.model import build_model

from bench.harness.common import LoadMonitor, Report, Table, base_parser, publish

# busy_link's job: gpt-tiny, four islands, H = 30, two streamed fragments.
ISLANDS = 4
INNER_STEPS = 30
FRAGMENTS = 2
SEQ_LEN = 64
# A CPU step of gpt-tiny in busy_link (35-55 ms): what a step's share is read against.
STEP_SECONDS = 0.040
# A port nothing listens on: the link is built but never sends.
NOWHERE = "http://127.0.0.1:9"


def make_spec(quorum: int) -> JobSpec:
    """busy_link's job at `quorum`: the sync defaults but the quorum and F."""
    return parse_spec(
        {
            "model": {"preset": "gpt-tiny", "seed": 0},
            "islands": {"count": ISLANDS},
            "inner": {"steps": INNER_STEPS, "seqLen": SEQ_LEN, "batchSize": 8},
            "sync": {"fragments": FRAGMENTS, "quorum": quorum},
            "stopAfter": {"tokens": 10**12},
        }
    )


class PlanBench:
    """Rank 0 of one island after its join; at K < M fragment 0's push at H in flight."""

    def __init__(self, spec: JobSpec) -> None:
        torch.manual_seed(0)
        model = build_model("gpt-tiny", SEQ_LEN)
        params = dict(model.named_parameters())
        layout = split_fragments({n: p.numel() for n, p in params.items()}, FRAGMENTS)
        client = SyncerClient(NOWHERE, "token")
        self.link = SyncerLink(client, island="island-0", replicas=1)
        self.sync = FragmentSync(spec, "island-0", self.link, params, threading.Event())
        self.sync.fragments = [FragmentState(names=names) for names in layout]
        for f, names in enumerate(layout):
            tensors = {n: params[n].detach().clone() for n in names}
            pulled = PulledFragment(
                fragment=f, version=1, outer_step=1, finished=False, tensors=tensors
            )
            self.sync.arrived[f] = SyncResult(pulled=pulled, outcome="joined", seconds=0.0)
        self.sync.offsets = fragment_offsets(INNER_STEPS, FRAGMENTS)
        with torch.no_grad():
            for weights in self.sync.take_joined().values():
                for n, t in weights.items():
                    params[n].copy_(t)
        self.sync.step_time = STEP_SECONDS
        # The learner, holding what _sync_after_step reads: its FragmentSync, link, drain
        # trigger and token count (the rest of a Learner is its model's, not the plan's).
        self.learner = Learner.__new__(Learner)
        self.learner.sync, self.learner.link, self.learner.tokens = self.sync, self.link, 0
        step_tokens = spec.inner.tokens_per_step
        self.learner.drain_at = DrainTrigger(
            share=share_steps(spec, tokens_per_step=step_tokens), steps_before=0
        )
        self.step_tokens = step_tokens
        self.pending: concurrent.futures.Future[SyncResult] = concurrent.futures.Future()
        self.phases = SyncPathPhases()
        self.stretch = INNER_STEPS // FRAGMENTS - 1  # positions between two sync points
        self.reset()

    def reset(self) -> None:
        """Back to the start of the stretch: just after fragment 0's push at H."""
        tau = self.sync.overlap_fit.fit(STEP_SECONDS)
        self.sync.position = INNER_STEPS
        self.sync.inflight = {}
        if not self.sync.blocking:
            self.sync.inflight[0] = InFlight(
                step=INNER_STEPS,
                started=time.monotonic(),
                future=self.pending,
                window=self.sync.overlap_fit.window(tau),
            )
        for state in self.sync.fragments:
            state.counters = FragmentCounters()
        self.sync.round_work = 0.0

    def in_flight(self) -> str:
        """What is in flight over the stretch, as the table says it."""
        flight = self.sync.inflight.get(0)
        if flight is None:
            return "nothing (merges back within τ)"
        return f"fragment 0, not back (first poll, wait) = {flight.window}"

    def step(self, timed: Any) -> float:
        """One step's bookkeeping; the seconds `timed(phases, began)` took."""
        # (the baseline moves no position: its counters bound its stretch)
        steps = self.sync.fragments[0].counters.steps
        if self.sync.position >= INNER_STEPS + self.stretch or steps >= self.stretch:
            self.reset()
        self.learner.tokens += self.step_tokens
        self.sync.count(self.step_tokens, 3.0, STEP_SECONDS)
        self.link.report(
            step=self.sync.position, tokens=self.learner.tokens, loss=3.0, step_time=STEP_SECONDS
        )
        began = time.perf_counter()
        timed(self.phases, began)
        return time.perf_counter() - began

    def plan(self, phases: SyncPathPhases, began: float) -> None:
        """The plan's part: the loop's own call."""
        out = self.learner._sync_after_step(phases, began)
        assert not out, "no fragment is applied between these sync points"

    @staticmethod
    def nothing(phases: SyncPathPhases, began: float) -> None:
        """The baseline: a call that does nothing."""

    def close(self) -> None:
        self.link.close(leave=False)


def busy_python(stop: threading.Event) -> None:
    """Python bytecode until `stop`: a thread that always wants the interpreter lock."""
    while not stop.is_set():
        sum(range(200))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(bench: PlanBench, steps: int, repeats: int) -> tuple[list[float], list[float]]:
    """Per-step seconds of the plan and of the baseline, interleaved repeat by repeat (so a
    burst of load on the shared machine falls on both)."""
    plan: list[float] = []
    base: list[float] = []
    for _ in range(repeats):
        base += [bench.step(bench.nothing) for _ in range(steps)]
        plan += [bench.step(bench.plan) for _ in range(steps)]
    return plan, base


def profile(bench: PlanBench, steps: int, top: int) -> Table:
    """cProfile over `steps` plan steps: the functions with the most own time."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        bench.step(bench.plan)
    prof.disable()
    stats = pstats.Stats(prof)
    rows = []
    for (path, line, name), (_cc, calls, tottime, cumtime, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        where = path.split("diloco_trainer/")[-1] if "diloco_trainer" in path else path
        rows.append((tottime, cumtime, calls, f"{where}:{line}({name})"))
    rows.sort(reverse=True)
    table = Table(
        f"own time per step, top {top} (cProfile, {steps} steps; µs under the profiler)",
        ["function", "calls a step", "own µs a step", "with callees µs a step"],
    )
    for tottime, cumtime, calls, label in rows[:top]:
        table.add(
            label,
            f"{calls / steps:.2f}",
            f"{tottime / steps * 1e6:.1f}",
            f"{cumtime / steps * 1e6:.1f}",
        )
    return table


def main() -> int:
    p = base_parser(__doc__.splitlines()[0] if __doc__ else "plan cost")
    p.add_argument("--steps", type=int, default=2000, help="steps per repeat (default 2000)")
    p.add_argument("--repeats", type=int, default=3, help="repeats, interleaved (default 3)")
    p.add_argument("--profile", action="store_true", help="also cProfile the plan's steps")
    p.add_argument("--top", type=int, default=12, help="profile rows (default 12)")
    p.add_argument(
        "--neighbour",
        action="store_true",
        help="a thread beside the plan running Python without a break (what the link's thread "
        "does while it encodes or decodes), at the learner's switch interval",
    )
    args = p.parse_args()
    if args.steps < 1 or args.repeats < 1:
        p.error("--steps and --repeats must be >= 1")
    table = Table(
        "the plan's part of _sync_after_step between sync points, µs a step",
        [
            "quorum",
            "in flight",
            "plan median",
            "plan mean",
            "plan p99",
            "baseline median",
            "baseline p99",
            "median / baseline",
            "median's share of a 40 ms step",
        ],
    )
    report = Report(
        script="bench.studies.plan_cost",
        summary=(
            "gpt-tiny, M = 4, H = 30, F = 2: Learner._sync_after_step timed between sync points "
            f"({args.repeats} x {args.steps} steps a quorum, the baseline an empty call "
            "interleaved with it); at K = 1 fragment 0's merge in flight, not back."
        ),
        tables=[table],
    )
    # The learner's own switch interval (loop.py): what a thread beside it waits for the lock.
    sys.setswitchinterval(TRAINING_SWITCH_INTERVAL)
    stop = threading.Event()
    if args.neighbour:
        report.summary += " A thread beside it runs Python without a break (--neighbour)."
        threading.Thread(target=busy_python, args=(stop,), daemon=True).start()
    with LoadMonitor() as load:
        for quorum in (ISLANDS, 1):
            bench = PlanBench(make_spec(quorum))
            try:
                for _ in range(200):  # warm-up: caches, the allocator
                    bench.step(bench.plan)
                plan, base = measure(bench, args.steps, args.repeats)
                pm, bm = statistics.median(plan), statistics.median(base)
                table.add(
                    "K = M" if quorum == ISLANDS else f"K = {quorum}",
                    bench.in_flight(),
                    f"{pm * 1e6:.1f}",
                    f"{statistics.fmean(plan) * 1e6:.1f}",
                    f"{percentile(plan, 0.99) * 1e6:.1f}",
                    f"{bm * 1e6:.2f}",
                    f"{percentile(base, 0.99) * 1e6:.2f}",
                    f"{pm / bm:.0f}x",
                    f"{pm / STEP_SECONDS:.3%}",
                )
                if args.profile:
                    t = profile(bench, args.steps, args.top)
                    t.title = f"K = {'M' if quorum == ISLANDS else quorum}: {t.title}"
                    report.tables.append(t)
            finally:
                bench.close()
    stop.set()
    return publish(report, args, load)


if __name__ == "__main__":
    raise SystemExit(main())
