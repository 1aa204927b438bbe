"""Syncer throughput: merge + outer step, in GB/s of pseudo-gradients, against plain torch.

For every (model, islands, merge rule) the syncer's own code path is timed, `merge_pseudo_gradients`
over M per-island tensor dicts followed by `OuterOptimizer.step`, and beside it, in the same run, a
plain torch loop doing the same arithmetic as fast as torch allows: the M pseudo-gradients as one
contiguous (M, P) matrix, the weighted mean as one mat-vec (per-tensor norms for RDA), and the
Nesterov update as torch.optim.SGD's foreach kernel on one flat tensor. A copy of the same number of
bytes measures what the memory system gives this process: throughput near it means the merge is
memory-bound, as it should be.

Figures: GB/s = bytes of fp32 pseudo-gradients read (M x P x 4) / median time of one merge + outer
step. Ratios: ours / plain torch, and ours / copy bandwidth.

    python -m bench.syncer_throughput                     # gpt-mini, gpt-small; 2..64 islands
    python -m bench.syncer_throughput --presets gpt-mini gpt-small gpt-125m --max-gib 12
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from diloco_trainer.core.merge import contribution_weight, merge_pseudo_gradients
from diloco_trainer.core.outer import OuterOptimizer
from diloco_trainer.models.model import build_model

from bench.harness.common import (
    LoadMonitor,
    Report,
    Table,
    base_parser,
    fmt_pct,
    fmt_ratio,
    plot_file,
    publish,
    ratio,
    save_figure,
)
from bench.harness.in_turn import times_in_turn

SEQ_LEN = 256  # only sets the position-table size; the syncer holds what the learners train
COPY_PROBE_BYTES = 256 * 2**20  # far larger than any CPU cache


def model_shapes(preset: str) -> dict[str, torch.Size]:
    """Parameter shapes of a preset, built on the meta device (no memory, no init time)."""
    with torch.device("meta"):
        model = build_model(preset, SEQ_LEN)
    return {name: p.shape for name, p in model.named_parameters()}


def embedding_names(preset: str) -> frozenset[str]:
    with torch.device("meta"):
        return build_model(preset, SEQ_LEN).embedding_names()


@dataclass(frozen=True)
class Case:
    preset: str
    islands: int
    rule: str
    params: int

    @property
    def delta_bytes(self) -> int:
        return self.islands * self.params * 4


def interleaved_medians(fns: Sequence[Callable[[], object]], repeats: int) -> list[float]:
    """Median wall time of each function, timed in turns (a, b, a, b, ...) after one warm-up each.

    Taking turns exposes both to the same background load, which matters on a shared machine.
    """
    return [statistics.median(ts) for ts in times_in_turn(fns, repeats)]


class OursPath:
    """The syncer's arithmetic: merge_pseudo_gradients over dicts, then OuterOptimizer.step."""

    def __init__(
        self,
        shapes: dict[str, torch.Size],
        islands: int,
        rule: str,
        plain: frozenset[str],
        gen: torch.Generator,
    ) -> None:
        self.deltas = [
            {n: torch.randn(s, generator=gen) * 1e-3 for n, s in shapes.items()}
            for _ in range(islands)
        ]
        tokens = [int(t) for t in torch.randint(1000, 5000, (islands,), generator=gen)]
        self.weights = [contribution_weight(t, 10, rule) for t in tokens]
        self.rule = rule
        self.plain = plain
        self.params = {n: torch.zeros(s) for n, s in shapes.items()}
        self.outer = OuterOptimizer(self.params, lr=0.7, momentum=0.9, nesterov=True)

    def __call__(self) -> None:
        merged = merge_pseudo_gradients(self.deltas, self.weights, self.rule, self.plain)
        self.outer.step(merged)


