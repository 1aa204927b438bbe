"""Merging pseudo-gradients from several islands into one outer gradient (pure functions).

Weights (Decoupled DiLoCo): an island's contribution weight is quantity x quality,
tokens x (tokens / steps), both counted since it last received the fragment. Staleness discounts,
per-contributor vector scales and the share of a round a merge carries are planned in
contributions.py.

Rules:
- "tokens" and "mean": the weighted mean sum_m w_m v_m / sum_m w_m (with "mean" the caller passes
  equal weights, see contribution_weight).
- "rda" (radial-directional averaging), per tensor, with phi(x) = x/|x|:
  (sum w_m |v_m| / sum w_m) * phi(sum w_m phi(v_m) / sum w_m). Averaging nearly orthogonal vectors
  of norm R shrinks the mean to about R/sqrt(M); RDA keeps the weighted mean norm. Embedding tables
  (plain_names) use the weighted mean: their rows are updated sparsely by different islands.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import Tensor

from diloco_trainer.core.fold import MergeFold

MERGE_RULES = ("tokens", "mean", "rda")


def contribution_weight(tokens: int, steps: int, rule: str) -> float:
    """Weight of one island's pseudo-gradient: tokens x tokens/steps ("tokens", "rda"), or 1."""
    if rule not in MERGE_RULES:
        raise ValueError(f"sync.merge {rule!r} is unknown; choose one of {list(MERGE_RULES)}")
    if tokens < 0 or steps < 0:
        raise ValueError(f"tokens ({tokens}) and steps ({steps}) must be >= 0")
    if rule == "mean":
        return 1.0
    if tokens == 0:
        return 0.0
    if steps == 0:
        raise ValueError(f"{tokens} tokens reported over 0 inner steps")
    return float(tokens) * (float(tokens) / float(steps))


def _check_inputs(
    deltas: Sequence[Mapping[str, Tensor]], weights: Sequence[float], rule: str
) -> tuple[list[str], list[float]]:
    if rule not in MERGE_RULES:
        raise ValueError(f"sync.merge {rule!r} is unknown; choose one of {list(MERGE_RULES)}")
    if not deltas:
        raise ValueError("nothing to merge: no pseudo-gradients")
    if len(deltas) != len(weights):
        raise ValueError(f"{len(deltas)} pseudo-gradients but {len(weights)} weights")
    ws = [float(w) for w in weights]
    if any(not (w >= 0.0) or w == float("inf") for w in ws):
        raise ValueError(f"merge weights must be finite and >= 0, got {ws}")
    total = sum(ws)
    if total <= 0.0:
        raise ValueError("merge weights sum to zero: no contribution carries any weight")
    names = list(deltas[0])
    for i, d in enumerate(deltas[1:], start=1):
        if set(d) != set(names):
            diff = sorted(set(d) ^ set(names))
            raise ValueError(f"pseudo-gradient {i} has different tensor names: {diff[:5]}")
    return names, [w / total for w in ws]


def merge_pseudo_gradients(
    deltas: Sequence[Mapping[str, Tensor]],
    weights: Sequence[float],
    rule: str,
    plain_names: frozenset[str] = frozenset(),
    scales: Sequence[float] | None = None,
) -> dict[str, Tensor]:
    """Merge per-island pseudo-gradients into one fp32 tensor per name.

    Weights are normalised here (they need not sum to 1). `scales` (default all 1) multiply each
    island's vectors before merging (contributions.py: Δ_i / w_i, the pseudo-gradient per round
    of work). Raises ValueError when the weights sum to zero, are negative, the scales are
    negative or not one per island, or the islands disagree on tensor names.
    """
    names, ws = _check_inputs(deltas, weights, rule)
    ss = [1.0] * len(ws) if scales is None else [float(s) for s in scales]
    if len(ss) != len(ws) or any(not (s >= 0.0) or s == float("inf") for s in ss):
        raise ValueError(f"merge scales must be one finite value >= 0 per island, got {ss}")
    # The same arithmetic as a round folded push by push (the syncer), so a merge replayed in
    # the order the syncer folded (by island at K = M, else as the pushes came) gives its bits.
    fold = MergeFold(rule, plain_names)
    for i, (d, w, s) in enumerate(zip(deltas, weights, ss, strict=True)):
        try:
            fold.add({name: d[name] for name in names}, float(w), s)
        except ValueError as err:
            raise ValueError(f"pseudo-gradient {i}: {err}") from None
    return fold.result()
