"""The outer optimizer: Delayed Nesterov, folded per round of work, on the syncer's fp32 weights.

Synchronous DiLoCo applies one Nesterov step per round (M islands x H inner steps each):
m ← β·m + g; θ ← θ − lr·(g + β·m) (heavy ball: θ ← θ − lr·(g + β·m_old), i.e. θ − lr·m).
Decoupled merges carry only part of a round (K < M islands, or islands out of phase), and
applying a full step per merge decays the momentum M/K times per round and amplifies the step
(Async Local-SGD, arXiv 2401.09135, Eq. 5). Delayed Nesterov (same paper, Alg. 3 with c = 0),
generalised from "every N-th arrival" to work fractions:

- a merge carries a work fraction φ (core/contributions.py: the share of one round of work it
  holds) and its merged pseudo-gradient g; it moves θ by lr·φ·g (the gradient term) and adds φ·g
  to a buffer b;
- whenever the fractions accumulated since the last fold reach 1, the buffer is folded into the
  momentum, m ← β·m + b, b ← 0, and θ moves by lr·β·m (Nesterov; lr·β·m_old for heavy ball).
  A fraction that crosses 1 is split: the part up to 1 closes the round, the rest starts the
  next one (a merge with φ ≥ 2 folds more than once);
- a merge's `momentum_share` s (core/contributions.momentum_share: below 1 only when a
  contributor is stale) scales what it adds to the buffer, s·φ·g, and not its gradient term:
  a stale Δ moves θ once but does not act again through the momentum;
- a *complete* merge, one that holds a push of every island the round spans, closes the open
  round with all of its work (one fold, the buffer then empty) whatever its φ. That is the
  paper's own unit (a fold every N arrivals, N the workers): work fractions stand in for it
  only when merges are partial. Counting work alone, one early merge of islands that pushed
  after 26 steps instead of 30 (φ = 0.883: phase alignment moved them) left every later merge
  of all four islands split across two folds for the rest of the job, 0.175 of it closing one
  round and 0.825 opening the next: a momentum one merge late, where K = M's (φ = 1 each time)
  is not. The same held at K = M for the second fragment, whose first push is half a round.

So a merge of every island's full round (φ = 1) is exactly torch.optim.SGD's step (bit for bit,
see the unit tests), and M merges of one island each (φ = 1/M) give the same θ as one synchronous
step when their pseudo-gradients are equal. Fragments are independent groups: each has its own
buffer, accumulated fraction and count of completed rounds (`rounds`), and a step touches only
the tensors it is given.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from diloco_trainer.core.compress import SLICE, slices

# Buffers are saved beside the momentum under this prefix (one safetensors file, old checkpoints
# with momentum only still load: their buffers are empty).
BUFFER_PREFIX = "buffer/"
# Accumulated fractions this close to 1 close the round (1/3 + 1/3 + 1/3 is not 1.0 in floats).
ROUND_EPS = 1e-9


def split_fraction(
    accumulated: float, fraction: float, *, complete: bool = False
) -> tuple[list[tuple[float, bool]], float]:
    """Portions of a merge's work fraction and whether each closes a round, plus the fraction
    accumulated afterwards.

    split_fraction(0.75, 0.5) == ([(0.25, True), (0.25, False)], 0.25): the first quarter
    completes the round, the second starts the next one. A `complete` merge (every island in
    it) closes the open round with all of its work: split_fraction(0.75, 0.5, complete=True) ==
    ([(0.5, True)], 0.0).
    """
    if not (math.isfinite(fraction) and fraction >= 0.0):
        raise ValueError(f"work fraction must be finite and >= 0, got {fraction}")
    if not (math.isfinite(accumulated) and 0.0 <= accumulated < 1.0):
        raise ValueError(f"accumulated fraction must be in [0, 1), got {accumulated}")
    if complete and fraction > ROUND_EPS:
        return [(fraction, True)], 0.0
    portions: list[tuple[float, bool]] = []
    acc, rest = accumulated, fraction
    while rest > ROUND_EPS and acc + rest >= 1.0 - ROUND_EPS:
        take = min(rest, max(0.0, 1.0 - acc))
        portions.append((take, True))
        rest -= take
        acc = 0.0
    if rest > ROUND_EPS:
        portions.append((rest, False))
        acc += rest
    return portions, acc


# fused(name, slice, g's slice, θ's slice, m's slice): a plain round's work on one slice.
FusedSlice = Callable[[str, slice, Tensor, Tensor, Tensor], None]


def _same(a: Tensor, b: Tensor) -> bool:
    """Whether two slices are the same memory."""
    return a.data_ptr() == b.data_ptr()


class OuterOptimizer:
    """Delayed Nesterov (or heavy-ball) SGD that updates the given fp32 tensors in place, by name.

    step(grads) with the default fraction 1 is torch.optim.SGD's step; see the module docstring.
    """

    def __init__(
        self, params: dict[str, Tensor], *, lr: float, momentum: float, nesterov: bool
    ) -> None:
        for name, p in params.items():
            if p.dtype != torch.float32:
                raise ValueError(f"outer parameter {name!r} must be float32, got {p.dtype}")
            if p.requires_grad:
                raise ValueError(f"outer parameter {name!r} must not require grad")
        self.params = params
        self.lr = float(lr)
        self.momentum = float(momentum)
        # With momentum 0 both are plain SGD: no momentum or buffer is kept at all.
        self.nesterov = nesterov and momentum > 0
        self._m: dict[str, Tensor] = {}
        self._b: dict[str, Tensor] = {}
        self._accumulated: dict[int, float] = {}
        self._rounds: dict[int, int] = {}

    # ----- progress per group (fragment) -------------------------------------------------------

    def rounds(self, group: int = 0) -> int:
        """Rounds of work completed (folds) in `group`."""
        return self._rounds.get(group, 0)

    def accumulated(self, group: int = 0) -> float:
        """Work fraction merged into `group` since its last fold, in [0, 1)."""
        return self._accumulated.get(group, 0.0)

    def clock(self, group: int = 0) -> float:
        """Rounds of work merged into `group` so far: rounds + accumulated."""
        return self.rounds(group) + self.accumulated(group)

    def progress_json(self) -> dict[str, dict[str, float]]:
        """Per-group rounds and accumulated fraction, for checkpoint manifests."""
        groups = sorted(set(self._rounds) | set(self._accumulated))
        return {
            str(g): {"rounds": self.rounds(g), "accumulated": self.accumulated(g)} for g in groups
        }

    def load_progress(self, doc: Mapping[str, Mapping[str, Any]]) -> None:
        """Restore what progress_json() saved."""
        for key, entry in doc.items():
            group = int(key)
            rounds, acc = int(entry.get("rounds", 0)), float(entry.get("accumulated", 0.0))
            if rounds < 0 or not 0.0 <= acc < 1.0:
                raise ValueError(f"outer progress of group {group} is invalid: {dict(entry)}")
            self._rounds[group] = rounds
            self._accumulated[group] = acc

    def set_rounds(self, group: int, rounds: int) -> None:
        """Set a group's completed rounds (a checkpoint from before rounds were counted: one per
        merge then)."""
        self._rounds[group] = int(rounds)

    def reserve(self, names: Iterable[str]) -> None:
        """Make the momentum of `names` now (zeros, as a first fold would), so that a group's
        first step does not allocate and zero it on its path (the syncer reserves a fragment's
        when its first push is folded, a worker thread's time). Nothing without momentum."""
        if not self.momentum:
            return
        for name in names:
            if name not in self._m:
                self._m[name] = torch.zeros_like(self.params[name])

    # ----- the step ----------------------------------------------------------------------------

    def _check(self, grads: Mapping[str, Tensor]) -> None:
        for name, g in grads.items():
            p = self.params.get(name)
            if p is None:
                raise ValueError(f"outer step for unknown tensor {name!r}")
            if g.shape != p.shape:
                raise ValueError(
                    f"outer gradient {name!r} has shape {tuple(g.shape)}, expected {tuple(p.shape)}"
                )

    @torch.no_grad()
    def step(
        self,
        grads: Mapping[str, Tensor],
        fraction: float = 1.0,
        group: int = 0,
        *,
        complete: bool = False,
        momentum_share: float = 1.0,
        each: Callable[[str, slice], None] | None = None,
        before: Callable[[str, slice], None] | None = None,
        fused: FusedSlice | None = None,
    ) -> int:
        """Apply one merge carrying `fraction` of a round to exactly the named tensors (one
        fragment, `group`; `complete`: it holds every island's push, see the module docstring);
        returns how many rounds it completed (folds). `momentum_share`: the share of φ·g that
        enters the buffer (the module docstring; 1: all of it, as torch.optim.SGD).

        Streamed a slice of each tensor at a time (compress.slices): every value goes through
        the same float ops as on the whole tensor, so the result is the same bit for bit, with
        slice-sized temporaries instead of P-sized ones. `each(name, slice)` runs after every
        slice of θ is final (the published update reads it while it is in cache);
        `before(name, slice)` before the slice of `grads[name]` is read (the syncer finishes
        the merge's division there, core/fold.result_undivided, instead of a pass of its own).
        `fused(name, slice, g, θ, m)`, for a plain round (plain_round) only, replaces all of a
        slice's work, `before` and `each` included (core/fused_update.py): the round's fold
        m ← β·m + g and θ ← θ − lr·(g + β·m)."""
        self._check(grads)
        if not (math.isfinite(momentum_share) and 0.0 <= momentum_share <= 1.0):
            raise ValueError(f"momentum share must be in [0, 1], got {momentum_share}")
        plain = momentum_share == 1.0 and self.plain_round(
            grads, fraction, group, complete=complete
        )
        if fused is not None and plain:
            return self._step_fused(grads, group, fused)
        portions, after = split_fraction(self.accumulated(group), fraction, complete=complete)
        # The gradient term's slice is written here, reused (one per call: merges of other
        # fragments may step at the same time).
        scratch = torch.empty(0)
        for name, g in grads.items():
            flat = g.detach().to(torch.float32).reshape(-1)
            param = self.params[name].view(-1)
            kept, fresh = self._b.get(name), None
            for sl in slices(param.numel()):
                if scratch.numel() < sl.stop - sl.start:
                    scratch = torch.empty(SLICE)
                work = scratch[: sl.stop - sl.start]
                if before is not None:
                    before(name, sl)
                buf = self._step_slice(
                    name, flat[sl], param[sl], sl, fraction, portions, kept, work, momentum_share
                )
                if buf is not None and (kept is None or not _same(buf, kept.view(-1)[sl])):
                    if fresh is None:  # the open round's new buffer: in the folded one's place
                        fresh = kept if kept is not None else torch.empty_like(param)
                    fresh.view(-1)[sl].copy_(buf)
                if each is not None:
                    each(name, sl)
            if self.momentum and portions:
                left = fresh if fresh is not None else kept
                self._b.pop(name, None)
                if not portions[-1][1]:  # the last portion leaves the round open
                    if left is None:  # an empty tensor: no slice made one
                        left = torch.zeros_like(param)
                    self._b[name] = left.view_as(self.params[name])
        folds = sum(1 for _, closes in portions if closes)
        self._rounds[group] = self.rounds(group) + folds
        self._accumulated[group] = after
        return folds

    def plain_round(
        self, grads: Mapping[str, Tensor], fraction: float, group: int = 0, *, complete: bool
    ) -> bool:
        """Whether step() would be one Nesterov fold of a whole round and nothing else: the
        merge carries work fraction 1 and closes the round, which holds no open buffer of these
        tensors (every merge of a K = M job)."""
        if not (self.nesterov and fraction == 1.0) or any(n in self._b for n in grads):
            return False
        portions, _ = split_fraction(self.accumulated(group), fraction, complete=complete)
        return portions == [(1.0, True)]

    def _step_fused(self, grads: Mapping[str, Tensor], group: int, fused: FusedSlice) -> int:
        """step() of a plain round, each slice by `fused`."""
        for name, g in grads.items():
            flat = g.detach().to(torch.float32).reshape(-1)
            param = self.params[name].view(-1)
            m = self._m.get(name)
            if m is None:
                m = self._m[name] = torch.zeros_like(self.params[name])
            for sl in slices(param.numel()):
                fused(name, sl, flat[sl], param[sl], m.view(-1)[sl])
            self._b.pop(name, None)
        self._rounds[group] = self.rounds(group) + 1
        self._accumulated[group] = 0.0
        return 1

    def _step_slice(
        self,
        name: str,
        g: Tensor,
        param: Tensor,
        sl: slice,
        fraction: float,
        portions: list[tuple[float, bool]],
        kept: Tensor | None,
        work: Tensor,
        share: float = 1.0,
    ) -> Tensor | None:
        """One slice of step(): θ's slice moves; returns the open round's buffer slice left
        (`kept`'s slice, or a new one the caller stores), None when every portion folded.
        `work`: a slice-sized buffer for the gradient term; `share`: step()'s momentum_share,
        on what each portion adds to the buffer."""
        beta = self.momentum
        # The gradient term, lr·φ·g in all: g·φ plus each fold's momentum term. g·1 is g bit
        # for bit, so at φ = 1 (every merge of a K = M job) g is read as it is, not copied.
        update: Tensor | None = None
        buf = kept.view(-1)[sl] if kept is not None else None
        for portion, closes in portions:
            if beta == 0.0:
                continue
            into = portion * share
            if buf is None:
                # a round closed at once reads g only (m += buf): no copy of it at φ = 1
                buf = g if closes and into == 1.0 else g.mul(into)
            else:
                buf.add_(g, alpha=into)
            if closes:
                term, coeff = self._fold(name, buf, sl)
                if update is None:
                    update = (
                        torch.add(g, term, alpha=coeff, out=work)
                        if fraction == 1.0
                        else torch.mul(g, fraction, out=work).add_(term, alpha=coeff)
                    )
                else:
                    update.add_(term, alpha=coeff)
                buf = None
        if update is None:
            update = g if fraction == 1.0 else torch.mul(g, fraction, out=work)
        param.add_(update, alpha=-self.lr)
        return buf

    def _fold(self, name: str, buf: Tensor, sl: slice) -> tuple[Tensor, float]:
        """m ← β·m + buf on one slice; returns the momentum term of θ's move (before lr) as
        (tensor, factor): β·m (Nesterov) or β·m_old (heavy ball). Written as torch.optim.SGD
        computes it, so a full round matches it bit for bit."""
        beta = self.momentum
        m = self._m.get(name)
        if m is None:
            m = self._m[name] = torch.zeros_like(self.params[name])
        m = m.view(-1)[sl]
        m.mul_(beta)
        if self.nesterov:
            m.add_(buf)
            return m, beta
        term = m.clone()  # β·m_old
        m.add_(buf)
        return term, 1.0

    # ----- state -------------------------------------------------------------------------------

    def state_tensors(self) -> dict[str, Tensor]:
        """Momentum by parameter name, and open-round buffers as BUFFER_PREFIX + name (only
        tensors that have them)."""
        out = {name: m.detach().contiguous() for name, m in self._m.items()}
        out.update({BUFFER_PREFIX + n: b.detach().contiguous() for n, b in self._b.items()})
        return out

    def load_state_tensors(self, state: Mapping[str, Tensor], *, take: bool = False) -> None:
        """Restore tensors saved by state_tensors() (names must be parameters); `take`: keep
        the given fp32 tensors themselves (a checkpoint's, used nowhere else) instead of
        copies, so a resume holds one momentum, not two."""
        parsed: list[tuple[dict[str, Tensor], str, Tensor]] = []
        for key, t in state.items():
            is_buf = key.startswith(BUFFER_PREFIX) and key[len(BUFFER_PREFIX) :] in self.params
            name = key[len(BUFFER_PREFIX) :] if is_buf else key
            p = self.params.get(name)
            if p is None:
                raise ValueError(f"outer optimizer state for unknown tensor {key!r}")
            if t.shape != p.shape:
                raise ValueError(
                    f"outer optimizer state {key!r} has shape {tuple(t.shape)}, "
                    f"expected {tuple(p.shape)}"
                )
            parsed.append((self._b if is_buf else self._m, name, t))
        for target, name, t in parsed:
            owned = take and t.dtype == torch.float32 and t.is_contiguous()
            target[name] = t.detach() if owned else t.detach().to(torch.float32).clone()
