"""Busy link, part 2: the real sync path at real sizes with an emulated accelerator (issue 45).

bench/busy_link.py trains gpt-tiny and gpt-mini for real; a CPU cannot train gpt-125m to gpt-1b
in a benchmark's time. Here each learner's inner step is a fixed wall time, a GPU's step for that
size, spent in time.sleep (it releases the interpreter lock, as a GPU's kernels do), and the
parameters move by a real delta of their size each step (learner/emulated_step.py,
DILOCO_EMULATE_STEP_SECONDS), so the learner's own sync path (encode, push over the link, the
syncer's merge, pull, apply) runs for real, at that size, over one rate/latency relay
(bench/harness/relay.py) as in busy_link.

Step times (the default --step-ms), a GPU's step of 32 x 1024 tokens an island, from this
project's own H100 runs where there is one (bench/RESULTS.md, "learner_step": gpt-350m 116k
tokens/s, gpt-1b 57k tokens/s in bf16): gpt-350m 280 ms, gpt-1b 500 ms (57k tokens/s gives 575 ms;
500 is the issue's upper end); gpt-125m 100 ms (6 P tokens FLOP at the 350m run's 29% MFU of an
H100's 989 TFLOP/s: 85 ms, rounded up).

Memory (x = one fp32 copy, 4P bytes). By ARCHITECTURE.md's memory model ("A learner's
memory") an emulated learner holds its weights and its fp32 Δ base (2x; no gradients or AdamW
state: no backward, no optimizer step), the weights at each push in flight and a merged fragment
before its receipt (at most 1.5x more at F = 2), and the link's transients (a push's int8 bytes
and body, a pulled body and its decoded copy: up to ~1/F during a full pull), its own count
logged at exit ("held at most N copies"). Measured, a gpt-125m learner's resident memory peaked
at 7.0x at two islands on two loaded cores and a gpt-350m one reached 6.0x (8.5 GB) when the
kernel's OOM killer took it (two islands and the syncer, 4.8 GB, beside other engineers' work on
a 24 GiB machine; bench/log/2026-11-29.md, "busy_emulated (issue 45, part 2): before the host
sync path left the training thread"); at one island, with a push's int8 bytes let go once sent,
5.2-5.8x at gpt-125m, ~0.7x of it torch and the corpus (bench/log/2026-11-29.md, "a learner's
copies of the model"). So the estimate is 6x a learner (LEARNER_COPIES) and api/preflight's 5x
for the syncer (θ_exact, the outer momentum, θ_pub, the pull bodies, the eval copy) plus a fold's
accumulator, 1x at most: (6M + 6) x. A preset whose estimate exceeds 90% of the memory available
at the start is left out, and said so: gpt-125m (0.51 GB a copy) needs 9.2 GB at two islands;
gpt-350m (1.41 GB) 25 GB at two and 17 GB at one (`--islands 1`); gpt-1b (4.0 GB) 48 GB at one.
bf16 does not help: a learner's copies stay fp32 (inner.precision is autocast only).

Per run, from the learners' own progress lines: utilisation (time in inner steps / wall, their
start-up window left out), and where the rest went: waiting for the syncer (a merge) and the sync
path on the training thread (encode, snapshot, apply). The link: the L = 0 run (no limit, no added
latency) gives the bytes a round puts on the link B and a round's compute T = H x step; a run at
L has rate B / (L x T) and an added one-way latency (--latency-ms).

The host's floor, in the same run (bench/harness/cpu_floor.py): every process of the run (the
learners, the syncer, the relay) is read from /proc at each status poll; over its steady rounds,
its CPU seconds a round against the core-seconds this host's cores offer a round (cores x the
round's wall time) give the utilisation the host permits, compute / max(compute, CPU / cores),
and the share of the cores its CPU would need were its rounds as short as their compute; others'
CPU a round is /proc/stat's busy time less the run's own.
The training thread's sync path by part, seconds a round, is read from each learner's exit line
(learner/step_costs.SyncPathPhases).

    python -m bench.busy_emulated                                   # gpt-125m and gpt-350m
    python -m bench.busy_emulated --presets gpt-125m --shares 0 50 --rounds 5
    python -m bench.busy_emulated --quick --no-record    # smoke: gpt-tiny, 6 rounds of 10
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from diloco_trainer.api.contract import EMULATE_STEP
from diloco_trainer.api.preflight import SYNCER_COPIES, gpt_parameters
from diloco_trainer.api.spec import JobSpec, parse_spec
from diloco_trainer.learner.step_costs import SYNC_PATH_PHASES

from bench.busy_link import (
    Split,
    link_rate,
    mbit,
    round_seconds,
    run_retrying_a_taken_port,
    seen_share,
    utilisation,
)
from bench.harness.common import (
    LoadMonitor,
    Report,
    Table,
    base_parser,
    fmt_pct,
    install_signal_cleanup,
    publish,
    verdict,
    workdir,
)
from bench.harness.cpu_floor import (
    CpuSampler,
    PerRound,
    floor_utilisation,
    needed_share,
    offered,
    per_round,
    usable_cores,
)

# A GPU's step of 32 x 1024 tokens an island, in ms (the module's docstring says why).
STEP_MS = {"gpt-tiny": 50, "gpt-mini": 50, "gpt-125m": 100, "gpt-350m": 280, "gpt-1b": 500}
# Islands per preset: 2 where they fit this machine's memory with the syncer, else 1 (gpt-350m:
# 25 GB at two by memory_estimate, 17 GB at one; 24 GiB here).
ISLANDS = {"gpt-tiny": 2, "gpt-mini": 2, "gpt-125m": 2, "gpt-350m": 1, "gpt-1b": 1}
# An emulated learner's peak resident memory in fp32 copies of the model, measured: a gpt-125m
# learner peaked at 3.6 GB (7.0 copies of 0.51 GB) at two islands on two loaded cores, a
# gpt-350m one reached 8.5 GB (6.0 copies) before the kernel killed it (module docstring); at one
# island, its push's int8 bytes let go once sent, 5.2-5.8 copies at gpt-125m, of which ~0.7 are
# the runtime (torch, the corpus: ~0.35 GB, less of a copy at larger sizes). ARCHITECTURE.md, "A
# learner's memory": 3 + 1/F copies held at most, plus the link's transients.
LEARNER_COPIES = 6
VOCAB = 256  # the built-in GPT's byte-level vocabulary (builtin:stdlib-text)
# A learner's exit line of its sync path by part (learner/step_costs.SyncPathPhases.line).
PARTS_LINE = re.compile(r"sync path by part over (\d+) steps: (.*?); in all")
PART = re.compile(r"(\w+) ([\d.]+)s \((\d+) calls")


def sync_parts(log_text: str) -> tuple[int, dict[str, float]]:
    """(steps, {part: seconds}) of a learner's 'sync path by part' exit line ((0, {}) when it
    has none: it did not exit cleanly)."""
    m = PARTS_LINE.search(log_text)
    if m is None:
        return 0, {}
    return int(m[1]), {p[1]: float(p[2]) for p in PART.finditer(m[2])}


def parts_per_round(logs: Sequence[tuple[int, dict[str, float]]], inner_steps: int) -> dict:
    """{part: seconds a round on one learner's training thread}: the islands' seconds summed
    over their steps summed, x H (the whole job, start-up and drain included)."""
    steps = sum(n for n, _ in logs)
    if not steps:
        return {}
    total: dict[str, float] = {}
    for _, parts in logs:
        for part, sec in parts.items():
            total[part] = total.get(part, 0.0) + sec
    return {part: sec / steps * inner_steps for part, sec in total.items()}


def params_of(preset: str, seq_len: int) -> int:
    """The preset's parameter count (api/preflight's, the byte-level vocabulary)."""
    return gpt_parameters(preset, seq_len, VOCAB)


def memory_estimate(params: int, islands: int) -> float:
    """Bytes an emulated job holds at its peak: per learner LEARNER_COPIES fp32 copies (measured:
    the module docstring), the syncer api/preflight's SYNCER_COPIES and a fold's accumulator per
    fragment (1/F each, every fragment pending at once at worst: one copy)."""
    copy = 4.0 * params
    return islands * LEARNER_COPIES * copy + (SYNCER_COPIES + 1) * copy


def available_memory() -> float:
    """MemAvailable of /proc/meminfo in bytes (inf where it cannot be read)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return math.inf


