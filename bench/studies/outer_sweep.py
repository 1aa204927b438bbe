"""How close can synchronous DiLoCo get to data-parallel on decoupled_quality's setup?

`bench.decoupled_quality` finds K = M about 10% above synchronous data-parallel at equal tokens,
and torchft's DiLoCo there too. This asks whether that gap is ours or DiLoCo's at this scale: it
trains plain synchronous DiLoCo in one process (M islands, each its own AdamW and data shard, every
H steps the mean pseudo-gradient goes through torch's SGD with Nesterov momentum, as the DiLoCo
paper and torchft do; no compression, one fragment, no overlap) for a grid of outer learning
rates, momenta and H, against synchronous data-parallel on the same tokens
(`train_synchronous`), with the model, data, inner optimizer and schedule of
`bench.decoupled_quality`. Its row at the job's default outer settings is the same computation as
torchft's DiLoCo there (same seed, same loss to 4 digits), which checks the harness.

    python -m bench.studies.outer_sweep                 # the grid below, seeds 0 and 1
    python -m bench.studies.outer_sweep --grid 0.7,0.9,30 --seeds 0 --no-record
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from diloco_trainer.api.spec import JobSpec
from diloco_trainer.models.parts import (
    build_parts,
    evaluate,
    inner_lr,
    make_inner_optimizer,
    set_lr,
)
from diloco_trainer.models.reference import train_synchronous

from bench.decoupled_quality import make_spec as quality_spec
from bench.harness.common import (
    LoadMonitor,
    Report,
    Table,
    base_parser,
    fmt_ratio,
    publish,
    ratio,
)
from bench.harness.flags import INNER_OPTIMIZER, TRAINING

# (outer lr, momentum, H): the job's default first, then the neighbours a user would try, and
# plain averaging (lr 1, no momentum: local SGD / FedAvg).
DEFAULT_GRID = (
    "0.7,0.9,30",
    "1.0,0.9,30",
    "0.5,0.8,30",
    "0.7,0.6,30",
    "1.0,0.6,30",
    "0.7,0.3,30",
    "1.0,0,30",
    "0.7,0.9,10",
)


@dataclass(frozen=True)
class Outer:
    lr: float
    momentum: float
    h: int

    @classmethod
    def parse(cls, text: str) -> Outer:
        try:
            lr, mom, h = text.split(",")
            return cls(float(lr), float(mom), int(h))
        except ValueError as e:
            raise SystemExit(f"--grid wants LR,MOMENTUM,H (e.g. 0.7,0.9,30), got {text!r}") from e

    def label(self) -> str:
        rule = f"Nesterov {self.momentum:g}" if self.momentum > 0 else "no momentum"
        return f"lr {self.lr:g}, {rule}, H={self.h}"


def make_spec(args: Any, seed: int, h: int) -> JobSpec:
    """decoupled_quality's job (model, data, inner optimizer and schedule) with inner.steps = h."""
    return quality_spec(
        argparse.Namespace(**{**vars(args), "inner_steps": h}), seed=seed, quorum=args.islands
    )


def train_diloco(spec: JobSpec, outer: Outer, *, islands: int, steps: int) -> float:
    """Synchronous DiLoCo in one process; returns the global model's eval loss after `steps`."""
    parts = [build_parts(spec, shard_index=i, num_shards=islands) for i in range(islands)]
    global_model = copy.deepcopy(parts[0].model)
    theta = list(global_model.parameters())
    optimizer = torch.optim.SGD(
        theta, lr=outer.lr, momentum=outer.momentum, nesterov=outer.momentum > 0
    )
    inner = [make_inner_optimizer(spec, p.model) for p in parts]
    locals_ = [list(p.model.parameters()) for p in parts]
    for step in range(steps):
        for p, opt in zip(parts, inner, strict=True):
            assert p.train is not None
            set_lr(opt, inner_lr(spec, step))
            opt.zero_grad(set_to_none=True)
            p.loss_fn(p.model, p.train.next_batch()).backward()
            if spec.inner.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(p.model.parameters(), spec.inner.grad_clip)
            opt.step()
        if (step + 1) % outer.h:
            continue
        with torch.no_grad():
            # The outer gradient is the mean pseudo-gradient, global minus local weights.
            for j, g in enumerate(theta):
                g.grad = torch.stack([g - lp[j] for lp in locals_]).mean(dim=0)
            optimizer.step()
            for lp in locals_:
                for mine, g in zip(lp, theta, strict=True):
                    mine.copy_(g)
    return evaluate(parts[0], global_model)


