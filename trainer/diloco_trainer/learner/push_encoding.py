"""A push's pseudo-gradient encoded for the wire where it was computed, in a handful of passes.

Encoded one tensor at a time, a gpt-125m fragment (~75 tensors) cost an H100 learner's training
thread 0.033-0.040 s per push (bench/log/2026-11-27.md, "learner_overlap in a job on an NVIDIA
H100"): about twenty kernel launches per tensor for the quantisation and error feedback's decode,
and two device synchronisations per tensor in the checks of that decode, each draining the GPU's
queue of the training steps behind it.

On a GPU, and for a small fragment on the host (ONE_PASS_FROM), the int8 codec (the default)
is encoded here as one flat buffer instead: Δ (plus the carried residual) laid out tensor after
tensor, each padded with zeros to whole codec blocks exactly as `compress._blocks` pads it
alone, so every block, scale and rounding is the one the per-tensor encoder makes (bit for bit:
tests/unit/test_learner_push_encoding.py). Then one pass each quantises it, decodes it for
error feedback and leaves the residual in place, and two copies take the int8 values and the
scales to the host without blocking (on the host: nothing to copy). No step reads a value
back, so the training thread never waits for the device. The learner's own encoding is not
checked for NaN here: the syncer refuses a push that holds one (4xx), as it refuses anybody's,
and the learner then takes the current global fragment and forgets the fragment's residuals
(fragment_sync), so one bad push does not spoil the ones after it.

Other codecs keep the per-tensor path (they are one or two casts per tensor), with error
feedback's decode unchecked for the same reason.

Memory on the device while encoding a fragment of P_f values: the flat buffer (4 P_f bytes),
which becomes error feedback's residual, one fp32 temporary (4 P_f) and the int8 values (P_f).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from diloco_trainer.core import compress
from diloco_trainer.learner.device_copies import flat_views, to_host

# A host learner's int8 push of more values than this is made in one sliced pass
# (snapshot_and_encode_int8), a smaller one over one flat buffer (encode_int8_batched), whose
# few whole-fragment ops beat the sliced pass's dozen small ones per tensor and slice there. On
# one core, error feedback on (bench.studies.host_sync_path; bench/log/2026-11-28.md, "a learner's
# training thread call by call"): 0.8 ms against 1.5 ms for gpt-tiny's 70K-value fragment, 2.5
# against 3.2 ms for gpt-mini's 0.44M, about even near 1M values, 45 against 34 ms for gpt-small's
# 5.5M and 1.97 against 0.40 s for gpt-125m's 64M.
ONE_PASS_FROM = 4 * compress.SLICE


def one_pass(weights: Mapping[str, Tensor], codec: str) -> bool:
    """Whether a push of `weights` is made by snapshot_and_encode_int8 (ONE_PASS_FROM)."""
    if codec != "int8" or not weights or next(iter(weights.values())).is_cuda:
        return False
    return sum(t.numel() for t in weights.values()) > ONE_PASS_FROM


def int8_bytes(weights: Mapping[str, Tensor]) -> int:
    """The bytes of `weights` encoded int8: a byte a value and an fp32 scale a codec block."""
    return sum(t.numel() + 4 * compress.num_blocks(t.numel()) for t in weights.values())


def encode_delta(
    delta: Mapping[str, Tensor], codec: str, feedback: compress.ErrorFeedback | None
) -> dict[str, Tensor]:
    """Encode a pseudo-gradient for the wire (CPU tensors, the copies finished): `encode_for_wire`
    and its wait."""
    encoded, ready = encode_for_wire(delta, codec, feedback)
    ready()
    return encoded


def encode_for_wire(
    delta: Mapping[str, Tensor], codec: str, feedback: compress.ErrorFeedback | None
) -> tuple[dict[str, Tensor], Callable[[], None]]:
    """Encode a pseudo-gradient for the wire, carrying the codec's error forward when asked: the
    host tensors and the wait for their copies (device_copies.to_host; call it before reading
    them). The encoding, and error feedback's decode and residual, run where Δ is (a GPU
    learner's device): only the encoded bytes are copied to the host, without blocking. int8
    over one flat buffer on a GPU and for a host fragment of at most ONE_PASS_FROM values, else
    tensor by tensor."""
    if codec == "int8" and delta and not one_pass(delta, codec):
        return encode_int8_batched(delta, feedback)  # a GPU's, or a small host fragment
    if feedback is None:
        return to_host(compress.encode_tensors(delta, codec, on=None))
    sent = {n: feedback.compensate(n, d) for n, d in delta.items()}
    encoded = compress.encode_tensors(sent, codec, on=None)
    for n, t in sent.items():
        feedback.record(n, t, compress.decode_tensor(encoded, n, codec, t.shape))
    return to_host(encoded)


def encode_int8_batched(
    delta: Mapping[str, Tensor], feedback: compress.ErrorFeedback | None
) -> tuple[dict[str, Tensor], Callable[[], None]]:
    """encode_for_wire for int8 over one flat, block-padded buffer (module docstring): what a
    GPU learner's pushes use, and a host learner's of at most ONE_PASS_FROM values. On the CPU,
    where the cost of a large fragment is the passes over memory and not the launches, the
    per-tensor path was the faster (0.70 s against 1.31 s for 42M values)."""
    names = list(delta)
    sizes = [delta[n].numel() for n in names]
    first = [0]  # each tensor's first block in the buffer
    for size in sizes:
        first.append(first[-1] + compress.num_blocks(size))
    first_block, total = first[:-1], first[-1]
    at = [b * compress.BLOCK_SIZE for b in first_block]  # and its first element
    # Zeros: the padding after each tensor is part of its last block, as compress._blocks pads.
    flat = torch.zeros(
        total * compress.BLOCK_SIZE, dtype=torch.float32, device=delta[names[0]].device
    )
    views = [flat[a : a + s] for a, s in zip(at, sizes, strict=True)]
    torch._foreach_copy_(views, [delta[n].detach().reshape(-1) for n in names])
    if feedback is not None:
        carried = [feedback.carried(n, delta[n]) for n in names]
        kept = [(v, r.reshape(-1)) for v, r in zip(views, carried, strict=True) if r is not None]
        if kept:
            torch._foreach_add_([v for v, _ in kept], [r for _, r in kept])
    rows = flat.view(total, compress.BLOCK_SIZE)
    scales, inv = compress.block_scales(rows, compress.qmax("int8"))
    work = (rows * inv[:, None]).round_()  # |values| <= 127, so int8 holds them exactly
    q = work.to(torch.int8)
    if feedback is not None:
        # Decode's own ops (int8 -> fp32, times the row's scale) into the temporary; what the
        # codec missed is left in `flat`, whose views become the residuals.
        flat.sub_(work.copy_(q).mul_(scales[:, None]).view(-1))
        for v, n in zip(views, names, strict=True):
            feedback.keep(n, v.view(delta[n].shape))
    del work
    (q_host, scales_host), ready = _pair_to_host(q.view(-1), scales)
    out: dict[str, Tensor] = {}
    for n, a, s, b in zip(names, at, sizes, first_block, strict=True):
        out[n + compress.Q_SUFFIX] = q_host[a : a + s]
        out[n + compress.SCALE_SUFFIX] = scales_host[b : b + compress.num_blocks(s)]
    return out, ready


def _pair_to_host(q: Tensor, scales: Tensor) -> tuple[tuple[Tensor, Tensor], Callable[[], None]]:
    """Both buffers on the host (two copies, not one per tensor) and the wait for them."""
    out, ready = to_host({"q": q, "scales": scales})
    return (out["q"], out["scales"]), ready


def snapshot_and_encode_int8(
    params: Mapping[str, Tensor],
    base: Mapping[str, Tensor],
    feedback: compress.ErrorFeedback | None,
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """A host learner's push in one pass over the fragment: (the fp32 copies of `params`, as
    snapshot makes them; Δ = base − those copies encoded int8, as encode_for_wire encodes it,
    error feedback's residuals kept). Bit for bit the results of snapshot, pseudo_gradient
    and encode_for_wire (tests/unit/test_learner_push_encoding.py).

    Those ran one whole-fragment pass each and made Δ and the quantisation's temporaries as
    fresh fragment-sized tensors: about 0.5 s of a one-core learner's training thread per
    64M-value gpt-125m fragment, much of it first touches of new pages. Here each slice of
    whole codec blocks (compress.SLICE) is copied, subtracted and quantised while it is in
    cache, through two slice-sized buffers, so the only fragment-sized writes are the copies
    (needed: the receipt of this push's merge keeps the steps since it,
    mixing.received_weights) and the int8 values."""
    _, local = flat_views(params, torch.device("cpu"))
    return local, _encode_int8_sliced(params, local, base, feedback)


def snapshot_for_push(
    params: Mapping[str, Tensor], into: Mapping[str, Tensor] | None = None
) -> dict[str, Tensor]:
    """fp32 host copies of `params` in one buffer (as snapshot_and_encode_int8 makes them),
    copied a slice at a time: all a deferred push (encode_int8_from_snapshot) takes of the
    training thread. `into`: an earlier push's copies (FragmentState.spare), written over when
    they have the same names and shapes (fp32 host tensors), else a new buffer is made: pages
    already the process's take only the copy, a new buffer's take their faults and zeroing too."""
    if into is not None and _same_layout(into, params):
        local = dict(into)
    else:
        _, local = flat_views(params, torch.device("cpu"))
    for n, p in params.items():
        src, mine = p.detach().reshape(-1), local[n].view(-1)
        for sl in compress.slices(p.numel()):
            mine[sl].copy_(src[sl])
    return local


def _same_layout(into: Mapping[str, Tensor], params: Mapping[str, Tensor]) -> bool:
    """Whether `into` holds fp32 host tensors of exactly `params`' names and shapes."""
    return list(into) == list(params) and all(
        into[n].shape == p.shape and into[n].dtype == torch.float32 and into[n].device.type == "cpu"
        for n, p in params.items()
    )