def make_spec(args: Any, preset: str, islands: int, rounds: int) -> JobSpec:
    """An emulated job: the defaults (K = M), `rounds` rounds of H steps an island; the syncer's
    evaluation only at the end and on a few tokens (a CPU forward at these sizes is slow)."""
    tokens_per_step = args.seq_len
    return parse_spec(
        {
            "model": {"preset": preset, "seed": 0},
            "data": {"source": "builtin:stdlib-text", "evalTokens": 1024, "seed": 0},
            "islands": {"count": islands},
            "inner": {"steps": args.inner_steps, "batchSize": 1, "seqLen": args.seq_len},
            "sync": {"quorum": islands},
            "stopAfter": {"tokens": islands * rounds * args.inner_steps * tokens_per_step},
            "syncer": {"evalEveryOuterSteps": 100000, "checkpoint": {"everyOuterSteps": 100000}},
        }
    )


def run_preset(args: Any, preset: str, wd: Path) -> dict[float, dict[str, Any]]:
    """{share: result} for one preset; the L = 0 run first (it calibrates the link)."""
    islands = args.islands or ISLANDS[preset]
    step_s = (args.step_ms or STEP_MS[preset]) / 1000
    out: dict[float, dict[str, Any]] = {}
    calib: dict[str, float] = {}
    for share in sorted(set(args.shares)):
        spec = make_spec(args, preset, islands, args.rounds)
        rate = None
        if share:
            if not calib:
                raise SystemExit("--shares must include 0 (the calibration run)")
            rate = link_rate(calib["bytes"], calib["round"], share / 100)
        name = f"{preset}-L{share:g}"
        print(f"{name}: {islands} islands, step {step_s * 1000:.0f} ms, link {mbit(rate)}")
        sampler = CpuSampler()
        r = run_retrying_a_taken_port(
            spec,
            wd / name,
            rate=rate,
            latency_ms=args.latency_ms if share else 0.0,
            timeout=args.timeout,
            learner_env={EMULATE_STEP: f"{step_s:g}"},
            on_sample=sampler,
        )
        logs = [sync_parts(Path(f).read_text(errors="replace")) for f in r["learner_logs"]]
        r.update(
            rate=rate,
            islands=islands,
            step_s=step_s,
            cpu=per_round(sampler.rows),
            parts=parts_per_round(logs, args.inner_steps),
        )
        if share == 0:
            calib["round"] = round_seconds(r["splits"], args.inner_steps)
            calib["bytes"] = r["bytes_per_round"]
            print(
                f"  calibration: a round {calib['round']:.2f}s of compute, "
                f"{calib['bytes'] / 1e6:.1f} MB on the link",
                flush=True,
            )
        u: Split = utilisation(r)
        floor = host_floor(r, args.inner_steps)
        print(
            f"  -> utilisation {u.utilisation:.3f} (waiting {u.waiting / u.wall:.3f}, sync path "
            f"{u.sync_path / u.wall:.3f}), {r['rounds']} rounds, {r['wall']:.0f}s; the host's "
            f"floor {floor['alone']:.3f} ({floor['cores']} cores: {floor['needed']:.0%} of them "
            f"needed at utilisation 1); CPU a round {r['cpu'].cpu:.2f}s of {floor['offered']:.2f} "
            f"core-seconds; sync path a round by part: "
            + ", ".join(f"{k} {v:.3f}s" for k, v in r["parts"].items()),
            flush=True,
        )
        out[share] = r
    return out


