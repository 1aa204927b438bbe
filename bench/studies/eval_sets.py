"""How much the choice of held-out tokens moves a loss ratio between two runs: `python -m
bench.studies.eval_sets BASE_RUN RUN_DIR ... [--sets 16] [--tokens 4096]` (issue 45).

Reads runs of bench/busy_link (`seed*-k*-L*` folders, each with its syncer's checkpoints) and
evaluates each run's last checkpoint (its global weights; `--outer-step S`: its checkpoint of
outer step S, models at equal tokens) on `--sets` disjoint held-out sets of `--tokens` tokens
each: the syncer's evaluation windows (evenly spaced over the eval split, models/data.eval_batches)
for `sets x tokens` tokens, window w in set w mod sets, so every set spans the whole split as the
syncer's own does. Per run against BASE_RUN: the loss ratio on all the windows together and on
each set, and the sets' spread (sd, range). That spread is what a single `--tokens`-token
evaluation, as the syncer's live one (data.evalTokens, 4,096 in the benchmarks), adds to a ratio
of two runs' losses beside the runs' own spread (eval45: sd 0.23-0.50% at equal tokens on
gpt-mini, bench/log/2026-12-03.md); bench/busy_link's `--offline-eval-tokens` reads its loss
figure on 32,768 for it. Each run's model is held one at a time; nothing here is timed.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from pathlib import Path

import torch
from diloco_trainer.api.spec import JobSpec
from diloco_trainer.models.data import Batch
from diloco_trainer.models.parts import build_parts
from safetensors.torch import load_model


def set_means(per_window: Sequence[float], sets: int) -> list[float]:
    """The mean of each set's windows, window w in set w mod `sets` (equal tokens a window).

    >>> set_means([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 2)
    [3.0, 4.0]
    """
    if sets < 1 or len(per_window) < sets:
        raise ValueError(f"{len(per_window)} windows cannot make {sets} sets")
    return [statistics.mean(per_window[g::sets]) for g in range(sets)]


def ratio_spread(run: Sequence[float], base: Sequence[float]) -> tuple[float, float, float]:
    """The per-set loss ratios run / base: (sd, min, max).

    >>> ratio_spread([2.0, 3.0, 4.0], [2.0, 2.0, 4.0])
    (0.28867513459481287, 1.0, 1.5)
    """
    ratios = [a / b for a, b in zip(run, base, strict=True)]
    return statistics.stdev(ratios), min(ratios), max(ratios)


def checkpoint_at(run: Path, outer_step: int | None) -> Path:
    """The run's checkpoint of `outer_step` (its manifest's outerStep), or its last (None)."""
    saved = sorted((run / "syncer" / "checkpoints").glob("ckpt-*"))
    if outer_step is None and saved:
        return saved[-1]
    for folder in saved:
        if json.loads((folder / "manifest.json").read_text()).get("outerStep") == outer_step:
            return folder
    raise SystemExit(f"{run}: no checkpoint of outer step {outer_step}")


def window_losses(run: Path, tokens: int, outer_step: int | None = None) -> list[float]:
    """The run's checkpoint (checkpoint_at) on the syncer's evaluation windows for `tokens`
    held-out tokens: each window's mean loss."""
    raw = json.loads((run / "spec.json").read_text())
    raw.setdefault("data", {})["evalTokens"] = tokens
    parts = build_parts(JobSpec.model_validate(raw), shard_index=0, num_shards=1, with_train=False)
    load_model(parts.model, str(checkpoint_at(run, outer_step) / "weights.safetensors"))
    parts.model.eval()
    out = []
    with torch.no_grad():
        for batch in parts.eval_batches:
            for i in range(batch.inputs.shape[0]):
                one = Batch(
                    inputs=batch.inputs[i : i + 1],
                    targets=batch.targets[i : i + 1],
                    tokens=batch.inputs.shape[1],
                )
                out.append(float(parts.loss_fn(parts.model, one)))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("base", help="the busy_link run folder every other is compared with")
    parser.add_argument("runs", nargs="+", help="busy_link run folders")
    parser.add_argument("--sets", type=int, default=16, help="disjoint held-out sets (16)")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens a set (4096)")
    parser.add_argument(
        "--outer-step",
        type=int,
        default=None,
        help="each run's checkpoint of this outer step (bench/busy_link keeps one every outer "
        "step: its budget is outer step steps / H at K = M), not its last: models at equal "
        "tokens, as the loss figures compare them",
    )
    args = parser.parse_args(argv)
    if args.sets < 2 or args.tokens < 1:
        parser.error("--sets must be >= 2 and --tokens >= 1")
    base = window_losses(Path(args.base), args.sets * args.tokens, args.outer_step)
    base_sets = set_means(base, args.sets)
    print(f"{args.base}: {statistics.mean(base):.4f} on {args.sets} x {args.tokens} tokens")
    for run in args.runs:
        losses = window_losses(Path(run), args.sets * args.tokens, args.outer_step)
        sd, low, high = ratio_spread(set_means(losses, args.sets), base_sets)
        mean = statistics.mean(losses)
        print(
            f"{run}: {mean:.4f}, {mean / statistics.mean(base):.4f}x the base on every window; "
            f"on each {args.tokens}-token set {low:.4f}-{high:.4f}x, sd {sd:.4f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
