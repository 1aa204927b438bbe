"""Busy link: is the accelerator busy, and the model as good, when a sync takes a share of a round?

Real training (a syncer and M learner processes, as `diloco run` starts them: bench/harness/
ours_harness.py) with every learner-syncer connection through one rate/latency relay
(bench/harness/relay.py, both directions in one token bucket: one link all islands share). The link
is chosen so that a round's sync traffic takes L = 0, 25, 50 and 100% of a round's compute time:

1. per seed, the L = 0 run at K = M goes first, over the relay with no limit and no added latency;
   it gives the round's compute time T = H x the learners' median training seconds per step (their
   own progress lines) and the bytes a round puts on the link, B: the relay's bytes per outer step
   after the first (pushes, pulls and heartbeats of every island together; the joins' full pulls
   left out);
2. every other run's link has the rate B / (L x T) (Mbit/s in the table) and, for L > 0, an added
   one-way latency (--latency-ms, RTT twice that); the share each run actually saw (its own bytes
   per round / rate / its own round's compute time) is reported beside the nominal L.

That calibration is each seed's own, under its own run's load: on a shared host the same nominal L
then means a different Mbit/s from seed to seed and command to command (and a different L seen).
`--link-rates L=MBIT ...` pins the link instead: the run at share L gets MBIT Mbit/s, every seed,
torchft's rows too, whatever the L = 0 run measured (every L > 0 in --shares needs one; L = 0 stays
unlimited and still runs, the base of the loss and time figures). The rates to pin come from one
calibration run (quiet, seed 0): `--seeds 0 --quorums --shares 0` prints, and its report notes,
the `--link-rates` for the shares asked for at that calibration (`--pin-shares`, default 25 50 100).
The table marks a pinned link "(pinned)", and L seen stays per run: with a pinned link it is the
load, not the link, that moves it.

Per run, read from the learners' own progress lines (training / sync path / waiting, every 20
steps) and the syncer's evaluations:
- utilisation: time in inner steps / wall time, summed over the islands' windows (their start-up
  and the final evaluation left out); and the waiting and sync-path shares;
- eval loss at exactly equal tokens processed (interpolated at the budget, as
  bench/decoupled_quality reads it), and its ratio to the same quorum's L = 0 run: read after the
  run on --offline-eval-tokens held-out tokens (32,768 by default) from the global weights of the
  syncer's checkpoints around the budget (one kept every outer step), not on the syncer's live
  evaluations (--eval-tokens, 4,096: small, since they run on the training cores every outer
  step, and one 4,096-token set against another moved the loss ratio of two gpt-mini models
  at equal tokens by 0.23-0.50%, 1 sd, bench.studies.eval_sets; 0 reads the live ones);
- wall time until the run's loss first reaches the L = 0 blocking (K = M) run's loss at the
  budget, as a multiple of that run's own time to it (every run trains on past the budget, to
  --past-budget x it, so that one a little behind at the budget still gets there): read on the
  offline curve (every checkpoint evaluated on the --offline-eval-tokens set after the run,
  linear between the two around the crossing; with 0, the first live evaluation at or below
  it), beside its floor on that link: the L = 0 run's time plus the last round's pushes on the
  link, which no merge can come before at the same quality per token (the bytes a round x the
  share the relay carried up / the rate). In a short run that floor is far from 1: at L = 50%
  and 8 rounds of 6 s the pushes take ~1.5 s of a ~55 s run.
Quorums: K = M and the job's default (1). Sync settings are the job's defaults (`--sync KEY=VALUE`
overrides one, as in bench/decoupled_quality).

torchft 0.2.0's DiLoCo, side by side in the same run (after each seed's runs of ours; skipped with
--skip-torchft, or where a shaped network namespace cannot be made, the reason printed): the same
preset, M, H, steps, token budget and past-budget limit, every replica group in every sync (K = M),
at each L's link rate. Its gloo ring connects the replicas directly, so no relay can sit in it:
the lighthouse and replicas run in a network namespace whose loopback is limited to the same rate
with tc tbf (bench/harness/netns.py, as bench/bandwidth does; root). That link has no added
latency (no netem in this kernel): ours' RTT is 2 x --latency-ms where L > 0, torchft's ~0
(--latency-ms 0 compares like with like). It runs with fragment_sync_delay 0 and with the largest
sensible delay (torchft_delays: H/2 with its one fragment; --torchft-delays overrides),
fragment_update_alpha 0 (its default). Per run: utilisation
as bench/bandwidth measures it (its replicas' compute seconds / wall, from each replica's first
commit to its end), its loss at equal tokens (its global weights saved at every commit and
evaluated afterwards, as bench/decoupled_quality reads them) against the same delay at L = 0, and
its wall time to ours' K = M, L = 0 loss against that run's own time. This process holds one copy
of the model at a time (evaluating torchft's saved weights one commit after another).

    python -m bench.busy_link                       # gpt-tiny, M=4, H=30, 300 steps, seed 0
    python -m bench.busy_link --seeds 0 1 2 --sync lateMergeRule=keep --skip-torchft
    python -m bench.busy_link --quick --no-record   # smoke run: M=2, H=10, 60 steps, L=0, 50
    python -m bench.busy_link --seeds 0 --quorums --shares 0 --skip-torchft   # calibrate once
    python -m bench.busy_link --seeds 0 1 --shares 0 50 100 --link-rates 50=12.7 100=6.35
"""

from __future__ import annotations

import json
import math
import re
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from diloco_trainer.api.contract import PACE_STEP
from diloco_trainer.api.spec import JobSpec
from diloco_trainer.local import Proc
from diloco_trainer.models.parts import build_parts, evaluate
from safetensors.torch import load_model

from bench.bandwidth import start_relay
from bench.decoupled_quality import budget, island_progress, make_spec, run_torchft
from bench.harness import netns
from bench.harness.common import (
    LoadMonitor,
    Report,
    Table,
    base_parser,
    fmt_pct,
    fmt_ratio,
    install_signal_cleanup,
    publish,
    ratio,
    verdict,
    workdir,
)
from bench.harness.decoupled_quality_report import interp, loss_at_tokens, time_to_loss
from bench.harness.flags import INNER_OPTIMIZER, TRAINING
from bench.harness.measure import value_at
from bench.harness.merge_stats import merge_staleness
from bench.harness.ours_harness import OursRun
from bench.harness.peer_training import read_progress

