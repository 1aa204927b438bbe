"""The syncer's merge of a whole round in one pass a slice: the outer Nesterov step and θ_pub's
int8 update fused into one compiled loop (numba), bit for bit the torch ops they replace.

The torch path (core/outer.OuterOptimizer.step with core/published.UpdateWriter's slices) is
about twenty element-wise passes over each 1 MiB slice: the merge's division, m ← β·m + g, the
gradient term, θ's move, θ − θ_pub, each block's max |x|, the quantise, the int8 write and its
read-back, the scales, θ_pub's add. Each is quick in cache but they add up: one syncer thread
spent 0.36-0.55 s on a gpt-125m fragment (64M values) against 0.15 s for the floor of the
syncer benchmark (bench/syncer_scale.py, bench/log/2026-11-27.md, "a plain round merged in one
compiled loop a slice"). This loop does the same arithmetic per 128-value block, with the same
roundings:

    g = acc / d                        (torch: acc.div_(d); d = 1 when the fold divided nothing)
    m = m·β + g                        (m.mul_(β), then m.add_(g): two roundings, no FMA)
    θ = fma(fma(m, β, g), −lr, θ)      (torch.add(g, m, alpha=β) and θ.add_(u, alpha=−lr) are
                                        fused multiply-adds in torch's CPU kernels, scalar tails
                                        included: tests/unit/test_fused_update.py checks the bits)
    x = θ − θ_pub;  a = max|x| of the block (0 for padding)
    scale = a / 127, inv = (1 / a)·127    (compress.block_scales; both 0 below FLUSH_TO_ZERO)
    q = round-half-even(x·inv)  (as (x·inv + 1.5·2²³) − 1.5·2²³: exact for |x·inv| < 2²², the
                                 same integer as torch.round; q's int8 has no sign of zero)
    θ_pub' = θ_pub + float(q)·scale     (a learner's decode and add, so it rebuilds the same bits)

Only a plain round uses it (OuterOptimizer.plain_round: Nesterov, the merge closes the round with
work fraction 1 and no open buffer, which is every merge of a K = M job) with int8 pulls, in a
syncer whose fragments are large enough to gain from it (syncer/global_model.use_fused_merge);
every other case stays on the torch path. The loop is compiled on its first call (about 1.5 s, once
per process): the syncer calls warm() in a thread of its own at start-up, so that a merge does not
wait for it (a merge that comes first waits for that compile, not for a second one). It releases
the interpreter lock.
"""

from __future__ import annotations

import numpy as np
import torch
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic
from torch import Tensor

from diloco_trainer.core.compress import BLOCK_SIZE, FLUSH_TO_ZERO, qmax

_F32 = np.float32
_QMAX = _F32(qmax("int8"))
_FTZ = _F32(FLUSH_TO_ZERO)
# 1.5 * 2**23: adding and taking it away again rounds a float32 of magnitude < 2**22 to an integer,
# half to even (the FPU's rounding), with no call the loop vectoriser would stop at.
_ROUNDER = _F32(12582912.0)
_ONE = _F32(1.0)
_ZERO = _F32(0.0)


