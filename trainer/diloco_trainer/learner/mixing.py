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


def merge_offset_into(merged: Mapping[str, Tensor], at_push: Mapping[str, Tensor]) -> None:
    """at_push ← θ_global − θ_push, in place, a slice at a time (host fp32 tensors): the half
    of received_weights that does not need the weights now. A host learner computes it on its
    syncer link's thread as soon as the merged fragment is pulled (FragmentState's
    receipt_preparer), so that its training thread only adds it (added_into)."""
    for n, g_t in merged.items():
        target = at_push[n].view(-1)
        g = g_t.to(torch.float32).reshape(-1)
        for sl in slices(target.numel()):
            torch.sub(g[sl], target[sl], out=target[sl])


def added_into(now: Mapping[str, Tensor], offset: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """θ_now + (θ_global − θ_push) written into `now` (the fragment's parameters, in place) and
    returned: received_weights with mixAlpha 0, one pass over the weights, equal to it up to
    float rounding (the same three values summed in another order)."""
    for n, t in now.items():
        t.add_(offset[n].view(t.shape))
    return dict(now)


LATE_MERGE_RULES = ("keep", "eager")  # sync.lateMergeRule


def outer_proxy_coefficients(*, lr: float, momentum: float, nesterov: bool) -> tuple[float, float]:
    """(c_Δ, c_u) of the proxy of the coming outer step, P̂ = c_Δ·Δ/w + c_u·u_prev (eager_proxy).

    The syncer's step on a merge of every island's round (core/outer.py) is, with g the merged
    per-round pseudo-gradient and m the momentum before it,
        Nesterov:   m' = β·m + g,  θ' = θ − lr·(g + β·m') = θ − lr·((1 + β)·g + β²·m)
        heavy ball: m' = β·m + g,  θ' = θ − lr·m'         = θ − lr·(g + β·m).
    A learner knows neither g nor m. It stands in its own per-round Δ/w for g (the eager
    update's proxy) and lr·m ≈ u_prev, the last update it received (θ_base_before − θ_base):
    exact for heavy ball (u_prev = lr·m), and for Nesterov in a steady state (g constant:
    m = g/(1 − β), u = lr·(g + β·m) = lr·m). So P̂ = lr·(1 + β)·Δ/w + β²·u_prev (Nesterov) or
    lr·Δ/w + β·u_prev (heavy ball)."""
    if nesterov:
        return lr * (1.0 + momentum), momentum * momentum
    return lr, momentum


def eager_proxy(
    base: Mapping[str, Tensor],
    at_push: Mapping[str, Tensor],
    last_update: Mapping[str, Tensor] | None,
    *,
    lr: float,
    momentum: float,
    nesterov: bool,
    work: float,
    own: bool = True,
) -> dict[str, Tensor]:
    """sync.lateMergeRule eager: the weights a learner continues from right after a push, its
    guess of the merge the push goes into: θ_proxy = θ_base − P̂, with Δ = θ_base − θ_push,
    P̂ = c_Δ·Δ/work + c_u·u_prev (outer_proxy_coefficients; `work` = the push's steps / H, the
    rounds of work Δ holds, as the syncer divides by; `last_update` None: no update received yet,
    u_prev = 0). The push's own weights θ_push are left: its work is in Δ, which the merge
    applies. On arrival the learner installs θ_global + (θ_now − θ_proxy) (received_weights with
    at_push = θ_proxy): the steps taken meanwhile are kept, and they were taken from about where
    the merge put the fragment rather than from θ_push, which the outer step (its momentum
    above all) has moved far from (Kale, Douillard, Donchev 2025, "Eager updates": the local
    outer gradient as a proxy of the others' until theirs arrives).

    `own` False: only the momentum's part of the step is guessed, θ_proxy = θ_push − c_u·u_prev
    (the island's own Δ is taken once, as it is, not as the outer step would scale it)."""
    if work <= 0:
        raise ValueError(f"a push's work must be > 0 rounds, got {work}")
    c_delta, c_update = outer_proxy_coefficients(lr=lr, momentum=momentum, nesterov=nesterov)
    if not own:
        c_delta, work = 1.0, 1.0
    out: dict[str, Tensor] = {}
    for n, b in base.items():
        b32 = b.to(torch.float32)
        delta = b32 - at_push[n].to(device=b32.device, dtype=torch.float32)
        proxy = b32 - delta * (c_delta / work)
        if last_update is not None:
            proxy -= last_update[n].to(device=b32.device, dtype=torch.float32) * c_update
        out[n] = proxy
    return out