# A learner's progress line's split of its window (learner/step_costs.WindowCosts.line).
COSTS = re.compile(
    r"(\d+) steps: ([\d.]+)s training, ([\d.]+)s sync path, ([\d.]+)s waiting for the syncer"
)


@dataclass(frozen=True)
class Split:
    """Seconds of a learner's progress windows: training, sync path, waiting."""

    steps: int = 0
    training: float = 0.0
    sync_path: float = 0.0
    waiting: float = 0.0

    @property
    def wall(self) -> float:
        return self.training + self.sync_path + self.waiting

    @property
    def utilisation(self) -> float:
        """Time in inner steps / wall time (NaN for no windows)."""
        return self.training / self.wall if self.wall > 0 else math.nan

    def __add__(self, other: Split) -> Split:
        return Split(
            self.steps + other.steps,
            self.training + other.training,
            self.sync_path + other.sync_path,
            self.waiting + other.waiting,
        )


def window_split(log_text: str, *, skip_first: int = 1) -> Split:
    """The sum of a learner's progress windows, the first `skip_first` left out (start-up: the
    first round's window holds the join and the first compile of the step)."""
    windows = [
        Split(int(m[1]), float(m[2]), float(m[3]), float(m[4])) for m in COSTS.finditer(log_text)
    ]
    return sum(windows[skip_first:], Split())


def link_rate(bytes_per_round: float, round_seconds: float, share: float) -> float | None:
    """Bytes/s of a link on which a round's `bytes_per_round` take `share` of `round_seconds`
    (None: share 0, an unlimited link)."""
    if share < 0 or round_seconds <= 0 or bytes_per_round <= 0:
        raise ValueError(
            f"share ({share}) must be >= 0, round seconds ({round_seconds}) and bytes "
            f"({bytes_per_round}) > 0"
        )
    return None if share == 0 else bytes_per_round / (share * round_seconds)


def parse_link_rates(items: Sequence[str]) -> dict[float, float]:
    """`--link-rates`' L=MBIT items as {L (%): bytes/s}. L > 0 (L = 0 is the unlimited link) and
    MBIT > 0; an L given twice is refused (which one was meant?)."""
    out: dict[float, float] = {}
    for item in items:
        share_s, sep, rate_s = item.partition("=")
        try:
            share, rate = float(share_s), float(rate_s)
        except ValueError:
            share = rate = math.nan
        if not sep or not share > 0 or not rate > 0 or math.isinf(share) or math.isinf(rate):
            raise ValueError(f"{item!r}: want L=MBIT with L > 0 (%) and MBIT > 0 (Mbit/s)")
        if share in out:
            raise ValueError(f"{item!r}: L = {share:g}% given twice")
        out[share] = rate * 1e6 / 8
    return out


def choose_rate(
    share: float, pinned: dict[float, float], calib: dict[str, float]
) -> tuple[float | None, bool]:
    """The link's bytes/s at share L (%) and whether it was pinned: None at L = 0 (unlimited);
    the pinned rate where `--link-rates` gives one; else this seed's calibration's
    (link_rate of its bytes and round)."""
    if share == 0:
        return None, False
    if share in pinned:
        return pinned[share], True
    if not calib:
        raise SystemExit("--shares must include 0 (the calibration run), or pin L's rate")
    return link_rate(calib["bytes"], calib["round"], share / 100), False


def pin_args(calib: dict[str, float], shares: Sequence[float]) -> str:
    """The `--link-rates` that pin a calibration's links at `shares` (Mbit/s, 4 significant
    digits)."""
    items = []
    for share in sorted(set(shares) - {0}):
        rate = link_rate(calib["bytes"], calib["round"], share / 100)
        assert rate is not None
        items.append(f"{share:g}={rate * 8 / 1e6:.4g}")
    return "--link-rates " + " ".join(items)


def mbit(rate_bytes: float | None) -> str:
    """A rate in bytes/s as Mbit/s for the table ('unlimited' for None)."""
    return "unlimited" if rate_bytes is None else f"{rate_bytes * 8 / 1e6:.3g} Mbit/s"


def relay_carried(wd: Path) -> tuple[int, int]:
    """Bytes the run's relay carried (up: towards the syncer, down) from its --stats file; (0,
    0) if none."""
    stats = wd / "relay-stats.json"
    if not stats.exists():
        return 0, 0
    carried = json.loads(stats.read_text())
    return int(carried.get("up", 0)), int(carried.get("down", 0))


def relay_bytes(wd: Path) -> int:
    """Bytes the run's relay carried, both ways (0 if none)."""
    return sum(relay_carried(wd))