class PlainTorchPath:
    """The same arithmetic, as plain torch on flat buffers: the fastest way torch offers."""

    def __init__(
        self,
        shapes: dict[str, torch.Size],
        islands: int,
        rule: str,
        plain: frozenset[str],
        gen: torch.Generator,
    ) -> None:
        sizes = [s.numel() for s in shapes.values()]
        total = sum(sizes)
        self.matrix = torch.randn(islands, total, generator=gen) * 1e-3  # (M, P)
        tokens = torch.randint(1000, 5000, (islands,), generator=gen).float()
        w = tokens * tokens / 10
        self.w = w / w.sum()  # (M,)
        # Segments that RDA treats per tensor (embeddings take the plain weighted mean).
        self.segments: list[tuple[int, int]] = []
        offset = 0
        for (name, _), n in zip(shapes.items(), sizes, strict=True):
            if rule == "rda" and name not in plain:
                self.segments.append((offset, offset + n))
            offset += n
        self.rda = rule == "rda"
        self.param = torch.zeros(total)
        self.grad = torch.empty(total)
        self.param.grad = self.grad
        self.sgd = torch.optim.SGD([self.param], lr=0.7, momentum=0.9, nesterov=True, foreach=True)

    def __call__(self) -> None:
        torch.mv(self.matrix.t(), self.w, out=self.grad)  # weighted mean, (P,)
        if self.rda:
            for a, b in self.segments:
                v = self.matrix[:, a:b]  # (M, n)
                norms = torch.linalg.vector_norm(v, dim=1)  # (M,)
                coef = self.w / norms.clamp_min(1e-30)
                direction = torch.mv(v.t(), coef)
                self.grad[a:b] = direction * (float(self.w @ norms) / float(direction.norm()))
        self.sgd.step()


