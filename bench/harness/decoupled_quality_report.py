"""Tables, targets and the plot of bench.decoupled_quality (kept apart from the runs).

A result is {"history": [(seconds since start, tokens processed, eval loss), ...], "wall" (to the
token budget), "ran_wall" and "ran_tokens" (how far the run went: past the budget for the
straggler group), "extended", "push", "pull" (bytes per worker), "merges", "outer_steps", "rates"
({island: tokens/s}), "seed"}; results are grouped by variant label, one per seed. Everything but
the history's tail past the budget and time_to_loss is read at the budget.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.harness.common import Table, fmt_bytes, fmt_pct, fmt_ratio, ratio, save_figure, verdict

Results = dict[str, list[dict[str, Any]]]


def interp(points: Sequence[tuple[float, float]], x: float) -> float:
    """Piecewise-linear y(x) through points sorted by x; clamped at both ends."""
    if not points:
        return math.nan
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


def loss_at_tokens(r: dict[str, Any], tokens: float) -> float:
    """Eval loss at `tokens` processed, linear between evaluations."""
    return interp(sorted((h[1], h[2]) for h in r["history"]), tokens)


def loss_at_time(r: dict[str, Any], t: float) -> float:
    """The last eval loss of the global weights at or before t seconds."""
    before = [h[2] for h in r["history"] if h[0] <= t]
    return before[-1] if before else r["history"][0][2]


def time_to_loss(r: dict[str, Any], target: float) -> float:
    """Seconds until an evaluation first read `target` or lower, over the whole run, past the
    budget included (inf if never).

    >>> time_to_loss({"history": [(0.0, 0.0, 5.0), (10.0, 1e3, 2.2), (20.0, 2e3, 2.1)]}, 2.15)
    20.0
    >>> time_to_loss({"history": [(0.0, 0.0, 5.0), (10.0, 1e3, 2.2)]}, 2.15)
    inf
    """
    return next((h[0] for h in r["history"] if h[2] <= target), math.inf)


def fmt_secs(values: Sequence[float], past: float) -> str:
    """Mean ± half-range of seconds over seeds; a run that never got there reads so.

    >>> fmt_secs([92.4, 120.0], 1.5)
    '106 ± 14 s'
    >>> fmt_secs([92.4, math.inf], 1.5)
    'not reached by 1.5x the budget'
    """
    mean, spread = mean_spread(values)
    if not math.isfinite(mean):
        return f"not reached by {past:g}x the budget"
    return f"{mean:.0f} ± {spread:.0f} s"


def ran_to(r: dict[str, Any], budget: int) -> str:
    """How far a run went: tokens processed over the budget, and its wall time.

    >>> ran_to({"ran_tokens": 1_843_200, "ran_wall": 131.6}, 1_228_800)
    '1.50x, 132 s'
    """
    return f"{r['ran_tokens'] / budget:.2f}x, {r['ran_wall']:.0f} s"


def mean_spread(values: Sequence[float]) -> tuple[float, float]:
    """Mean and half the range over seeds."""
    finite = [v for v in values if math.isfinite(v)]
    if len(finite) < len(values) or not values:
        return math.inf, 0.0
    return sum(values) / len(values), (max(values) - min(values)) / 2


def fmt_ms(values: Sequence[float], digits: int = 4) -> str:
    mean, spread = mean_spread(values)
    if not math.isfinite(mean):
        return "not reached"
    return f"{mean:.{digits}f} ± {spread:.{digits}f}"


def per_seed(results: Results, label: str, fn: Any) -> list[float]:
    return [fn(r) for r in results.get(label, [])]


def seed_of(results: Results, label: str, seed: int) -> dict[str, Any]:
    return next(r for r in results[label] if r["seed"] == seed)


def equal_time(results: Results, labels: Sequence[str], seed: int) -> float:
    """The wall time every variant of a group has run for: the earliest finish."""
    return min(seed_of(results, lab, seed)["wall"] for lab in labels if lab in results)


def main_table(args: Any, results: Results, budget: int) -> Table:
    m = args.islands
    base = "sync DP (baseline)"
    km = f"ours K={m}"
    groups = [
        [lab for lab in results if lab != base and ("slower" in lab) == slow] for slow in (0, 1)
    ]
    table = Table(
        f"Eval loss at {budget:,} tokens processed, and at equal wall time ({args.preset}, M={m}, "
        f"H={args.inner_steps}, {args.steps} steps per island; mean ± half-range over seeds "
        f"{', '.join(map(str, args.seeds))})",
        [
            "variant",
            "loss at equal tokens",
            "/ sync DP",
            "/ ours K=M",
            "loss at equal wall time",
            "wall to budget",
            "pushed / worker",
            "pulled / worker",
            "fewer bytes than DDP",
            "merges",
        ],
    )
    # --skip-baseline: no sync DP run, so no ratio to it and no DDP bytes to compare with.
    has_base = base in results
    ddp = results[base][0]["push"] + results[base][0]["pull"] if has_base else math.nan
    for label in results:
        group = next((g for g in groups if label in g), [])
        losses = per_seed(results, label, lambda r: loss_at_tokens(r, budget))
        ref = per_seed(results, base, lambda r: loss_at_tokens(r, budget))
        kref = per_seed(results, km, lambda r: loss_at_tokens(r, budget))
        at_t = [
            loss_at_time(r, equal_time(results, group, r["seed"])) for r in results[label] if group
        ]
        moved = sum(r["push"] + r["pull"] for r in results[label]) / len(results[label])
        table.add(
            label,
            fmt_ms(losses),
            fmt_ratio(ratio(mean_spread(losses)[0], mean_spread(ref)[0]), 4) if has_base else "—",
            fmt_ratio(ratio(mean_spread(losses)[0], mean_spread(kref)[0]), 4) if kref else "—",
            fmt_ms(at_t) if group else "—",
            fmt_ms(per_seed(results, label, lambda r: r["wall"]), 0) + " s",
            fmt_bytes(sum(r["push"] for r in results[label]) / len(results[label])),
            fmt_bytes(sum(r["pull"] for r in results[label]) / len(results[label])),
            "—" if label == base or not has_base else f"{ratio(ddp, moved):.0f}x",
            fmt_ms(per_seed(results, label, lambda r: r["merges"]), 0),
        )
    return table


def throughput_kept(results: Results, label: str, even: str, slow_island: int) -> float:
    """The other islands' tokens/s with the straggler over the same without (mean of seeds)."""
    kept = []
    for r in results.get(label, []):
        e = seed_of(results, even, r["seed"])
        others = [i for i in r["rates"] if i != slow_island]
        now = sum(r["rates"][i] for i in others)
        before = sum(e["rates"].get(i, math.nan) for i in others)
        if others and math.isfinite(now) and math.isfinite(before) and before > 0:
            kept.append(now / before)
    return sum(kept) / len(kept) if kept else math.nan