def wildcard_free_port() -> int:
    """A TCP port free on every address a moment ago (the syncer binds 0.0.0.0). One free on
    127.0.0.1 only (local.free_port) was taken three times in a row on a machine with thousands
    of TIME-WAIT connections of other engineers' tests."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("0.0.0.0", 0))
        return int(s.getsockname()[1])


class LinkRun(OursRun):
    """OursRun whose syncer gets a port free on every address (wildcard_free_port)."""

    def pick_port(self) -> int:
        return wildcard_free_port()


def run_over_link(
    spec: JobSpec,
    wd: Path,
    *,
    rate: float | None,
    latency_ms: float,
    timeout: float,
    learner_env: dict[str, str] | None = None,
    on_sample: Callable[[int, list[int]], None] | None = None,
) -> dict[str, Any]:
    """One job of ours with every island behind one relay; its history (seconds, tokens
    processed, eval loss), the islands' window splits, the relay's bytes and the rounds run.
    `on_sample(outer step, pids)` is called at each status poll with the run's processes (the
    syncer, the learners, the relay: busy_emulated's CPU floor)."""
    relay: dict[str, Any] = {}

    def route(_i: int, url: str) -> str:
        if not relay:
            target = int(url.rsplit(":", 1)[1])
            relay["proc"], relay["port"] = start_relay(
                wd, target, None if rate is None else rate * 8 / 1e6, latency_ms
            )
        return f"http://127.0.0.1:{relay['port']}"

    run = LinkRun(spec=spec, workdir=wd, route=route, learner_env=dict(learner_env or {}))
    run.start()
    t0 = time.time()
    samples: list[tuple[int, int]] = []  # (outer step, relay bytes) at each status poll

    def poll(st: dict[str, Any]) -> None:
        samples.append((int(st["outerStep"]), relay_bytes(wd)))
        if on_sample is not None:
            procs = [run.syncer, *run.learners.values(), relay.get("proc")]
            on_sample(int(st["outerStep"]), [p.pid for p in procs if p is not None])

    try:
        st = run.wait_finished(timeout=timeout, on_status=poll)
        for proc in run.learners.values():
            proc.wait(120)  # learners exit once they see finished=true
        wall = time.time() - t0
    finally:
        run.stop()
        if relay:
            proc_: Proc = relay["proc"]
            proc_.stop()
    step_tokens = spec.inner.batch_size * spec.inner.seq_len
    progress = {i: island_progress(p.log_file, step_tokens) for i, p in run.learners.items()}

    def processed(t: float) -> float:
        return processed_at(progress, t)

    history = [(0.0, 0.0, float(st["initialEvalLoss"]))]
    history += [(h["time"] - t0, processed(h["time"]), h["evalLoss"]) for h in st["evalHistory"]]
    splits = [window_split(p.log_text()) for p in run.learners.values()]
    up, down = relay_carried(wd)
    return {
        "t0": t0,
        "up_share": up / (up + down) if up + down else 0.0,
        "history": history,
        "wall": wall,
        "splits": splits,
        "bytes_per_round": bytes_per_round(samples),
        "merges": int(st.get("mergeCount", 0)),
        "staleness": merge_staleness(wd / "syncer", [p.log_file for p in run.learners.values()]),
        "rounds": int(st["outerStep"]),
        "learner_logs": [p.log_file for p in run.learners.values()],
        "progress": progress,
        "workdir": wd,
    }


def processed_at(progress: dict[int, list[tuple[float, int]]], t: float) -> float:
    """Tokens the islands had processed at wall time t (their progress lines, interpolated)."""
    return sum(interp([(a, float(b)) for a, b in pts], t) for pts in progress.values())


T = TypeVar("T")


def checkpoints_around(saved: Sequence[tuple[float, T]], tokens: float) -> list[tuple[float, T]]:
    """Of the checkpoints (tokens processed when each was written, its folder), the last at or
    before `tokens` and the first at or after it (one when one sits on it; none when they do
    not bracket it).

    >>> checkpoints_around([(10.0, Path("a")), (20.0, Path("b")), (30.0, Path("c"))], 25.0)
    [(20.0, PosixPath('b')), (30.0, PosixPath('c'))]
    >>> checkpoints_around([(10.0, Path("a")), (20.0, Path("b"))], 20.0)
    [(20.0, PosixPath('b'))]
    >>> checkpoints_around([(10.0, Path("a"))], 25.0)
    []
    """
    before = [c for c in sorted(saved) if c[0] <= tokens]
    after = [c for c in sorted(saved) if c[0] >= tokens]
    if not before or not after:
        return []
    return [before[-1]] if before[-1] == after[0] else [before[-1], after[0]]


def saved_checkpoints(r: dict[str, Any]) -> list[tuple[float, float, Path]]:
    """(tokens processed when it was written, its time, its folder) of every checkpoint the
    run's syncer kept, oldest first (one being written as the run stopped left out)."""
    saved = []
    for folder in sorted((r["workdir"] / "syncer" / "checkpoints").glob("ckpt-*")):
        try:
            manifest = json.loads((folder / "manifest.json").read_text())
        except (OSError, json.JSONDecodeError):
            continue
        written = float(manifest["time"])
        saved.append((processed_at(r["progress"], written), written, folder))
    return saved


def wide_parts(spec: JobSpec, eval_tokens: int) -> Any:
    """The model and held-out set of the syncer's evaluation, on `eval_tokens` tokens."""
    wide = spec.model_copy(
        update={"data": spec.data.model_copy(update={"eval_tokens": eval_tokens})}
    )
    return build_parts(wide, shard_index=0, num_shards=1, with_train=False)


def offline_history(
    spec: JobSpec, r: dict[str, Any], eval_tokens: int
) -> list[tuple[float, float, float]]:
    """(seconds from the run's start, tokens processed, loss on `eval_tokens` held-out tokens)
    of every checkpoint the run kept (one every outer step: offline_spec), evaluated after the
    run as offline_loss does: the curve time to target reads, on the wide set rather than the
    live 4,096 tokens, whose noise (sd 0.23-0.50% of a loss ratio) moved a flat curve's first
    crossing of a target by whole outer steps."""
    parts = wide_parts(spec, eval_tokens)
    out = []
    for tokens, written, folder in saved_checkpoints(r):
        load_model(parts.model, str(folder / "weights.safetensors"))
        out.append((written - r["t0"], tokens, evaluate(parts)))
    return out


def crossing_time(history: Sequence[tuple[float, float, float]], target: float) -> float:
    """Seconds at which a run's (seconds, tokens, loss) curve first reaches `target`: linear
    between the last point above it and the first at or below it (a run's evaluations come a
    round apart, so the first one below alone rounds the time up by up to a round); inf if
    never.

    >>> crossing_time([(0.0, 0.0, 5.0), (10.0, 1e3, 3.0), (20.0, 2e3, 2.0)], 2.5)
    15.0
    >>> crossing_time([(10.0, 1e3, 2.0), (20.0, 2e3, 1.5)], 2.5)
    10.0
    >>> crossing_time([(0.0, 0.0, 5.0), (10.0, 1e3, 3.0)], 2.5)
    inf
    """
    before: tuple[float, float] | None = None
    for seconds, _, loss in history:
        if loss <= target:
            if before is None or before[1] == loss:
                return seconds
            t_a, l_a = before
            return t_a + (seconds - t_a) * (l_a - target) / (l_a - loss)
        before = (seconds, loss)
    return math.inf


