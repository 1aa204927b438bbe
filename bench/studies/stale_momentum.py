"""Stale pushes through the outer Nesterov momentum: a linear model of the outer loop (issue 45).

Why K = 1 lost quality over a slow link (bench/busy_link, L = 100%): merges there held one
island's push whose base was 1-6 versions (up to about 2 rounds of work) old, and the global
model's eval loss rose for outer steps on end while the learners' own losses did not. This
study asks whether the outer step itself, fed late, explains that: one direction of curvature,
error e (θ − θ*), the inner steps of a round covering a share `a` of it, so a push's Δ = a·e at
its base. M islands are merged one at a time (φ = 1/M each, K = 1 out of phase), each push
based D merges back (a lag of D/M rounds); the outer step is core/outer.py's Delayed Nesterov
(θ moves by lr·φ·d·Δ at once, the buffer gets s·φ·d·Δ, folded into the momentum once a round),
with d = core/contributions.staleness_discount and s the momentum share under test. The table
gives the spectral radius of a round's map (< 1: e shrinks by that factor a round; > 1: it
grows, the oscillation the runs showed), the worst over a in 0.1..1.

    python -m bench.studies.stale_momentum                # lr 0.7, β 0.9 (the job defaults)
    python -m bench.studies.stale_momentum --lr 1.0 --momentum 0.95 --no-record
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from diloco_trainer.core.contributions import momentum_share, staleness_discount

from bench.harness.common import LoadMonitor, Report, Table, base_parser, publish

ISLANDS = 4
SHARES = (0.1, 0.2, 0.3, 0.5, 0.7, 1.0)  # a: what a round's inner steps cover of e
Share = Callable[[float], float]
RULES: dict[str, Share] = {
    "discount only (before)": lambda _lag: 1.0,
    "(1 + lag)^-1": lambda lag: (1.0 + lag) ** -1,
    "(1 + lag)^-1.5": lambda lag: (1.0 + lag) ** -1.5,
    "(1 + lag)^-2 (momentum_share)": momentum_share,
    "(1 + lag)^-3": lambda lag: (1.0 + lag) ** -3,
}


def round_map(lr: float, beta: float, a: float, delay: int, share: float) -> np.ndarray:
    """A round's linear map of (e_t, .., e_t−delay, m, buffer): ISLANDS merges, the last one
    closing the round (fold: m ← β·m + buffer, θ moves by lr·β·m)."""
    n = delay + 3
    eye = np.eye(n)
    mi, bi = delay + 1, delay + 2
    lag = delay / ISLANDS
    scale = staleness_discount(lag) * a
    phi = 1.0 / ISLANDS
    out = np.eye(n)
    for merge in range(ISLANDS):
        step = np.zeros((n, n))
        grad = scale * eye[delay]  # Δ from the base `delay` merges back
        e_new = eye[0] - lr * phi * grad
        b_new = eye[bi] + share * phi * grad
        m_new = eye[mi]
        if merge == ISLANDS - 1:
            m_new = beta * eye[mi] + b_new
            e_new = e_new - lr * beta * m_new
            b_new = np.zeros(n)
        step[0] = e_new
        for i in range(1, delay + 1):
            step[i] = eye[i - 1]
        step[mi], step[bi] = m_new, b_new
        out = step @ out
    return out


def radius(lr: float, beta: float, delay: int, rule: Share, shares: Sequence[float]) -> float:
    """The worst spectral radius of a round's map over the inner steps' shares `shares`."""
    s = rule(delay / ISLANDS)
    return max(float(max(abs(np.linalg.eigvals(round_map(lr, beta, a, delay, s))))) for a in shares)


def parse_args(argv: Sequence[str] | None) -> Any:
    p = base_parser(__doc__ or "")
    p.add_argument("--lr", type=float, default=0.7, help="outer.lr")
    p.add_argument("--momentum", type=float, default=0.9, help="outer.momentum (Nesterov)")
    p.add_argument(
        "--max-lag", type=float, default=4.0, help="the largest lag, in rounds (maxStaleness)"
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    delays = range(0, int(args.max_lag * ISLANDS) + 1)
    with LoadMonitor() as load:
        table = Table(
            f"Spectral radius of a round of the outer loop (lr {args.lr}, Nesterov β "
            f"{args.momentum}, {ISLANDS} islands merged one at a time), worst over a in "
            f"{SHARES[0]}..{SHARES[-1]}, by the lag of every push",
            ["lag (rounds)", *RULES],
        )
        worst = dict.fromkeys(RULES, 0.0)
        for delay in delays:
            row = []
            for name, rule in RULES.items():
                r = radius(args.lr, args.momentum, delay, rule, SHARES)
                worst[name] = max(worst[name], r)
                row.append(f"{r:.3f}")
            if delay % 2 == 0:  # every half round
                table.add(f"{delay / ISLANDS:.2f}", *row)
        table.add(f"worst up to {args.max_lag:g}", *(f"{w:.3f}" for w in worst.values()))
    report = Report(
        "stale_momentum",
        "Stale pushes through Delayed Nesterov in a linear model of the outer loop: the "
        "spectral radius of a round (> 1: the global model's error grows) by the pushes' lag, "
        "for the momentum share a stale push feeds (the gradient term and discount as in "
        "core/).",
        tables=[table],
        notes=[
            "A push's Δ = a·e at its base; d = staleness_discount(lag) on it (both columns); "
            "the share scales only what enters the buffer (core/outer.py).",
        ],
    )
    return publish(report, args, load)


if __name__ == "__main__":
    raise SystemExit(main())
