"""A merge folded one pseudo-gradient at a time (pure, synchronous).

merge.merge_pseudo_gradients needs every island's pseudo-gradient at once: M decoded copies of a
fragment held until the round closes. Each contribution's weight ρ_i and scale s_i are known when
it arrives (contributions.py: they depend on its own tokens, steps and staleness only), and only
their sum Σρ normalises, so a round can hold one accumulator instead:

- weighted mean ("tokens", "mean", and RDA's plain names): acc = Σ ρ_i·s_i·v_i; the merge is
  acc / Σρ;
- RDA, per tensor: direction acc_d = Σ ρ_i·v_i/|v_i| and radius acc_r = Σ ρ_i·s_i·|v_i|; the
  merge is acc_d · (acc_r / Σρ) / |acc_d| (the batch form normalises ρ first; the direction's
  scale cancels, the radius divides by Σρ once).

merge.merge_pseudo_gradients is this fold over its inputs in order, so a batch merge in the
order the syncer folded the pushes gives its bits (fp sums depend on their order: the syncer
folds a K = M round by island, whatever the arrival order, syncer/merging/folding.py). The
same checks hold: weights and scales finite and >= 0, Σρ > 0, names and shapes as the first
contribution's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

# Elements of an accumulator finished at a time by result() (1 MiB of fp32: within L2).
SLICE = 2**18


def abs_max(t: Tensor) -> float:
    """max |x| of a non-empty tensor, nan when it holds one: torch.aminmax's one pass (several
    times faster on the CPU than vector_norm's ord=inf, and exact either way)."""
    lo, hi = torch.aminmax(t)
    return float(torch.maximum(hi, lo.neg()))  # maximum propagates NaN


@runtime_checkable
class SlicedVectors(Protocol):
    """A pseudo-gradient that adds itself into an accumulator a slice at a time (the syncer's
    still-encoded push: syncer/intake/payload.EncodedPayload), so folding it needs no decoded
    copy."""

    def shapes(self) -> Mapping[str, torch.Size]:
        """Each tensor's shape, by name (in the order the fold reads them)."""

    def device(self, name: str) -> torch.device:
        """Where the decoded values are (an accumulator made for them goes there)."""

    def whole(self, name: str) -> Tensor:
        """One tensor decoded whole (RDA needs its norm before adding it)."""

    def add_to(self, name: str, acc: Tensor, alpha: float) -> float | None:
        """acc += alpha · v for tensor `name`: each element as `acc.add_(v, alpha=alpha)`;
        returns max |acc| afterwards (abs_max's, read as each slice is written, while it is in
        cache; nan or inf when acc holds one: largest() combines slices so), or None when it
        was not read (result then reads it)."""


def largest(a: float, b: float) -> float:
    """The larger of two abs_max values, the first that is not finite winning (so a NaN in any
    slice makes the whole tensor's value nan, as abs_max of the whole gives)."""
    if not math.isfinite(a):
        return a
    if not math.isfinite(b) or b > a:
        return b
    return a


class _Whole:
    """Tensors by name, read as SlicedVectors."""

    def __init__(self, vectors: Mapping[str, Tensor]) -> None:
        self.vectors = vectors

    def shapes(self) -> Mapping[str, torch.Size]:
        return {name: v.shape for name, v in self.vectors.items()}

    def device(self, name: str) -> torch.device:
        return self.vectors[name].device

    def whole(self, name: str) -> Tensor:
        return self.vectors[name]

    def add_to(self, name: str, acc: Tensor, alpha: float) -> float | None:
        acc.add_(self.vectors[name], alpha=alpha)
        return None  # whole tensors are out of cache: result reads acc once at the end