def link_floor(r: dict[str, Any], ref_seconds: float) -> float:
    """The least time to target a run over its link could show at the blocking L = 0 run's
    quality per token, over that run's own (`ref_seconds`): the merge that reaches the target
    needs its round's pushes across the link first, bytes_per_round x the share that went up
    (towards the syncer; the joins' pulls count down, so this errs low) / the rate, after
    the point the L = 0 run merged it. 1.0 on an unlimited link.

    >>> link_floor({"rate": None}, 50.0)
    1.0
    >>> link_floor({"rate": 1e5, "bytes_per_round": 1e6, "up_share": 0.4}, 50.0)
    1.08
    """
    if r["rate"] is None or not ref_seconds or math.isinf(ref_seconds):
        return 1.0
    return (ref_seconds + r["bytes_per_round"] * r["up_share"] / r["rate"]) / ref_seconds


def offline_loss(spec: JobSpec, r: dict[str, Any], tokens: float, eval_tokens: int) -> float:
    """The run's eval loss at `tokens` processed on `eval_tokens` held-out tokens, read on its
    offline curve (offline_history: the global weights of every checkpoint it kept, one every
    outer step, offline_spec, evaluated after the run on the syncer's evaluation with
    data.evalTokens = eval_tokens), linear in tokens processed between the two checkpoints
    around that point (loss_on_curve). NaN when no two checkpoints bracket `tokens`.

    Why: the syncer's live evaluation (--eval-tokens, 4096 by default, kept small because it runs
    on the training cores every outer step) reads two runs' models on the same few windows, and
    at equal tokens their loss ratio moved by 0.23-0.50% (1 sd, six gpt-mini pairs) from one
    4096-token set to another (bench/studies/eval_sets.py), up to issue 45's whole target of
    0.5%; on 32,768 tokens that is about a third (bench/log/2026-12-03.md)."""
    # Only the curve's tokens and losses are read: a run without its start (t0) counts from 0.
    return loss_on_curve(offline_history(spec, {"t0": 0.0, **r}, eval_tokens), tokens)


def loss_on_curve(curve: Sequence[tuple[float, float, float]], tokens: float) -> float:
    """The loss at `tokens` processed on a run's offline curve (offline_history's (seconds,
    tokens, loss) points): linear in tokens between the two checkpoints around it, the one on
    it alone; NaN when no two bracket it (checkpoints_around)."""
    around = checkpoints_around([(at, loss) for _, at, loss in curve], tokens)
    if not around:
        return math.nan
    return around[0][1] if len(around) == 1 else interp(around, tokens)


def offline_spec(spec: JobSpec) -> JobSpec:
    """The run's spec with a checkpoint at every outer step, all kept (offline_history reads
    them all, offline_loss the two around the budget)."""
    ckpt = spec.syncer.checkpoint.model_copy(update={"every_outer_steps": 1, "keep": 100})
    return spec.model_copy(update={"syncer": spec.syncer.model_copy(update={"checkpoint": ckpt})})


def bytes_per_round(samples: Sequence[tuple[int, int]]) -> float:
    """The link's bytes per round in steady state: the slope of the relay's bytes over outer
    steps, from the first poll after the first outer step (the joins' full pulls before it left
    out) to the last poll (NaN with fewer than two outer steps between them)."""
    later = [s for s in samples if s[0] >= 1]
    if len(later) < 2 or later[-1][0] <= later[0][0]:
        return math.nan
    (s0, b0), (s1, b1) = later[0], later[-1]
    return (b1 - b0) / (s1 - s0)


def port_taken(err: BaseException) -> bool:
    """Whether a run failed because its syncer's port was taken: the syncer's own message ends in
    the OS's strerror ("cannot listen on HOST:PORT: Address already in use"), capitalised."""
    return "address already in use" in str(err).lower()


def run_retrying_a_taken_port(spec: JobSpec, wd: Path, **kw: Any) -> dict[str, Any]:
    """run_over_link, started again (in a fresh directory) when the syncer could not bind the
    port it was given because another process on this shared machine took it meanwhile."""
    for attempt in range(3):
        try:
            return run_over_link(
                spec, wd if not attempt else wd.with_name(f"{wd.name}-{attempt}"), **kw
            )
        except RuntimeError as err:
            if not port_taken(err) or attempt == 2:
                raise
            print(
                f"  the syncer's port was taken meanwhile; starting again ({err!s:.60})", flush=True
            )
    raise AssertionError("unreachable")


def paced(pace_ms: float) -> dict[str, str] | None:
    """The learners' environment for real steps each padded to `pace_ms` (--pace-step-ms,
    DILOCO_PACE_STEP_SECONDS); None: not paced.

    >>> paced(200.0), paced(0.0)
    ({'DILOCO_PACE_STEP_SECONDS': '0.2'}, None)
    """
    return {PACE_STEP: f"{pace_ms / 1000:g}"} if pace_ms > 0 else None


def round_seconds(splits: Sequence[Split], inner_steps: int) -> float:
    """A round's compute time: H x the median over islands of training seconds per step."""
    per_step = [s.training / s.steps for s in splits if s.steps]
    if not per_step:
        raise ValueError("no progress windows to time a round from")
    return inner_steps * statistics.median(per_step)


def seen_share(r: dict[str, Any], rate: float | None, inner_steps: int) -> float:
    """The share of a round's compute time the run's link was busy: its bytes per round / rate
    / its own round's compute time; 0 on an unlimited link."""
    if rate is None:
        return 0.0
    return r["bytes_per_round"] / rate / round_seconds(r["splits"], inner_steps)


def utilisation(r: dict[str, Any]) -> Split:
    """Every island's windows together."""
    return sum(r["splits"], Split())


def quorums(args: Any) -> list[int]:
    """K = M first (the L = 0 blocking run calibrates the link), then the job's default."""
    return list(dict.fromkeys([args.islands, *args.quorums]))