def host_floor(r: dict[str, Any], inner_steps: int) -> dict[str, Any]:
    """The run's CPU floor on this host (bench/harness/cpu_floor): its cores, the core-seconds
    they offer a round, and the utilisation its CPU a round permits on all of them ('alone')
    and the share of them its CPU needs at utilisation 1 ('needed')."""
    c: PerRound = r["cpu"]
    cores = usable_cores()
    compute = round_seconds(r["splits"], inner_steps)
    if not c.rounds:
        return dict(cores=cores, compute=compute, offered=math.nan, alone=math.nan, needed=math.nan)
    return dict(
        cores=cores,
        compute=compute,
        offered=offered(c.wall, cores),
        alone=floor_utilisation(c.cpu, compute, cores),
        needed=needed_share(c.cpu, compute, cores),
    )


def tables(args: Any, results: dict[str, dict[float, dict[str, Any]]]) -> list[Table]:
    main = Table(
        f"Emulated accelerator, real sync path (K = M, H = {args.inner_steps}, "
        f"{args.rounds} rounds an island; RTT {2 * args.latency_ms:g} ms where L > 0)",
        [
            "preset",
            "islands",
            "step",
            "L (nominal)",
            "link",
            "L seen",
            "utilisation",
            "waiting",
            "sync path",
            "sync path a round",
            "rounds",
        ],
    )
    floors = Table(
        "The host's floor, measured in the same runs: the CPU seconds a round of every process "
        "of the run (learners, syncer, relay) against the core-seconds the host's cores offer "
        "in a round, and the utilisation that permits (compute / max(compute, CPU / cores))",
        [
            "preset",
            "L",
            "round (wall)",
            "compute a round",
            "CPU a round",
            "offered",
            "others' CPU a round",
            "floor (all cores)",
            "cores needed at utilisation 1",
            "utilisation",
        ],
    )
    parts = Table(
        "The sync path on a learner's training thread by part, seconds a round (the learners' "
        "exit lines: the whole job, start-up and drain included; docs/learner.md)",
        ["preset", "L", *SYNC_PATH_PHASES, "in all but drain"],
    )
    verdicts = Table(
        "Issue 45's utilisation targets in this run", ["preset", "L", "target", "figure", "verdict"]
    )
    for preset, runs in results.items():
        for share, r in sorted(runs.items()):
            u = utilisation(r)
            rounds_seen = u.steps / args.inner_steps if u.steps else math.nan
            main.add(
                preset,
                r["islands"],
                f"{r['step_s'] * 1000:.0f} ms",
                f"{share:g}%",
                mbit(r["rate"]),
                fmt_pct(seen_share(r, r["rate"], args.inner_steps)),
                f"{u.utilisation:.3f}",
                fmt_pct(u.waiting / u.wall),
                fmt_pct(u.sync_path / u.wall),
                f"{u.sync_path / rounds_seen:.2f}s" if rounds_seen else "n/a",
                r["rounds"],
            )
            c, fl = r["cpu"], host_floor(r, args.inner_steps)
            floors.add(
                preset,
                f"{share:g}%",
                f"{c.wall:.2f}s",
                f"{fl['compute']:.2f}s",
                f"{c.cpu:.2f}s",
                f"{fl['offered']:.2f}s ({fl['cores']} cores)",
                f"{c.others_cpu:.2f}s",
                f"{fl['alone']:.3f}",
                f"{fl['needed']:.0%}",
                f"{u.utilisation:.3f}",
            )
            by_part = r["parts"]
            parts.add(
                preset,
                f"{share:g}%",
                *(f"{by_part.get(k, 0.0):.3f}" for k in SYNC_PATH_PHASES),
                f"{sum(v for k, v in by_part.items() if k != 'drain'):.3f}",
            )
            need = 0.97 if share <= 50 else 0.90
            verdicts.add(
                preset,
                f"{share:g}%",
                f">= {need}",
                f"{u.utilisation:.3f}",
                verdict(u.utilisation >= need),
            )
    return [main, floors, parts, verdicts]