def straggler_rows(args: Any, results: Results, budget: int, slowdown: float) -> Table:
    m = args.islands
    past = getattr(args, "past_budget", 1.0)
    tag = f", island {m - 1} {slowdown:g}x slower"
    table = Table(
        f"One island {slowdown:g}x slower: the others' throughput and the time to reach K=M's "
        f"no-straggler loss at the budget (runs may go on to {past:g}x the budget)",
        [
            "variant",
            "others' tokens/s vs no straggler",
            "ran to (x budget, wall) per seed",
            "time to K=M's loss per seed (s)",
            "time to K=M's loss",
        ],
    )
    target = {r["seed"]: loss_at_tokens(r, budget) for r in results.get(f"ours K={m}", [])}
    for label in [lab for lab in results if lab.endswith(tag)]:
        even = label[: -len(tag)]
        runs = [r for r in results[label] if r["seed"] in target]
        times = [time_to_loss(r, target[r["seed"]]) for r in runs]
        kept = throughput_kept(results, label, even, m - 1) if even in results else math.nan
        table.add(
            label,
            fmt_pct(kept),
            "; ".join(ran_to(r, budget) for r in runs),
            "; ".join(f"{t:.0f}" if math.isfinite(t) else "not reached" for t in times),
            fmt_secs(times, past),
        )
    return table