def run_all(args: Any, wd: Path) -> dict[tuple[int, int, float], dict[str, Any]]:
    """{(seed, quorum, share): result}; the L = 0 K = M run of each seed first."""
    out: dict[tuple[int, int, float], dict[str, Any]] = {}
    shares = sorted(set(args.shares))
    for seed in args.seeds:
        calib: dict[str, float] = {}
        for k in quorums(args):
            for share in shares:
                if k == args.islands and share and share not in (args.m_shares or shares):
                    continue  # --m-shares: K = M only at these (L = 0 always: calibration)
                # Past the budget (--past-budget), so that a run a little behind at the budget
                # still shows when it reaches the K = M, L = 0 run's loss there.
                limit = math.ceil(args.past_budget * budget(args))
                spec = make_spec(args, seed=seed, quorum=k, tokens=limit)
                if args.offline_eval_tokens:
                    spec = offline_spec(spec)
                rate, pinned = choose_rate(share, args.link_rates, calib)
                name = f"seed{seed}-k{k}-L{share:g}"
                print(f"{name}: link {mbit(rate)}{' (pinned)' if pinned else ''}", flush=True)
                r = run_retrying_a_taken_port(
                    spec,
                    wd / name,
                    rate=rate,
                    latency_ms=args.latency_ms if share else 0.0,
                    timeout=args.timeout,
                    learner_env=paced(args.pace_step_ms),
                )
                r["rate"], r["pinned"] = rate, pinned
                if share == 0 and k == args.islands:
                    calib["round"] = round_seconds(r["splits"], args.inner_steps)
                    calib["bytes"] = r["bytes_per_round"]
                    print(
                        f"  calibration: a round {calib['round']:.2f}s of compute, "
                        f"{calib['bytes'] / 1e6:.2f} MB on the link; to pin its links: "
                        f"{pin_args(calib, args.pin_shares)}",
                        flush=True,
                    )
                r["calib"] = dict(calib)
                if args.offline_eval_tokens:
                    # Every checkpoint evaluated once: the curve time to target reads, and the
                    # loss at the budget on it (offline_loss).
                    r["offline_history"] = offline_history(spec, r, args.offline_eval_tokens)
                    r["offline_loss"] = (
                        budget(args),
                        loss_on_curve(r["offline_history"], budget(args)),
                    )
                out[(seed, k, share)] = r
                u = utilisation(r)
                print(
                    f"  -> utilisation {u.utilisation:.3f} (waiting {u.waiting / u.wall:.3f}), "
                    f"loss {equal_token_loss(r, budget(args)):.4f} at the budget "
                    f"(live evaluation {loss_at_tokens(r, budget(args)):.4f}), "
                    f"{r['wall']:.0f}s",
                    flush=True,
                )
    return out


def torchft_delays(inner_steps: int, fragments: int = 1) -> tuple[int, int]:
    """(the largest, the largest sensible) fragment_sync_delay of torchft 0.2.0's DiLoCo.

    It syncs one of its F fragments every H / F inner steps (H a multiple of F), snapshots the
    fragment's pseudo-gradient and starts its all-reduce d steps before that, and waits for it
    at the H / F-th step, so d < H / F (local_sgd.DiLoCo raises otherwise). With
    fragment_update_alpha 0, its default, the d steps trained after the snapshot are then
    replaced by the new global weights: a delay d throws away d of every H / F steps' progress.
    The largest sensible delay keeps at least half of them, (H / F) // 2 (bench/bandwidth's
    torchft τ = H/2 too); the largest, H / F - 1, would keep one step's work a round."""
    if fragments < 1 or inner_steps < fragments or inner_steps % fragments:
        raise ValueError(
            f"inner steps ({inner_steps}) must be a multiple of fragments ({fragments}) >= 1"
        )
    per_sync = inner_steps // fragments
    return per_sync - 1, per_sync // 2


def torchft_split(records: Sequence[dict[str, Any]]) -> Split:
    """A torchft replica's progress records as one window, measured as bench/bandwidth does:
    from its first commit (start-up and the first round's join left out, as ours' first window
    is) to its last record. Training: its measured compute seconds (forward, backward and the
    inner update); waiting: the rest of the window (blocked in DiLoCo's step hook: the quorum,
    the all-reduce's wait, the outer step). Empty before a first commit."""
    committed = [r for r in records if r["commits"] >= 1]
    if not committed:
        return Split()
    t1, t2 = float(committed[0]["time"]), float(records[-1]["time"])
    compute = value_at(records, t2, "compute_seconds") - value_at(records, t1, "compute_seconds")
    steps = value_at(records, t2, "steps") - value_at(records, t1, "steps")
    return Split(int(steps), compute, 0.0, max(0.0, t2 - t1 - compute))


def ring_bytes_per_round(results: Sequence[dict[str, Any]]) -> float:
    """Bytes torchft's ring puts on the shared loopback a round: what every replica sent over
    its commits (its result's bytes_per_worker, 2(M-1)/M of its all-reduced payload), summed
    over replicas, per commit (NaN before one)."""
    commits = min(int(r["outer_steps"]) for r in results) if results else 0
    if commits < 1:
        return math.nan
    return sum(float(r["bytes_per_worker"]) for r in results) / commits


def torchft_unavailable(args: Any) -> str | None:
    """Why torchft's rows are left out of this run (None: they run)."""
    if args.skip_torchft:
        return "skipped (--skip-torchft)"
    if args.pace_step_ms:
        return "its replicas' steps are not paced (--pace-step-ms): they would not compare"
    try:
        import torchft  # noqa: F401
    except ImportError:
        return "torchft is not installed (pip install -e '.[bench]')"
    return netns.unavailable_reason()


def run_torchft_rows(
    args: Any,
    wd: Path,
    ours: dict[tuple[int, int, float], dict[str, Any]],
    failed: list[str],
) -> dict[tuple[int, int, float], dict[str, Any]]:
    """{(seed, fragment_sync_delay, share): result}: torchft's DiLoCo at K = M for every seed,
    delay and share, at the link rate ours had at that share (its calibration). A run that
    fails is left out and named in `failed`."""
    out: dict[tuple[int, int, float], dict[str, Any]] = {}
    m = args.islands
    for seed in args.seeds:
        calib = ours[(seed, m, 0)]["calib"]
        limit = math.ceil(args.past_budget * budget(args))
        spec = make_spec(args, seed=seed, quorum=m, tokens=limit)
        for delay in args.torchft_delays:
            for share in sorted(set(args.shares)):
                rate, pinned = choose_rate(share, args.link_rates, calib)
                name = f"seed{seed}-torchft-d{delay}-L{share:g}"
                print(f"{name}: link {mbit(rate)} (tc tbf, no added latency)", flush=True)
                rate_mbit = None if rate is None else rate * 8 / 1e6
                try:
                    with netns.shaped_namespace(f"bl-d{delay}", rate_mbit) as prefix:
                        r = run_torchft(
                            args, spec, False, wd / name, True, sync_delay=delay, prefix=prefix
                        )
                except (RuntimeError, TimeoutError) as err:
                    # Ours' rows, minutes of runs already done, still get reported: the row
                    # is left out and the run's note says why.
                    print(f"  -> failed, left out: {err!s:.300}", flush=True)
                    failed.append(f"{name}: {(str(err).splitlines() or [type(err).__name__])[0]}")
                    continue
                job = r["job"]
                r["splits"] = [torchft_split(read_progress(job.progress_file(i))) for i in range(m)]
                r["bytes_per_round"] = ring_bytes_per_round(r["results"])
                r["rate"], r["pinned"] = rate, pinned
                out[(seed, delay, share)] = r
                u = utilisation(r)
                print(
                    f"  -> utilisation {u.utilisation:.3f}, loss "
                    f"{loss_at_tokens(r, budget(args)):.4f} at the budget, "
                    f"{r['ran_wall']:.0f}s",
                    flush=True,
                )
    return out


