"""Merges that come back L steps late at K = M: the kept overlapped steps (sync.lateMergeRule
keep) against the eager proxy (eager), at exactly equal tokens, in one process (issue 45).

bench/studies/ablation_sim's islands (the product's sync code, lockstep, no timing noise) with
the merge of each push installed L steps after it, as a learner whose overlap is fitted to a sync
latency of L steps does (sync.overlapMode auto with no small cap: τ = L, the wait hidden):
- keep: θ ← θ_global + (θ_now − θ_push) (learner/mixing.received_weights, the rule so far);
- eager: right after the push the island moves to θ_proxy = learner/mixing.eager_proxy (θ_base
  less its guess of the coming outer step, from its own Δ and the last update it received), takes
  its L steps from there, and installs θ_global + (θ_now − θ_proxy).
The reference is the same job with its merges back at once (τ = 0: the unlimited link's).

    python -m bench.studies.late_merge                         # seeds 0-2, L = 0, 5, 10, 15, 20, 29
    python -m bench.studies.late_merge --seeds 0 --late 10 --no-record
"""

from __future__ import annotations

import signal
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from diloco_trainer.learner.mixing import eager_proxy

from bench.harness.common import LoadMonitor, Report, Table, base_parser, fmt_ratio, publish
from bench.harness.flags import INNER_OPTIMIZER, TRAINING
from bench.studies import ablation
from bench.studies.ablation_sim import Knobs, Simulation

DEFAULTS = Knobs(push="int8", pull="int8", fragments=2, overlap=0, merge="tokens")


@dataclass(frozen=True)
class LateKnobs(Knobs):
    rule: str = "keep"  # sync.lateMergeRule


class LateSimulation(Simulation):
    """Simulation with sync.lateMergeRule eager: the jump to the proxy at each push."""

    knobs: LateKnobs

    def _sync(self, f: int, step: int) -> None:
        counted = [isl.steps[f] for isl in self.islands]
        super()._sync(f, step)
        if self.knobs.rule == "keep" or not self.knobs.overlap:
            return
        outer = self.spec.outer
        for isl, steps in zip(self.islands, counted, strict=True):
            pend = isl.pending[f]
            assert pend is not None
            prev = isl.previous[f]
            base = isl.bases[f]
            last = None if prev is None else {n: prev[n] - base[n] for n in base}
            proxy = eager_proxy(
                base,
                pend.at_push,
                last,
                lr=outer.lr,
                momentum=outer.momentum,
                nesterov=outer.nesterov,
                work=steps / self.h,
                own=self.knobs.rule == "eager",
            )
            with torch.no_grad():
                for n, t in proxy.items():
                    isl.params[n].copy_(t)
            pend.at_push = proxy


def variants(args: Any) -> dict[str, LateKnobs]:
    out = {"merged at once (τ = 0)": LateKnobs(**vars(DEFAULTS))}
    for late in args.late:
        if late <= 0:
            continue
        for rule in args.rules:
            out[f"{late} steps late, {rule}"] = replace(
                out["merged at once (τ = 0)"], overlap=late, rule=rule
            )
    return out


def run_all(args: Any) -> dict[str, dict[int, float]]:
    """{label: {seed: loss}} of this study's variants, on ablation's runner."""
    return ablation.run_all(args, variants(args), LateSimulation)


def table(args: Any, results: dict[str, dict[int, float]]) -> Table:
    t = Table(
        f"Eval loss after exactly {args.steps} steps per island, K = M = {args.islands}, "
        f"H = {args.inner_steps}, {args.preset}, the job's sync defaults, each merge installed L "
        f"steps after its push (in-process; seeds {', '.join(map(str, args.seeds))})",
        [
            "variant",
            "loss per seed",
            "mean",
            "/ merged at once (mean)",
            "/ merged at once per seed",
        ],
    )
    ref = results.get("merged at once (τ = 0)", {})
    for label in variants(args):
        per = results.get(label, {})
        got = [s for s in args.seeds if s in per and s in ref]
        if not got:
            continue
        ratios = [per[s] / ref[s] for s in got]
        t.add(
            label,
            "; ".join(f"{per[s]:.4f}" for s in got),
            f"{statistics.mean(per[s] for s in got):.4f}",
            fmt_ratio(
                statistics.mean(per[s] for s in got) / statistics.mean(ref[s] for s in got), 4
            ),
            "; ".join(fmt_ratio(r, 4) for r in ratios),
        )
    return t


def parse_args(argv: Sequence[str] | None) -> Any:
    p = base_parser(
        __doc__ or "",
        **TRAINING,
        **INNER_OPTIMIZER,
        islands=4,
        inner_steps=30,
        steps=300,
        eval_tokens=8192,
        seeds=[0, 1, 2],
    )
    p.add_argument("--late", type=int, nargs="+", default=[5, 10, 15, 20, 29], help="L, in steps")
    p.add_argument(
        "--rules", nargs="+", default=["keep", "eager"], choices=["keep", "eager", "momentum"]
    )
    p.add_argument("--jobs", type=int, default=2, help="variants trained at a time (processes)")
    return p.parse_args(argv)


def _exit_on_term(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_term)
    with LoadMonitor() as load:
        results = run_all(args)
    report = Report(
        "late_merge",
        "Merges back L steps after their push at K = M: the overlapped steps kept on top "
        "(sync.lateMergeRule keep) against the eager proxy (eager), at exactly equal tokens.",
        tables=[table(args, results)],
        notes=[
            "In one process with the product's sync code (bench/studies/ablation_sim): int8 "
            "pushes and pulls, 2 fragments, token merge; τ = L (the merge installed L steps "
            "after the push, the learner never waiting), against τ = 0.",
        ],
    )
    return publish(report, args, load)


if __name__ == "__main__":
    raise SystemExit(main())