def parse_args(argv: Sequence[str] | None) -> Any:
    p = base_parser(__doc__.split("\n\n", 1)[0])
    p.add_argument(
        "--presets", nargs="+", default=["gpt-125m", "gpt-350m"], choices=sorted(STEP_MS)
    )
    p.add_argument(
        "--shares",
        nargs="+",
        type=float,
        default=[0, 50, 100],
        help="L: the link's share of a round, %% (0 = unlimited, the calibration)",
    )
    p.add_argument("--rounds", type=int, default=6, help="rounds an island trains")
    p.add_argument("--inner-steps", type=int, default=30, help="H")
    p.add_argument("--seq-len", type=int, default=128, help="tokens a step reports")
    p.add_argument(
        "--step-ms",
        type=float,
        default=None,
        help="an emulated step's wall time (default: per preset, STEP_MS)",
    )
    p.add_argument("--islands", type=int, default=None, help="default: per preset (ISLANDS)")
    p.add_argument("--latency-ms", type=float, default=10.0, help="one-way, where L > 0")
    p.add_argument("--timeout", type=float, default=1800.0, help="per run, seconds")
    p.add_argument("--quick", action="store_true", help="smoke: gpt-tiny, H=10, 6 rounds, L=0,50")
    args = p.parse_args(argv)
    if args.quick:
        args.presets, args.inner_steps, args.rounds, args.shares = ["gpt-tiny"], 10, 6, [0, 50]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    install_signal_cleanup()
    notes: list[str] = []
    load = LoadMonitor()
    results: dict[str, dict[float, dict[str, Any]]] = {}
    with load, workdir(args.workdir, "busy-emulated") as wd:
        for preset in args.presets:
            islands = args.islands or ISLANDS[preset]
            need = memory_estimate(params_of(preset, args.seq_len), islands)
            have = available_memory()
            if need > 0.9 * have:
                notes.append(
                    f"{preset} left out: {islands} island(s) and the syncer hold about "
                    f"{need / 2**30:.1f} GiB (measured learners, api/preflight's syncer), "
                    f"{have / 2**30:.1f} GiB "
                    "available"
                )
                print(notes[-1], flush=True)
                continue
            results[preset] = run_preset(args, preset, wd)
    notes.append(
        "Utilisation = the learners' time in (emulated) inner steps / wall, their first progress "
        "window left out; waiting: for the syncer (a merge); sync path: encode, snapshot, apply "
        "on the training thread. The emulated step sleeps: the link's thread and the syncer run "
        "beside it on the CPU, as beside a GPU, but the sync path's own arithmetic runs on the "
        "host (a GPU learner does it on the device). The floor: the run's CPU a round (every "
        "process of it, /proc) against cores x a round's wall; it permits compute / max(compute, "
        "CPU / cores); 'cores needed at utilisation 1': CPU / (cores x compute); others' CPU: "
        "/proc/stat's busy time less the run's own."
    )
    report = Report(
        script="busy_emulated",
        summary="Emulated accelerator steps, the real sync path at real sizes over a relay "
        "(issue 45, part 2)",
        tables=tables(args, results),
        notes=notes,
    )
    return publish(report, args, load)


if __name__ == "__main__":
    raise SystemExit(main())