def fmt_spread(values: Sequence[float], fmt: Any) -> str:
    """Mean (and the range over seeds when there are several)."""
    vals = [v for v in values if v == v]
    if not vals:
        return "n/a"
    if len(vals) == 1:
        return fmt(vals[0])
    return f"{fmt(statistics.mean(vals))} ({fmt(min(vals))}-{fmt(max(vals))})"


def figures(
    rs: Sequence[dict[str, Any]],
    base: Sequence[dict[str, Any]],
    ref: Sequence[dict[str, Any]],
    tokens: float,
) -> tuple[list[Split], list[float], list[float], list[float]]:
    """Per seed: a row's runs' utilisation splits, losses at `tokens`, those losses over their
    `base` runs' (the same system at L = 0), and their times to the `ref` runs' loss (ours'
    K = M at L = 0) over the ref runs' own (time_to_target)."""
    us = [utilisation(r) for r in rs]
    losses = [equal_token_loss(r, tokens) for r in rs]
    rel = [ratio(x, equal_token_loss(r0, tokens)) for x, r0 in zip(losses, base, strict=False)]
    to_target = [ratio(*time_to_target(r, r0, tokens)) for r, r0 in zip(rs, ref, strict=False)]
    return us, losses, rel, to_target


def time_to_target(r: dict[str, Any], r0: dict[str, Any], tokens: float) -> tuple[float, float]:
    """(seconds until `r` reached the `r0` run's loss at `tokens`, seconds until `r0` did): on
    both runs' offline curves (offline_history, crossing_time) where both have one, else on
    their live evaluations (the first at or below it, as torchft's saved weights are read)."""
    if "offline_history" in r and "offline_history" in r0:
        target = equal_token_loss(r0, tokens)
        return (
            crossing_time(r["offline_history"], target),
            crossing_time(r0["offline_history"], target),
        )
    target = loss_at_tokens(r0, tokens)
    return time_to_loss(r, target), time_to_loss(r0, target)


def floors(rs: Sequence[dict[str, Any]], ref: Sequence[dict[str, Any]], tokens: float) -> str:
    """The link's floor of each run's time to target (link_floor), mean and range."""
    values = [
        link_floor(r, time_to_target(r0, r0, tokens)[1]) for r, r0 in zip(rs, ref, strict=False)
    ]
    return fmt_spread(values, fmt_ratio)


def equal_token_loss(r: dict[str, Any], tokens: float) -> float:
    """A run's loss at `tokens` processed: offline_loss's, where it was measured there
    (--offline-eval-tokens), else the syncer's live evaluations' (loss_at_tokens)."""
    at, loss = r.get("offline_loss", (None, math.nan))
    return loss if at == tokens else loss_at_tokens(r, tokens)


def cells(
    rs: Sequence[dict[str, Any]],
    us: Sequence[Split],
    losses: Sequence[float],
    rel: Sequence[float],
    to_target: Sequence[float],
    inner_steps: int,
    *,
    sync_path: bool = True,
) -> list[str]:
    """A row's cells from "L seen" on (torchft's has no sync path of its own: '-')."""
    return [
        fmt_spread([seen_share(r, r["rate"], inner_steps) for r in rs], fmt_pct),
        fmt_spread([u.utilisation for u in us], lambda x: f"{x:.3f}"),
        fmt_spread([u.waiting / u.wall for u in us], fmt_pct),
        fmt_spread([u.sync_path / u.wall for u in us], fmt_pct) if sync_path else "-",
        fmt_spread(list(losses), lambda x: f"{x:.4f}"),
        fmt_spread(list(rel), fmt_ratio),
        fmt_spread(list(to_target), lambda x: "never" if x == math.inf else fmt_ratio(x)),
    ]