class CopyProbe:
    """Copies a buffer (read + write): what the memory system gives this process right now."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.src = torch.ones(nbytes // 4)
        self.dst = torch.empty_like(self.src)

    def __call__(self) -> None:
        self.dst.copy_(self.src)


def run_case(case: Case, repeats: int) -> dict[str, float]:
    shapes = model_shapes(case.preset)
    plain = embedding_names(case.preset)
    gen = torch.Generator().manual_seed(0)
    ours = OursPath(shapes, case.islands, case.rule, plain, gen)
    ref = PlainTorchPath(shapes, case.islands, case.rule, plain, gen)
    copy = CopyProbe(min(case.delta_bytes, COPY_PROBE_BYTES))
    t_ours, t_ref, t_copy = interleaved_medians([ours, ref, copy], repeats)
    gb = case.delta_bytes / 1e9
    return {
        "ours_s": t_ours,
        "ref_s": t_ref,
        "ours_gbs": gb / t_ours,
        "ref_gbs": gb / t_ref,
        "copy_gbs": copy.nbytes / 1e9 / t_copy,
    }


def plot(results: list[tuple[Case, dict[str, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = list(dict.fromkeys(c.preset for c, _ in results))
    rules = sorted({c.rule for c, _ in results})
    fig, axes = plt.subplots(1, len(rules), figsize=(6 * len(rules), 4.2), squeeze=False)
    for ax, rule in zip(axes[0], rules, strict=True):
        for preset in presets:
            rows = [(c, r) for c, r in results if c.preset == preset and c.rule == rule]
            xs = [c.islands for c, _ in rows]
            (line,) = ax.plot(
                xs, [r["ours_gbs"] for _, r in rows], marker="o", label=f"ours {preset}"
            )
            ax.plot(
                xs,
                [r["ref_gbs"] for _, r in rows],
                marker="x",
                linestyle="--",
                color=line.get_color(),
                label=f"plain torch {preset}",
            )
            ax.plot(
                xs,
                [r["copy_gbs"] for _, r in rows],
                linestyle=":",
                color=line.get_color(),
                alpha=0.6,
                label=f"copy bandwidth (during {preset})",
            )
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("islands (pseudo-gradients merged)")
        ax.set_ylabel("GB/s of fp32 pseudo-gradients")
        ax.set_title(f"merge + outer step, rule={rule}")
        ax.legend(fontsize=7)
    save_figure(fig, path)


def main(argv: Sequence[str] | None = None) -> int:
    p = base_parser(__doc__ or "")
    p.add_argument("--presets", nargs="+", default=["gpt-mini", "gpt-small"], help="model sizes")
    p.add_argument("--islands", nargs="+", type=int, default=[2, 4, 8, 16, 32, 64])
    p.add_argument(
        "--rules", nargs="+", default=["tokens", "rda"], choices=["tokens", "mean", "rda"]
    )
    p.add_argument("--repeats", type=int, default=7, help="timed repetitions (median)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument(
        "--max-gib",
        type=float,
        default=6.0,
        help="skip cases whose two sets of pseudo-gradients (ours + plain torch) exceed this",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    cases = []
    skipped = []
    for preset in args.presets:
        params = sum(s.numel() for s in model_shapes(preset).values())
        for m in args.islands:
            for rule in args.rules:
                case = Case(preset, m, rule, params)
                # Ours and the reference each hold their own M pseudo-gradients, at once.
                if 2 * case.delta_bytes > args.max_gib * 2**30:
                    skipped.append(case)
                else:
                    cases.append(case)

    table = Table(
        "Merge + outer step throughput (median of repeats)",
        [
            "model",
            "params",
            "islands",
            "rule",
            "ours GB/s",
            "plain torch GB/s",
            "ours / plain torch",
            "copy GB/s",
            "ours / copy",
        ],
    )
    results = []
    with LoadMonitor() as load:
        for case in cases:
            r = run_case(case, args.repeats)
            results.append((case, r))
            table.add(
                case.preset,
                f"{case.params / 1e6:.1f}M",
                case.islands,
                case.rule,
                f"{r['ours_gbs']:.2f}",
                f"{r['ref_gbs']:.2f}",
                fmt_ratio(ratio(r["ours_gbs"], r["ref_gbs"])),
                f"{r['copy_gbs']:.2f}",
                fmt_pct(ratio(r["ours_gbs"], r["copy_gbs"])),
            )
            print(
                f"{case.preset} M={case.islands} {case.rule}: ours {r['ours_gbs']:.2f} GB/s, "
                f"plain torch {r['ref_gbs']:.2f} GB/s",
                flush=True,
            )

    ratios = [ratio(r["ours_gbs"], r["ref_gbs"]) for _, r in results]
    plot_path = plot_file(args, "syncer_throughput")
    if results:
        plot(results, plot_path)
    notes = [
        "Copy GB/s: a buffer as large as the pseudo-gradients (at most "
        f"{COPY_PROBE_BYTES // 2**20} MiB) copied, timed in turns with both paths in each case; "
        f"torch threads: {torch.get_num_threads()}.",
        "GB/s counts the fp32 pseudo-gradient bytes read per merge (M x P x 4); both paths also "
        "write the merged gradient, the weights and the momentum (3 x P x 4 more).",
        "The plain torch reference holds the M pseudo-gradients as one contiguous (M, P) matrix, "
        "which the syncer cannot (they arrive one island at a time as separate tensors).",
    ]
    if ratios:
        notes.append(
            f"Ours / plain torch: median {fmt_ratio(statistics.median(ratios))}, "
            f"worst {fmt_ratio(min(ratios))}, best {fmt_ratio(max(ratios))}."
        )
    if skipped:
        notes.append(
            "Skipped (pseudo-gradients larger than --max-gib "
            f"{args.max_gib}): " + ", ".join(f"{c.preset} M={c.islands} {c.rule}" for c in skipped)
        )
    report = Report(
        "syncer_throughput",
        "Merge + outer-step throughput of the syncer's code (diloco_trainer.core.merge + outer) "
        "against a plain torch loop doing the same arithmetic, in the same run.",
        tables=[table],
        notes=notes,
        plots=[plot_path] if results else [],
    )
    return publish(report, args, load)


if __name__ == "__main__":
    raise SystemExit(main())