def parse_args(argv: Sequence[str] | None) -> Any:
    p = base_parser(
        __doc__ or "",
        **TRAINING,
        **INNER_OPTIMIZER,
        islands=4,
        steps=600,
        eval_tokens=8192,
        seeds=[0, 1],
    )
    p.add_argument(
        "--grid",
        nargs="+",
        default=list(DEFAULT_GRID),
        help="outer settings as LR,MOMENTUM,H (the first is the reference row)",
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    grid = [Outer.parse(g) for g in args.grid]
    dp: list[float] = []
    losses: dict[Outer, list[float]] = {o: [] for o in grid}
    with LoadMonitor() as load:
        for seed in args.seeds:
            t0 = time.monotonic()
            spec = make_spec(args, seed, grid[0].h)
            dp.append(
                float(
                    train_synchronous(spec, num_workers=args.islands, total_steps=args.steps)[
                        "eval_loss"
                    ]
                )
            )
            print(f"seed {seed}: sync DP {dp[-1]:.4f} ({time.monotonic() - t0:.0f}s)", flush=True)
            for o in grid:
                t0 = time.monotonic()
                spec = make_spec(args, seed, o.h)
                losses[o].append(train_diloco(spec, o, islands=args.islands, steps=args.steps))
                print(
                    f"seed {seed}: {o.label()}: {losses[o][-1]:.4f} ({time.monotonic() - t0:.0f}s)",
                    flush=True,
                )
    dp_mean, ref = statistics.mean(dp), statistics.mean(losses[grid[0]])
    seeds = ", ".join(str(s) for s in args.seeds)
    table = Table(
        f"Eval loss at equal tokens, synchronous DiLoCo in one process (M={args.islands}, "
        f"{args.steps} steps per island; seeds {seeds})",
        ["variant", "loss per seed", "mean", "/ sync DP", f"/ {grid[0].label()}"],
    )
    table.add(
        "sync DP (baseline)",
        "; ".join(f"{v:.4f}" for v in dp),
        f"{dp_mean:.4f}",
        "1.0000x",
        fmt_ratio(ratio(dp_mean, ref), 4),
    )
    for o in grid:
        mean = statistics.mean(losses[o])
        table.add(
            f"DiLoCo, {o.label()}",
            "; ".join(f"{v:.4f}" for v in losses[o]),
            f"{mean:.4f}",
            fmt_ratio(ratio(mean, dp_mean), 4),
            fmt_ratio(ratio(mean, ref), 4),
        )
    best = min(grid, key=lambda o: statistics.mean(losses[o]))
    report = Report(
        "outer_sweep",
        "Synchronous DiLoCo against synchronous data-parallel at equal tokens on "
        "decoupled_quality's setup, for a grid of outer learning rates, momenta and H: is "
        "K = M's gap to data-parallel the product's or the algorithm's at this scale?",
        [table],
        notes=[
            "One process trains M islands (own AdamW and shard each) and the global model; every "
            "H steps the mean pseudo-gradient goes through torch.optim.SGD (Nesterov where "
            "momentum > 0), as the DiLoCo paper and torchft do. No compression, one fragment, no "
            "overlap. Model, data, inner lr (constant after warm-up), batch and token budget are "
            "decoupled_quality's.",
            f"Best in this grid: {best.label()}, {fmt_ratio(ratio(statistics.mean(losses[best]), dp_mean), 4)} "  # noqa: E501
            "of sync DP.",
        ],
    )
    return publish(report, args, load)


if __name__ == "__main__":
    sys.exit(main())