def tables(
    args: Any,
    results: dict[tuple[int, int, float], dict[str, Any]],
    tft: dict[tuple[int, int, float], dict[str, Any]] | None = None,
) -> list[Table]:
    tft = tft or {}
    b = budget(args)
    m = args.islands
    seeds = args.seeds
    shares = sorted(set(args.shares))
    main = Table(
        f"Utilisation and eval loss over a link that a round's sync takes L of ({args.preset}, "
        f"M = {m}, H = {args.inner_steps}, {args.steps} steps per island, seeds "
        f"{', '.join(map(str, seeds))}; mean (range) over seeds)",
        [
            "K",
            "L (nominal)",
            "link",
            "L seen",
            "utilisation",
            "waiting",
            "sync path",
            "loss at equal tokens",
            "/ same K at L=0",
            "time to K=M L=0's loss / its own",
            "its floor: the last pushes on the link",
            "merges: lag mean/max (versions), alone, least momentum share",
        ],
    )
    verdicts = Table(
        "Issue 45's targets in this run",
        ["K", "L", "target", "figure", "verdict"],
    )
    for k in quorums(args):
        for share in shares:
            rs = [results[(s, k, share)] for s in seeds if (s, k, share) in results]
            if not rs:
                continue
            us, losses, rel, to_target = figures(
                rs,
                [results[(s, k, 0)] for s in seeds if (s, k, 0) in results],
                [results[(s, m, 0)] for s in seeds if (s, m, 0) in results],
                b,
            )
            rates = {r["rate"] for r in rs}
            main.add(
                f"{k}{' (= M)' if k == m else ''}",
                f"{share:g}%",
                ", ".join(sorted(mbit(x) for x in rates))
                + (" (pinned)" if share in args.link_rates else "")
                + (f", RTT {2 * args.latency_ms:g} ms" if share else ""),
                *cells(rs, us, losses, rel, to_target, args.inner_steps),
                floors(rs, [results[(s, m, 0)] for s in seeds if (s, m, 0) in results], b),
                "; ".join(r["staleness"].cell() for r in rs),
            )
            util = min(u.utilisation for u in us)
            need = 0.97 if share <= 50 else 0.90
            verdicts.add(
                k,
                f"{share:g}%",
                f"utilisation >= {need}",
                f"{util:.3f} (worst seed)",
                verdict(util >= need),
            )
            peers = torchft_at(args, tft, share)
            if peers:
                best_u, best_d = max((mean_util(rs_), d) for d, rs_ in peers.items())
                ours_u = statistics.mean(u.utilisation for u in us)
                verdicts.add(
                    k,
                    f"{share:g}%",
                    "utilisation ahead of torchft's",
                    f"{ours_u:.3f} vs {best_u:.3f} (delay {best_d})",
                    verdict(ours_u > best_u),
                )
                best_l, best_ld = min((mean_loss(rs_, b), d) for d, rs_ in peers.items())
                ours_l = mean_loss(rs, b)  # the live evaluations' set, as torchft's
                verdicts.add(
                    k,
                    f"{share:g}%",
                    "loss at or below torchft's",
                    f"{ours_l:.4f} vs {best_l:.4f} (delay {best_ld})",
                    verdict(ours_l <= best_l),
                )
            if share and share <= 50:
                worst = max(rel)
                verdicts.add(
                    k,
                    f"{share:g}%",
                    "loss <= 1.005x L=0",
                    fmt_ratio(worst, 4),
                    verdict(worst <= 1.005),
                )
                slow = max(to_target)
                verdicts.add(
                    k,
                    f"{share:g}%",
                    "time to target <= 1.05x",
                    ("never" if slow == math.inf else fmt_ratio(slow))
                    + f" (the link's floor {main.rows[-1][-2]})",
                    verdict(slow <= 1.05),
                )
    for delay in args.torchft_delays if tft else []:
        for share in shares:
            rs = [tft[(s, delay, share)] for s in seeds if (s, delay, share) in tft]
            if not rs:
                continue
            us, losses, rel, to_target = figures(
                rs,
                [tft[(s, delay, 0)] for s in seeds if (s, delay, 0) in tft],
                [results[(s, m, 0)] for s in seeds if (s, delay, share) in tft],
                b,
            )
            main.add(
                f"torchft {m}, delay {delay}",
                f"{share:g}%",
                ", ".join(sorted({mbit(r["rate"]) for r in rs}))
                + (" (pinned)" if share in args.link_rates else "")
                + (", tc tbf, no added RTT" if share else ""),
                *cells(rs, us, losses, rel, to_target, args.inner_steps, sync_path=False),
                "-",  # its ring has no pushes to a syncer
                "-",  # no merge log: torchft's sync is an all-reduce
            )
    return [main, verdicts]


def torchft_at(
    args: Any, tft: dict[tuple[int, int, float], dict[str, Any]], share: float
) -> dict[int, list[dict[str, Any]]]:
    """torchft's runs at one share, by fragment_sync_delay (every seed's)."""
    out: dict[int, list[dict[str, Any]]] = {}
    for (seed, delay, sh), r in tft.items():
        if sh == share and seed in args.seeds:
            out.setdefault(delay, []).append(r)
    return out


def mean_util(rs: Sequence[dict[str, Any]]) -> float:
    return statistics.mean(utilisation(r).utilisation for r in rs)


def mean_loss(rs: Sequence[dict[str, Any]], tokens: float) -> float:
    return statistics.mean(loss_at_tokens(r, tokens) for r in rs)


