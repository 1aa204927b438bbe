"""The learner's arithmetic on a fragment, as pure functions on fp32 tensors.

Pseudo-gradient: Δ_f = θ_global_f − θ_local_f, the global weights the island last received (its
base) minus its current weights, in fp32. Its sign is the one an optimizer expects of a gradient:
the outer step θ ← θ − lr·Δ moves the global weights towards where the island trained them.

Receiving a merged fragment while overlapping (sync.overlapSteps τ > 0): the island pushed Δ at
θ_push and trained τ more steps to θ_now before the merge came back. We keep those steps:

    θ_f ← θ_global + (θ_now − θ_push)

Why this rule and not Streaming DiLoCo's α-mix (θ ← α·θ_now + (1−α)·θ_global, α ≈ 0.5): with it
every inner step lands in exactly one pseudo-gradient. The steps before the push are in Δ (merged
into θ_global, or refused); the τ steps after it are carried on top of θ_global and, since
θ_global becomes the new base, they are part of the next Δ, and so are the counters that describe
them (fragment_state.FragmentCounters.since). An α-mix instead keeps a share α of the pushed work
locally as well, so that work is counted twice (once merged, once again in the next Δ), and it
throws away a share (1−α) of the τ overlapped steps. With τ = 0 the rule is a plain overwrite.

`sync.mixAlpha` α > 0 still mixes, on top of that: θ_f ← α·θ_now + (1−α)·(θ_global + θ_now −
θ_push), i.e. a share α of the island's own weights is kept (what the knob always meant; 0, the
default, keeps nothing of the pushed work locally).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from diloco_trainer.core.compress import SLICE, slices


def pseudo_gradient(base: Mapping[str, Tensor], local: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Δ = θ_global − θ_local per tensor, in fp32 (the names of `base`)."""
    names = list(base)
    if not names:
        return {}
    # One batched subtraction: the same per-element results, without a launch per tensor on a
    # GPU learner's training thread.
    out = torch._foreach_sub(
        [base[n].to(torch.float32) for n in names], [local[n].to(torch.float32) for n in names]
    )
    return dict(zip(names, out, strict=True))


def received_weights(
    merged: Mapping[str, Tensor],
    now: Mapping[str, Tensor],
    at_push: Mapping[str, Tensor] | None,
    alpha: float = 0.0,
) -> dict[str, Tensor]:
    """The fragment's new local weights when the merged fragment arrives (fp32).

    merged: θ_global from the syncer; now: the island's weights at this step; at_push: its
    weights when it pushed the Δ this merge answers (None: nothing pushed, e.g. on joining, so
    there are no overlapped steps to keep). alpha: sync.mixAlpha.
    """
    if not 0.0 <= alpha < 1.0:
        raise ValueError(f"sync.mixAlpha must be in [0, 1), got {alpha}")
    names = list(merged)
    if not names:
        return {}
    # Batched ops (one launch per op for the whole fragment on a GPU), each the per-tensor rule
    # target = g + (cur − at_push), then alpha·cur + (1 − alpha)·target, element for element.
    g = [merged[n].to(torch.float32) for n in names]
    cur = [now[n].to(torch.float32) for n in names]
    target: Sequence[Tensor]
    if at_push is None:
        target = g
    else:
        kept = torch._foreach_sub(cur, [at_push[n].to(torch.float32) for n in names])
        target = torch._foreach_add(g, kept)
    if alpha:
        target = torch._foreach_add(
            torch._foreach_mul(cur, alpha), torch._foreach_mul(target, 1.0 - alpha)
        )
    return dict(zip(names, target, strict=True))


def received_weights_into(
    merged: Mapping[str, Tensor],
    now: Mapping[str, Tensor],
    at_push: Mapping[str, Tensor],
    alpha: float = 0.0,
) -> dict[str, Tensor]:
    """received_weights for weights on the host, written over `at_push` (contiguous fp32
    tensors the caller gives up) and returned: the same values bit for bit (the same ops on
    each element, tests/unit/test_learner_mixing.py).

    The batched ops made two fragment-sized temporaries (θ_now − θ_push, then the sum): 0.3 s
    or more of a one-core learner's training thread per 64M-value gpt-125m fragment, mostly
    first touches of fresh pages. Here each slice (compress.SLICE) is computed through one
    slice-sized buffer while it is in cache."""
    if not 0.0 <= alpha < 1.0:
        raise ValueError(f"sync.mixAlpha must be in [0, 1), got {alpha}")
    work = torch.empty(SLICE)
    out: dict[str, Tensor] = {}
    for n, g_t in merged.items():
        target = at_push[n].view(-1)  # a view: the writes below land in at_push's memory
        g, cur = g_t.to(torch.float32).reshape(-1), now[n].to(torch.float32).reshape(-1)
        for sl in slices(target.numel()):
            w = work[: sl.stop - sl.start]
            torch.sub(cur[sl], target[sl], out=w)  # kept = θ_now − θ_push
            torch.add(g[sl], w, out=target[sl])  # θ_global + kept
            if alpha:
                torch.mul(cur[sl], alpha, out=w)
                target[sl].mul_(1.0 - alpha).add_(w)
        out[n] = at_push[n]
    return out