def targets(args: Any, results: Results, budget: int, slowdown: float) -> Table:
    m = args.islands
    base, km = "sync DP (baseline)", f"ours K={m}"
    tag = f", island {m - 1} {slowdown:g}x slower"
    past = getattr(args, "past_budget", 1.0)
    t = Table("Targets (issue 9)", ["target", "figure", "verdict"])

    def mean_loss(label: str) -> float:
        return mean_spread(per_seed(results, label, lambda r: loss_at_tokens(r, budget)))[0]

    for k in sorted({max(1, m // 2), 1}, reverse=True):
        r = ratio(mean_loss(f"ours K={k}"), mean_loss(km))
        t.add(
            f"identical, equal tokens: K={k} within 2% of K={m}",
            fmt_ratio(r, 4),
            verdict(r <= 1.02),
        )
    if base in results:  # not with --skip-baseline
        r = ratio(mean_loss(km), mean_loss(base))
        t.add(f"K={m} within 2% of synchronous DP", fmt_ratio(r, 4), verdict(r <= 1.02))
        ddp = results[base][0]["push"] + results[base][0]["pull"]
        moved = sum(x["push"] + x["pull"] for x in results[km]) / len(results[km])
        t.add(
            f"K={m}: >= 100x fewer bytes than DDP (push + pull)",
            f"{ddp / moved:.0f}x",
            verdict(ddp / moved >= 100),
        )
    slow_km = results.get(km + tag, [])
    for k in sorted({max(1, m // 2), 1}, reverse=True):
        label = f"ours K={k}{tag}"
        if label not in results or k == m:
            continue
        kept = throughput_kept(results, label, f"ours K={k}", m - 1)
        t.add(
            f"straggler, K={k}: others keep >= 95% of their throughput",
            fmt_pct(kept),
            verdict(kept >= 0.95),
        )
        target = {r["seed"]: loss_at_tokens(r, budget) for r in results[km]}
        mine = [time_to_loss(r, target[r["seed"]]) for r in results[label]]
        theirs = [time_to_loss(r, target[r["seed"]]) for r in slow_km]
        t.add(
            f"straggler: K={k} reaches K={m}'s no-straggler loss in less wall time than K={m} "
            "with the straggler (mean over seeds)",
            f"{fmt_secs(mine, past)} vs {fmt_secs(theirs, past)}",
            verdict(mean_spread(mine)[0] < mean_spread(theirs)[0]),
        )
        peer = f"torchft K={m}{tag}"
        if peer in results:
            group = [label, peer]
            ours = [loss_at_time(r, equal_time(results, group, r["seed"])) for r in results[label]]
            tft = [loss_at_time(r, equal_time(results, group, r["seed"])) for r in results[peer]]
            a, b = mean_spread(ours)[0], mean_spread(tft)[0]
            t.add(
                f"straggler: K={k} beats torchft at equal wall time",
                f"{a:.4f} vs {b:.4f}",
                verdict(a < b),
            )
    return t


def per_seed_ratios(results: Results, label: str, ref: str, budget: int) -> list[tuple[int, float]]:
    """(seed, loss of `label` / loss of `ref`) at the budget, for every seed both ran.

    >>> run = lambda seed, loss: {"seed": seed, "history": [(0.0, 0.0, 5.0), (9.0, 100.0, loss)]}
    >>> per_seed_ratios({"a": [run(0, 2.02), run(1, 1.98)], "b": [run(0, 2.0)]}, "a", "b", 100)
    [(0, 1.01)]
    """
    mine = {r["seed"]: loss_at_tokens(r, budget) for r in results.get(label, [])}
    theirs = {r["seed"]: loss_at_tokens(r, budget) for r in results.get(ref, [])}
    return [(s, ratio(mine[s], theirs[s])) for s in mine if s in theirs]


def fmt_per_seed(pairs: Sequence[tuple[int, float]]) -> str:
    """Per-seed ratios, four digits each.

    >>> fmt_per_seed([(0, 0.99284), (3, 1.0179)])
    '0.9928 (seed 0); 1.0179 (seed 3)'
    """
    return "; ".join(f"{r:.4f} (seed {s})" for s, r in pairs)


def parity_targets(args: Any, results: Results, budget: int) -> Table:
    """Issue 23's targets, each seed on its own: ours at K = M at or below torchft's DiLoCo;
    K = M/2 and K = 1 at most 1% above ours at K = M (and on the mean over seeds); bytes per
    worker >= 100x fewer than DDP's pushed and, apart, pulled. A row whose variants did not
    run (--only, --skip-torchft) is left out."""
    m = args.islands
    base, km, peer = "sync DP (baseline)", f"ours K={m}", f"torchft K={m}"
    t = Table("Targets (issue 23, per seed)", ["target", "figure", "verdict"])
    pairs = per_seed_ratios(results, km, peer, budget)
    if pairs:
        t.add(
            f"ours K={m} at or below torchft K={m} on each seed",
            fmt_per_seed(pairs),
            verdict(all(r <= 1.0 for _, r in pairs)),
        )
    for k in sorted({max(1, m // 2), 1} - {m}, reverse=True):
        pairs = per_seed_ratios(results, f"ours K={k}", km, budget)
        if not pairs:
            continue
        t.add(
            f"K={k} at most 1% above K={m} on each seed",
            fmt_per_seed(pairs),
            verdict(all(r <= 1.01 for _, r in pairs)),
        )
        mean = sum(r for _, r in pairs) / len(pairs)
        t.add(
            f"K={k} at most 1% above K={m}, mean of the seeds' ratios",
            fmt_ratio(mean, 4),
            verdict(mean <= 1.01),
        )
    if base in results and km in results:
        ddp, ours = results[base][0], results[km]
        push = ratio(ddp["push"], sum(r["push"] for r in ours) / len(ours))
        pull = ratio(ddp["pull"], sum(r["pull"] for r in ours) / len(ours))
        t.add(
            f"K={m}: >= 100x fewer bytes per worker than DDP, pushed and pulled apart",
            f"{push:.0f}x pushed, {pull:.0f}x pulled",
            verdict(push >= 100 and pull >= 100),
        )
    return t


def tables(
    args: Any, results: Results, budget: int, slowdown: float
) -> tuple[list[Table], list[str]]:
    notes = [
        f"Token budget {budget:,} = {args.islands} islands x {args.steps} steps x "
        f"{args.batch_size} x {args.seq_len}. Ours stops at stopAfter.tokens = budget; tokens "
        "processed are read from the learners' progress lines (every 20 steps) and the loss at "
        "the budget is interpolated between the syncer's evaluations (one per outer step).",
        "Equal wall time: within each group (identical islands / with the straggler) the earliest "
        "finish of the group in that seed; the loss is the last evaluation at or before it. The "
        "baseline runs in one process and has no comparable wall time.",
        "Bytes per worker: ours, the syncer's bytesIn / M (pushes) and bytesOut / M (pulls); "
        "torchft, the payload given to Manager.allreduce x 2(M-1)/M each way; DDP (the reference "
        "for 'fewer bytes'), one ring all-reduce of fp32 gradients per step, both ways.",
        "Throughput with the straggler: the other islands' tokens/s between their first and last "
        "progress line, over the same run without a straggler. A sleeping straggler frees CPU "
        "on a shared machine, which can lift the others above 100%.",
        "Ours runs with the job's defaults (sync.fragments, overlapSteps, graceSeconds auto, "
        "merge tokens, compression int8 with int8 pulls) but for the quorum and any --sync "
        "setting in the command. Inner lr is constant after "
        "warm-up for every variant (stopAfter.tokens fixes no step count for a cosine).",
    ]
    past = getattr(args, "past_budget", 1.0)
    if past > 1:
        notes.append(
            f"Past the budget (--past-budget {past:g}): the runs with the straggler train on "
            f"after the token budget, up to {past:g}x it, so that the wall time at which they "
            "first reach K=M's no-straggler loss at the budget (same seed) is measured even when "
            "it comes after the budget. Ours is stopped at the first syncer status once the "
            "latest evaluation is of weights that merged the budget and some evaluation reached "
            f"that loss (else at stopAfter.tokens = {past:g}x the budget); torchft runs "
            f"ceil({past:g} x S/H) commits. Every equal-token figure (loss, bytes, merges, the "
            "others' throughput) and the wall to budget of these runs are read at the budget: "
            "ours at the first syncer status whose merged tokens reached it (what "
            "stopAfter.tokens counts), torchft at commit S/H; the loss at the budget is "
            "interpolated between evaluations of a run that goes on, where a run stopped at the "
            "budget ends on a final evaluation. The runs on identical islands stop at the "
            "budget, their wall until the job finished and the learners exited, as before. Time "
            "to K=M's loss: the time of the first evaluation at or below it (one follows each "
            "merge), over the whole run."
        )
    return [
        main_table(args, results, budget),
        straggler_rows(args, results, budget, slowdown),
        targets(args, results, budget, slowdown),
        parity_targets(args, results, budget),
    ], notes


def plot(results: Results, path: Path, budget: int | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tokens, ax_time) = plt.subplots(1, 2, figsize=(13, 5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for n, (label, runs) in enumerate(results.items()):
        colour = colours[n % len(colours)]
        style = "--" if "slower" in label else "-"
        for j, r in enumerate(runs):
            hist = r["history"]
            kw = {"color": colour, "linestyle": style, "alpha": 0.9 if j == 0 else 0.45}
            lab = label if j == 0 else None
            ax_tokens.plot([h[1] for h in hist], [h[2] for h in hist], marker=".", label=lab, **kw)
            if not label.startswith("sync DP"):
                ax_time.plot(
                    [h[0] for h in hist], [h[2] for h in hist], marker=".", label=lab, **kw
                )
    if budget is not None:
        ax_tokens.axvline(budget, color="grey", linewidth=0.8, linestyle=":")
    ax_tokens.set_xlabel("tokens processed (dotted: the budget)")
    ax_time.set_xlabel("wall time (s)")
    for ax in (ax_tokens, ax_time):
        ax.set_ylabel("eval loss")
        ax.set_ylim(top=min(6.0, ax.get_ylim()[1]))
    ax_tokens.set_title("Eval loss against tokens (seeds: solid first, faint second)")
    ax_time.set_title("Eval loss against wall time (dashed: with the straggler)")
    ax_tokens.legend(fontsize=7)
    save_figure(fig, path)
