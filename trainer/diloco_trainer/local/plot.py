"""The loss plot of `diloco run --plot`: eval loss of the global weights against tokens merged,
and against wall time (the decoupling's point: the same loss sooner)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def loss_label(tokenizer: str | None) -> str:
    """The y label: the loss is in nats per token, and a token is what the tokenizer made
    (a byte for the byte-level default); an entrypoint's loss is its own (no tokenizer known)."""
    if tokenizer is None:
        return "eval loss (the model's loss_fn)"
    if tokenizer.startswith("bytes"):
        return "eval loss (nats/byte)"
    return f"eval loss (nats/token, {tokenizer})"


def _points(history: Sequence[Mapping[str, Any]]) -> list[tuple[int, float, float | None]]:
    """(tokens, loss, syncer time) of the evaluated entries, in token order."""
    points = []
    for h in history:
        if h.get("evalLoss") is not None:
            when = h.get("time")
            points.append((int(h["tokens"]), float(h["evalLoss"]), None if when is None else when))
    return sorted(points, key=lambda p: p[0])


def plot_eval_history(
    history: Sequence[Mapping[str, Any]],
    path: str | Path,
    *,
    title: str = "DiLoCo",
    tokenizer: str | None = "bytes",
) -> Path:
    """Write a PNG of evalLoss against tokens and, when the entries carry the syncer's time,
    against seconds since the first evaluation (side by side), from the syncer's evalHistory."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    points = _points(history)
    if not points:
        raise ValueError("no eval losses to plot: the syncer reported an empty evalHistory")
    timed = [(when, loss) for _, loss, when in points if when is not None]
    panels = 2 if len(timed) >= 2 else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.4 * panels, 4.0), dpi=100, squeeze=False)
    try:
        ax = axes[0][0]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3)
        ax.set_xlabel("tokens merged")
        ax.set_ylabel(loss_label(tokenizer))
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        if panels == 2:
            start = min(when for when, _ in timed)
            wall = axes[0][1]
            timed.sort()
            wall.plot(
                [w - start for w, _ in timed],
                [loss for _, loss in timed],
                marker="o",
                markersize=3,
                color="tab:orange",
            )
            wall.set_xlabel("seconds since the first evaluation")
            wall.set_ylabel(loss_label(tokenizer))
            wall.set_title(f"{title} (wall time)")
            wall.grid(True, alpha=0.3)
        fig.tight_layout()
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, format="png")
    finally:
        plt.close(fig)
    return out