class MergeFold:
    """The running merge of one fragment's round (see the module docstring)."""

    def __init__(
        self,
        rule: str,
        plain_names: frozenset[str] = frozenset(),
        buffer: Mapping[str, Tensor] | None = None,
    ) -> None:
        """`buffer`: fp32 tensors by name to accumulate in (zeroed at the first add) instead
        of new ones: the syncer gives the memory its new pull body will be written in."""
        self.rule = rule
        self.plain_names = plain_names
        self.buffer = buffer or {}
        self.acc: dict[str, Tensor] = {}
        self.radius: dict[str, float] = {}  # RDA's accumulated radius per tensor
        # max |acc| per weighted-mean tensor as its last add left it (add_to reads it while
        # each slice is in cache): result's merge check needs no pass of its own over acc.
        self.acc_amax: dict[str, float | None] = {}
        # Weights are folded relative to a power of two near the first non-zero one (`unit`):
        # tokens² weights stay near 1 in fp32, and scaling by a power of two is exact.
        self.unit: float | None = None
        self.total = 0.0  # Σρ / unit
        self.count = 0
        # Of the last result(): its largest |x| (nan/inf when not finite) and that tensor.
        self.amax = 0.0
        self.amax_name = ""

    def _rda(self, name: str) -> bool:
        return self.rule == "rda" and name not in self.plain_names

    def add(
        self, vectors: Mapping[str, Tensor] | SlicedVectors, weight: float, scale: float
    ) -> None:
        """Fold in one pseudo-gradient with mixing weight ρ and vector scale s (ValueError, with
        nothing folded, for a bad weight, scale, name or shape). `vectors`: tensors by name, or
        a SlicedVectors (the syncer's encoded push, decoded into the accumulator a slice at a
        time: the same element-wise adds, no decoded copy of it)."""
        for what, value in (("weight", weight), ("scale", scale)):
            if not (math.isfinite(value) and value >= 0.0):
                raise ValueError(f"merge {what} must be finite and >= 0, got {value}")
        src = vectors if isinstance(vectors, SlicedVectors) else _Whole(vectors)
        shapes = src.shapes()
        if self.acc:
            if set(shapes) != set(self.acc):
                diff = sorted(set(shapes) ^ set(self.acc))
                raise ValueError(f"pseudo-gradient has different tensor names: {diff[:5]}")
            for name, shape in shapes.items():
                if shape != self.acc[name].shape:
                    raise ValueError(
                        f"pseudo-gradient tensor {name!r} has shape {tuple(shape)}, "
                        f"expected {tuple(self.acc[name].shape)}"
                    )
        else:
            for name, shape in shapes.items():
                held = self.buffer.get(name)
                if held is not None and held.shape == shape and held.dtype == torch.float32:
                    self.acc[name] = held.zero_()
                else:
                    self.acc[name] = torch.zeros(
                        shape, dtype=torch.float32, device=src.device(name)
                    )
                self.radius[name] = 0.0
                self.acc_amax[name] = 0.0
        if weight and self.unit is None:
            self.unit = math.ldexp(1.0, math.frexp(weight)[1] - 1)
        weight = weight / self.unit if weight and self.unit else 0.0
        self.total += weight
        self.count += 1
        for name in shapes:
            if not weight:
                continue  # a zero weight counts in Σρ only (as in the batch merge)
            if self._rda(name):
                v = src.whole(name)
                norm = float(torch.linalg.vector_norm(v, dtype=torch.float32))
                if norm == 0.0 or scale == 0.0:
                    continue  # no direction; it adds 0 to the radius
                self.radius[name] += weight * scale * norm
                self.acc[name].add_(v, alpha=weight / norm)
            else:
                self.acc_amax[name] = src.add_to(name, self.acc[name], weight * scale)

    def result(self) -> dict[str, Tensor]:
        """The merged pseudo-gradient, computed in place in the accumulators (the fold is used
        up); ValueError when nothing was folded or the weights sum to zero."""
        out, divisors = self.result_undivided()
        for name, divisor in divisors.items():
            flat = out[name].view(-1)
            for start in range(0, flat.numel(), SLICE):
                flat[start : start + SLICE].div_(divisor)
        return out

    def result_undivided(self) -> tuple[dict[str, Tensor], dict[str, float]]:
        """result() but for its division: (tensors, divisor by name); each tensor named there
        is the merge once divided by it (`t.div_(divisor)`, a slice at a time or whole: the
        same values), so its reader can divide each slice as it reads it (the syncer's outer
        step) instead of a pass of its own over the fragment. `amax` is the divided result's
        already: x ↦ x / d (d > 0) rounds monotonically, so max|x| / d in fp32 is the largest
        |x / d| bit for bit (and nan/inf stay so)."""
        if not self.count:
            raise ValueError("nothing to merge: no pseudo-gradients")
        if not (self.total > 0.0 and math.isfinite(self.total)):
            raise ValueError("merge weights sum to zero: no contribution carries any weight")
        out, self.acc = self.acc, {}
        acc_amax, self.acc_amax = self.acc_amax, {}
        self.count = 0
        self.amax, self.amax_name = 0.0, ""
        divisors: dict[str, float] = {}
        for name, t in out.items():
            if not self._rda(name):
                divisors[name] = self.total
                # max|acc| (as the last add found it) / Σρ is the divided tensor's (see above);
                # fp32 as the tensor's, so the same value bit for bit
                known = acc_amax.get(name)
                if known is None:
                    known = abs_max(t) if t.numel() else 0.0
                value = torch.tensor([known], dtype=torch.float32).div_(self.total)
                self._note_amax(name, float(value[0]))
                continue
            factor = None
            dnorm = float(torch.linalg.vector_norm(t))
            if dnorm != 0.0:  # else all zero, or directions cancel exactly: no update
                factor = self.radius[name] / self.total / dnorm
            # A slice at a time: the largest |x| (the merge's check) read while it is in cache.
            flat = t.view(-1)
            for start in range(0, flat.numel(), SLICE):
                piece = flat[start : start + SLICE]
                if factor is not None:
                    piece.mul_(factor)
                self._note_amax(name, abs_max(piece))
        return out, divisors

    def _note_amax(self, name: str, value: float) -> None:
        """Keep the largest |x| of the result and its tensor (the first that is not finite)."""
        if not math.isfinite(self.amax):
            return
        if not math.isfinite(value) or value > self.amax:
            self.amax, self.amax_name = value, name
