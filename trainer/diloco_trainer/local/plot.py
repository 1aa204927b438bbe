"""The loss plot of `diloco run --plot`: eval loss of the global weights against tokens."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def plot_eval_history(
    history: Sequence[Mapping[str, Any]], path: str | Path, *, title: str = "DiLoCo"
) -> Path:
    """Write a PNG of evalLoss against tokens from the syncer's evalHistory entries."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    points = [
        (int(h["tokens"]), float(h["evalLoss"])) for h in history if h.get("evalLoss") is not None
    ]
    if not points:
        raise ValueError("no eval losses to plot: the syncer reported an empty evalHistory")
    tokens, losses = zip(*sorted(points), strict=True)
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    try:
        ax.plot(tokens, losses, marker="o", markersize=3)
        ax.set_xlabel("tokens merged")
        ax.set_ylabel("eval loss (nats/byte)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, format="png")
    finally:
        plt.close(fig)
    return out