def parse_args(argv: Sequence[str] | None) -> Any:
    p = base_parser(
        __doc__ or "",
        **TRAINING,
        **INNER_OPTIMIZER,
        islands=4,
        inner_steps=30,
        steps=300,
        eval_tokens=4096,
        seeds=[0],
        timeout=1200,
    )
    p.add_argument(
        "--shares",
        type=float,
        nargs="+",
        default=[0, 25, 50, 100],
        help="L: %% of a round's compute time a round's sync traffic takes (0 must be in it)",
    )
    p.add_argument(
        "--quorums", type=int, nargs="*", default=[1], help="quorums besides K = M (default: 1)"
    )
    p.add_argument(
        "--latency-ms", type=float, default=10.0, help="one-way latency added where L > 0"
    )
    p.add_argument(
        "--pace-step-ms",
        type=float,
        default=0.0,
        help="real training, each inner step padded with sleep to this many ms "
        "(DILOCO_PACE_STEP_SECONDS): a step time that does not move with the shared cores' "
        "load, as an accelerator's, so a nominal L is the L seen; pick it above a step's compute "
        "under the run's load (the learners' exit lines count the steps over it); torchft's rows "
        "are left out (default 0: not paced)",
    )
    p.add_argument(
        "--sync",
        action="append",
        metavar="KEY=VALUE",
        help="a spec.sync setting for every run instead of its default (repeatable)",
    )
    p.add_argument(
        "--past-budget",
        type=float,
        default=1.25,
        help="every run trains up to this multiple of the token budget (S steps per island), to "
        "time when it reaches the K = M, L = 0 run's loss at the budget; equal-token figures are "
        "read at the budget",
    )
    p.add_argument(
        "--m-shares",
        type=float,
        nargs="+",
        default=None,
        help="the shares K = M runs at (default: --shares; L = 0, the calibration, always)",
    )
    p.add_argument(
        "--skip-torchft",
        action="store_true",
        help="leave out torchft's DiLoCo rows (they need root, tc and torchft)",
    )
    p.add_argument(
        "--torchft-delays",
        type=int,
        nargs="+",
        default=None,
        help="torchft's fragment_sync_delay values (default: 0 and the largest sensible, H/2)",
    )
    p.add_argument(
        "--link-rates",
        nargs="+",
        metavar="L=MBIT",
        default=[],
        help="pin the link: MBIT Mbit/s at share L for every seed (and torchft's rows) instead of "
        "each seed's own L = 0 calibration; every L > 0 of --shares needs one (a calibration "
        "run prints them)",
    )
    p.add_argument(
        "--pin-shares",
        type=float,
        nargs="+",
        default=[25, 50, 100],
        help="the shares whose --link-rates a calibration prints and notes (default: 25 50 100)",
    )
    p.add_argument(
        "--offline-eval-tokens",
        type=int,
        default=32768,
        help="ours' loss at equal tokens read after each run on this many held-out tokens (the "
        "global weights of the checkpoints around the budget; a checkpoint every outer step is "
        "kept) instead of the syncer's live evaluations on --eval-tokens; 0: the live ones "
        "(default 32768: a 4096-token set moved a loss ratio at equal tokens by 0.23-0.50%%, "
        "1 sd)",
    )
    p.add_argument("--quick", action="store_true", help="smoke run: M=2, H=10, 60 steps, L=0,50")
    args = p.parse_args(argv)
    if args.offline_eval_tokens < 0:
        p.error("--offline-eval-tokens: must be >= 0")
    if not 0 <= args.pace_step_ms <= 60_000:
        p.error("--pace-step-ms: must be in [0, 60000]")
    if args.quick:
        args.offline_eval_tokens = min(args.offline_eval_tokens, 1024)
        args.islands, args.inner_steps, args.steps = 2, 10, 60
        args.shares, args.seeds, args.quorums = [0, 50], [0], [1]
    try:
        args.link_rates = parse_link_rates(args.link_rates)
    except ValueError as err:
        p.error(f"--link-rates: {err}")
    unpinned = sorted(set(args.shares) - {0} - set(args.link_rates))
    if args.link_rates and unpinned:
        p.error(f"--link-rates: no rate for L = {', '.join(f'{s:g}' for s in unpinned)}%")
    largest, sensible = torchft_delays(args.inner_steps)
    if args.torchft_delays is None:
        args.torchft_delays = [0, sensible]
    bad = [d for d in args.torchft_delays if not 0 <= d <= largest]
    if bad:
        p.error(f"--torchft-delays: {bad} outside 0..{largest} (torchft needs delay < H)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    install_signal_cleanup()
    why_not = torchft_unavailable(args)
    if why_not:
        print(f"torchft's rows left out: {why_not}", flush=True)
    with LoadMonitor() as load, workdir(args.workdir, "busy-link") as wd:
        results = run_all(args, wd)
        failed: list[str] = []
        tft = {} if why_not else run_torchft_rows(args, wd, results, failed)
    calib = next(iter(results.values()))["calib"]
    pinned = args.link_rates
    report = Report(
        "busy_link",
        "Utilisation (time in inner steps / wall), eval loss at equal tokens and wall time to "
        "the L = 0 blocking run's loss, with every learner-syncer connection through one "
        "relay whose rate makes a round's sync traffic take L of a round's compute time.",
        tables=tables(args, results, tft),
        notes=[
            f"Calibration (seed {args.seeds[0]}, K = M, L = 0): a round is "
            f"{calib.get('round', math.nan):.2f}s of compute (H x the median training seconds "
            f"a step) and puts {calib.get('bytes', math.nan) / 1e6:.2f} MB on the link (the "
            "relay's bytes per outer step after the first, both directions, every island); "
            "rate = bytes / (L x round)"
            + (f"; to pin these links: `{pin_args(calib, args.pin_shares)}`." if calib else ".")
            + (
                " The link was pinned (--link-rates "
                + " ".join(f"{s:g}={r * 8 / 1e6:g}" for s, r in sorted(pinned.items()))
                + "): the same Mbit/s at an L for every seed, not each seed's calibration; "
                "L seen is each run's own bytes a round / that rate / its own round's compute."
                if pinned
                else ""
            ),
            "Utilisation, waiting and sync path: shares of the learners' progress windows "
            "(their own split, every 20 steps; the first window, with the join, left out).",
            "Loss at equal tokens: interpolated at the budget of tokens processed (the "
            "learners' own counts)"
            + (
                f", read after each run on {args.offline_eval_tokens} held-out tokens (the "
                "global weights of the two checkpoints around the budget, placed at the tokens "
                f"processed when each was written), not the syncer's live {args.eval_tokens}"
                if args.offline_eval_tokens
                else f", the syncer's live evaluations on {args.eval_tokens} held-out tokens"
            )
            + (
                "; time to target: when the run's curve on those held-out tokens (every "
                "checkpoint, one an outer step, evaluated after the run) first reaches the "
                "K = M, L = 0 run's loss at the budget, linear between the checkpoints around "
                "it, over that run's own time to it (both from the processes' start); its "
                "floor: that run's time plus the last round's pushes on the link (the bytes a "
                "round x the share the relay carried up / the rate), over that run's time"
                if args.offline_eval_tokens
                else "; time to target: the first live evaluation at or below the "
                "K = M, L = 0 run's live loss at the budget, over that run's own time to it"
            )
            + ("; ours' loss against torchft's: both on the live set." if not why_not else "."),
            "Sync settings: the job defaults but the quorum"
            + (f" and {', '.join(args.sync)}" if args.sync else "")
            + ".",
            (
                f"torchft's rows left out: {why_not}."
                if why_not
                else "torchft 0.2.0's DiLoCo (fp32 ring all-reduce, one fragment, "
                "fragment_update_alpha 0, K = M): the lighthouse and replicas in a network "
                "namespace whose loopback tc tbf limits to the same rate as ours at that L, "
                "every byte of every replica in one bucket as in ours' shared relay; no latency "
                f"can be added there (no netem), so its RTT is ~0 against ours' "
                f"{2 * args.latency_ms:g} ms. Utilisation: its replicas' compute seconds / wall "
                "from the first commit (bench/bandwidth's measure); waiting: the rest. Its L "
                "seen: its ring's bytes a round (2(M-1)/M of the payload per replica) / rate / "
                "its own round's compute. With a delay d, the d steps after the pseudo-gradient's "
                "snapshot are trained, counted as utilisation, then replaced by the new global "
                "weights (alpha 0). Loss at equal tokens: its saved global weights per commit; "
                "the time to ours' K = M, L = 0 loss counts from its lighthouse's start."
            ),
            *(f"torchft run failed, its row left out: {f}" for f in failed),
        ],
    )
    return publish(report, args, load)


if __name__ == "__main__":
    raise SystemExit(main())
