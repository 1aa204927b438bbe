"""An emulated accelerator's inner step, for benchmarks only (DILOCO_EMULATE_STEP_SECONDS).

bench/busy_emulated.py runs the learner's real sync path (encode, push over the link, the
syncer's merge, pull, apply) at real model sizes (gpt-125m to gpt-1b) on a CPU machine, where a
real step at those sizes would take minutes. Each inner step is instead a fixed wall time, a
GPU's step for that size, spent mostly in time.sleep, which releases the interpreter lock as a
GPU kernel's wait does, so the link's thread runs beside it as it would beside a GPU.

So that the pushes carry real data, the parameters move each step by a real delta: the step
scales the next slice of all the parameters' values (a ring over them, ceil(P / H) values a
step, so that every value moves once a round) by (1 - DRIFT) in place. A round's Δ is then DRIFT
x θ: dense, of the weights' own distribution, and as large as a real round's (a relative
change of ~1e-3). The scaling is timed inside the step's wall time (the sleep is what is left
of it), as a GPU's step would include its optimizer's writes. No gradients or AdamW state are
made (the optimizer is never stepped), and no batch is read: the step reports the tokens a real
one would have processed, and a constant loss.

Copies of the model: none beyond the learner's own (views of the parameters).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
from torch import nn

from diloco_trainer.models.parts import TrainStream

# The relative change of every value each round (one visit of the ring a round).
DRIFT = 1e-3
# The loss an emulated step reports (no forward runs): a constant, so the learner's own EMA and
# the syncer's reports stay finite.
EMULATED_LOSS = 1.0


def ring_slices(sizes: list[int], start: int, count: int) -> list[tuple[int, int, int]]:
    """The (tensor index, lo, hi) slices of `count` consecutive values from flat position
    `start` of tensors of `sizes` laid out one after the other, wrapping round at the end
    (count is capped at the total: each value at most once)."""
    total = sum(sizes)
    if total == 0 or count <= 0:
        return []
    count = min(count, total)
    start %= total
    out: list[tuple[int, int, int]] = []
    offset = 0
    bounds = []
    for i, n in enumerate(sizes):
        bounds.append((i, offset, offset + n))
        offset += n
    pos, left = start, count
    while left > 0:
        for i, a, b in bounds:
            if a <= pos < b:
                take = min(b - pos, left)
                out.append((i, pos - a, pos - a + take))
                left -= take
                pos = (pos + take) % total
                break
    return out


class EmulatedStep:
    """An inner step of `seconds` wall time that moves ceil(P / steps_per_round) values."""

    def __init__(
        self,
        params: list[nn.Parameter],
        *,
        seconds: float,
        steps_per_round: int,
        tokens_per_step: int,
    ) -> None:
        self.seconds = seconds
        self.tokens_per_step = tokens_per_step
        self.flat = [p.detach().view(-1) for p in params]
        self.sizes = [t.numel() for t in self.flat]
        self.per_step = math.ceil(sum(self.sizes) / max(1, steps_per_round))
        self.cursor = 0

    def run(
        self, stream: TrainStream, before_backward: Callable[[], None] | None = None
    ) -> tuple[float, int]:
        """One emulated step: the next slice of the ring scaled, then sleep out the step's
        wall time; (the constant loss, the tokens a real step would have processed).
        `before_backward` (InnerStep.run's) is called first: the whole step stands for one."""
        del stream  # no batch is read: an emulated step has no forward
        t0 = time.perf_counter()
        if before_backward is not None:
            before_backward()
        with torch.no_grad():
            for i, lo, hi in ring_slices(self.sizes, self.cursor, self.per_step):
                self.flat[i][lo:hi].mul_(1.0 - DRIFT)
        self.cursor = (self.cursor + self.per_step) % max(1, sum(self.sizes))
        left = self.seconds - (time.perf_counter() - t0)
        if left > 0:
            time.sleep(left)
        return EMULATED_LOSS, self.tokens_per_step