@intrinsic
def _fma(typingctx, a, b, c):  # type: ignore[no-untyped-def]
    """a·b + c with one rounding (LLVM's llvm.fma.f32), as torch's vectorised fmadd."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        f32 = ir.FloatType()
        fn = cgutils.get_or_insert_function(  # type: ignore[no-untyped-call]
            builder.module, ir.FunctionType(f32, [f32, f32, f32]), "llvm.fma.f32"
        )
        return builder.call(fn, args)

    return sig, codegen


_SIGN = np.int32(0x7FFFFFFF)


# max|x| of a block as integers: a float32 without its sign bit orders as its bits do (NaN above
# +inf, so it reaches the scale as torch's max lets it), and an integer max vectorises where
# LLVM keeps a float one scalar.
@njit(nogil=True, boundscheck=False)
def _absmax_bits(bits, n):  # type: ignore[no-untyped-def]
    a = np.int32(0)
    for j in range(n):
        a = max(a, bits[j] & _SIGN)
    return a


@njit(nogil=True, boundscheck=False)
def _nesterov_int8(acc, divisor, m, theta, pub, out, q, scales, beta, neg_lr):  # type: ignore[no-untyped-def]
    n = acc.shape[0]
    work = np.empty(BLOCK_SIZE, dtype=np.float32)
    work_bits = work.view(np.int32)
    amax = np.empty(1, dtype=np.float32)
    amax_bits = amax.view(np.int32)
    for b in range((n + BLOCK_SIZE - 1) // BLOCK_SIZE):
        base = b * BLOCK_SIZE
        size = min(BLOCK_SIZE, n - base)
        ab = acc[base : base + size]
        mb = m[base : base + size]
        tb = theta[base : base + size]
        pb = pub[base : base + size]
        # The whole block is read before `out` is written: out may be acc's memory (the fold's
        # accumulator becomes the new θ_pub body) or θ_pub's own.
        for j in range(size):
            g = ab[j] / divisor
            mm = mb[j] * beta + g
            mb[j] = mm
            u: float = _fma(mm, beta, g)  # type: ignore[call-arg]  # stubs: (typingctx, ...)
            t = _fma(u, neg_lr, tb[j])
            tb[j] = t
            work[j] = t - pb[j]
        amax_bits[0] = _absmax_bits(work_bits, size)
        a = amax[0]
        if a >= _FTZ:
            scale = a / _QMAX
            inv = (_ONE / a) * _QMAX
        else:
            scale = _ZERO
            inv = _ZERO
        scales[b] = scale
        qb = q[base : base + size]
        ob = out[base : base + size]
        for j in range(size):
            qi = np.int8(np.int32((work[j] * inv + _ROUNDER) - _ROUNDER))
            qb[j] = qi
            ob[j] = pb[j] + _F32(qi) * scale


def _flat(t: Tensor, dtype: torch.dtype) -> np.ndarray:
    if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"fused update: want a contiguous CPU {dtype} slice, got {t.dtype}")
    return t.detach().view(-1).numpy()


def nesterov_int8_slice(
    acc: Tensor,
    divisor: float | None,
    momentum: Tensor,
    theta: Tensor,
    published: Tensor,
    out: Tensor,
    q: Tensor,
    scales: Tensor,
    *,
    beta: float,
    lr: float,
) -> None:
    """One slice (whole codec blocks from its start) of a plain round's outer step and θ_pub's
    int8 update, in place: `momentum`, `theta`, `out` (the new θ_pub; may be `acc` or
    `published` itself), `q` and `scales` (this slice's blocks) are written. `acc` is the merged
    pseudo-gradient before its division by `divisor` (None: already divided)."""
    n = acc.numel()
    if not n:
        return
    if not (theta.numel() == published.numel() == out.numel() == momentum.numel() == n):
        raise ValueError("fused update: slices of different sizes")
    if q.numel() != n or scales.numel() != -(-n // BLOCK_SIZE):
        raise ValueError("fused update: the int8 slice or its scales do not fit")
    f32 = torch.float32
    _nesterov_int8(
        _flat(acc, f32),
        _F32(1.0 if divisor is None else divisor),
        _flat(momentum, f32),
        _flat(theta, f32),
        _flat(published, f32),
        _flat(out, f32),
        _flat(q, torch.int8),
        _flat(scales, f32),
        _F32(beta),
        _F32(-lr),
    )


def warm() -> None:
    """Compile the loop now (on a tiny slice: the types a merge passes); the syncer then gives
    back the compiler's pages (syncer/merging/heap.release_compiler_pages)."""
    n = BLOCK_SIZE + 3
    x = torch.linspace(-1.0, 1.0, n)
    nesterov_int8_slice(
        x.clone(),
        2.0,
        torch.zeros(n),
        x.clone(),
        torch.zeros(n),
        torch.empty(n),
        torch.empty(n, dtype=torch.int8),
        torch.empty(2),
        beta=0.9,
        lr=0.7,
    )