def encode_int8_from_snapshot(
    local: Mapping[str, Tensor],
    base: Mapping[str, Tensor],
    feedback: compress.ErrorFeedback | None,
) -> dict[str, Tensor]:
    """Δ = base − `local` (snapshot_for_push's copies) encoded int8 in one sliced pass, error
    feedback's residuals kept: the encoded half of snapshot_and_encode_int8, bit for bit, with
    no copy. A host learner runs it on its syncer link's thread (FragmentState.encode_push's
    deferred push), beside the inner steps."""
    return _encode_int8_sliced(local, None, base, feedback)


def _encode_int8_sliced(
    params: Mapping[str, Tensor],
    local: Mapping[str, Tensor] | None,
    base: Mapping[str, Tensor],
    feedback: compress.ErrorFeedback | None,
) -> dict[str, Tensor]:
    """The sliced pass of snapshot_and_encode_int8: each slice of `params` copied into `local`
    (None: `params` are copies already, read as they are), Δ = base − it, quantised."""
    work = torch.empty(compress.SLICE)
    scaled = torch.empty(compress.SLICE)
    out: dict[str, Tensor] = {}
    for n, p in params.items():
        size = p.numel()
        src, ref = p.detach().reshape(-1), base[n].reshape(-1)
        mine = local[n].view(-1) if local is not None else src
        carried = feedback.carried(n, p) if feedback is not None else None
        residual = torch.empty(size) if feedback is not None else None
        q = torch.empty(size, dtype=torch.int8)
        scales = torch.empty(compress.num_blocks(size))
        for sl in compress.slices(size):
            m = sl.stop - sl.start
            nb = compress.num_blocks(m)
            if local is not None:
                mine[sl].copy_(src[sl])
            w = work[: nb * compress.BLOCK_SIZE]
            torch.sub(ref[sl], mine[sl], out=w[:m])  # Δ (pseudo_gradient's op)
            if carried is not None:
                w[:m].add_(carried.view(-1)[sl])  # ErrorFeedback.compensate's Δ + residual
            w[m:].zero_()  # a short last slice: compress._blocks pads it with zeros
            rows = w.view(nb, compress.BLOCK_SIZE)
            s, inv = compress.block_scales(rows, compress.qmax("int8"))
            v = scaled[: nb * compress.BLOCK_SIZE]
            torch.mul(rows, inv[:, None], out=v.view(nb, compress.BLOCK_SIZE)).round_()
            q[sl].copy_(v[:m])  # exact: |v| <= 127, whole numbers
            first = sl.start // compress.BLOCK_SIZE
            scales[first : first + nb] = s
            if residual is not None:
                # What the syncer will decode (compress._dequantise's ops), and what it missed.
                v[:m].copy_(q[sl])
                v.view(nb, compress.BLOCK_SIZE).mul_(s[:, None])
                torch.sub(w[:m], v[:m], out=residual[sl])
        out[n + compress.Q_SUFFIX] = q
        out[n + compress.SCALE_SUFFIX] = scales
        if feedback is not None and residual is not None:
            feedback.keep(n, residual.view(p.shape))
    return out
