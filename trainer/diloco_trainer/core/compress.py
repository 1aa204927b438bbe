"""Codecs for pseudo-gradients on the wire, and optional error feedback.

Every codec turns a dict of fp32 tensors into a flat dict that safetensors can store, and back into
fp32. The integer codecs quantise symmetrically per block of BLOCK_SIZE consecutive elements (of
the flattened tensor) with one fp32 absmax scale per block:

    scale = max|x| / QMAX,   q = round(x / scale) in [-QMAX, QMAX],   x' = q * scale

so each element's error is at most scale / 2. int8 uses QMAX = 127 (-128 is never produced, so
the grid is symmetric); int4 uses QMAX = 7 and packs two values per uint8 (element 2i in the low
nibble, 2i+1 in the high nibble, each stored as q + 8). Keys: "NAME" for none/fp16/bf16;
"NAME::q" (int8 (n,) or uint8 (ceil(n/2),)) and "NAME::scale" (fp32 (ceil(n/BLOCK_SIZE),)) for
int8/int4. fp32 scales cost 4/BLOCK_SIZE bytes per element (3%), and unlike fp16 scales they
cannot underflow for the tiny pseudo-gradients of late training; so int8 sends 3.88x and int4
7.53x fewer bytes than fp32. Blocks whose absmax is below FLUSH_TO_ZERO are sent as zeros.
Decoding always yields fp32, so merges accumulate in fp32 whatever the wire format.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from torch import Tensor

CODECS = ("none", "fp16", "bf16", "int8", "int4")
BLOCK_SIZE = 128
FLUSH_TO_ZERO = 1e-30  # blocks whose absmax is smaller are sent as zeros
_QMAX = {"int8": 127, "int4": 7}
# Elements per slice when the syncer streams a P-sized step (core/outer.py, core/published.py):
# whole codec blocks, so a slice encodes exactly as its part of the whole tensor does, and small
# enough (1 MiB of fp32) that its temporaries stay in cache (L2/L3) and come from the heap instead
# of fresh pages, large enough that the dozen small per-block ops of each slice cost little
# beside its element-wise passes (256 KiB slices spent a third of θ_pub's update on them); each
# torch op on a slice releases the interpreter lock.
SLICE = 2048 * BLOCK_SIZE


def slices(n: int, size: int = SLICE) -> list[slice]:
    """[0, n) in consecutive slices of `size` elements (the last one shorter)."""
    return [slice(start, min(n, start + size)) for start in range(0, n, size)]


_FLOAT_DTYPES = {"none": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
Q_SUFFIX = "::q"
SCALE_SUFFIX = "::scale"


def _check_codec(codec: str) -> None:
    if codec not in CODECS:
        raise ValueError(f"sync.compression {codec!r} is unknown; choose one of {list(CODECS)}")


def _shape(shape: torch.Size | tuple[int, ...]) -> str:
    return str(tuple(shape))


def num_blocks(n: int) -> int:
    """Codec blocks (and scales) of a tensor of n elements."""
    return -(-n // BLOCK_SIZE)


def _blocks(x: Tensor) -> Tensor:
    """A flat tensor as (num_blocks, BLOCK_SIZE) rows, zero-padded only when needed."""
    n = x.numel()
    nb = num_blocks(n)
    if n == nb * BLOCK_SIZE:
        return x.view(nb, BLOCK_SIZE)  # no copy: the common case for weight matrices
    padded = x.new_zeros(nb * BLOCK_SIZE)
    padded[:n] = x
    return padded.view(nb, BLOCK_SIZE)


def _quantise(x: Tensor, qmax: int) -> tuple[Tensor, Tensor]:
    """Per-block symmetric quantisation of a flat fp32 tensor: (q int8 (n,), scales fp32 (nb,))."""
    blocks = _blocks(x)  # (nb, BLOCK_SIZE)
    scales, inv = block_scales(blocks, qmax)
    # |x * inv| <= qmax up to one rounding, so round() stays in [-qmax, qmax] without a clamp.
    q = (blocks * inv[:, None]).round_().to(torch.int8)
    return q.view(-1)[: x.numel()], scales


def block_scales(blocks: Tensor, qmax: int) -> tuple[Tensor, Tensor]:
    """Each row's scale and its reciprocal's stand-in, (nb,) each: scale = max|row| / qmax and
    inv = qmax / max|row|, both 0 for a row below FLUSH_TO_ZERO (the one rule of every encoder:
    _quantise and core/published.UpdateWriter's slices)."""
    # max(amax, -amin) is |x|'s row maximum without materialising |x|; NaN propagates into the
    # scale, which decode then refuses.
    absmax = torch.maximum(blocks.amax(dim=1), blocks.amin(dim=1).neg_())  # (nb,)
    # Blocks below FLUSH_TO_ZERO (all-zero blocks, denormals whose reciprocal would overflow)
    # are sent as zeros with scale 0.
    live = absmax >= FLUSH_TO_ZERO
    zeros = torch.zeros_like(absmax)
    return torch.where(live, absmax / qmax, zeros), torch.where(live, qmax / absmax, zeros)


def qmax(codec: str) -> int:
    """The largest quantised magnitude of an integer codec (int8: 127, int4: 7)."""
    return _QMAX[codec]


def _dequantise(q: Tensor, scales: Tensor, n: int) -> Tensor:
    """int8 (n,) and fp32 scales (nb,) -> fp32 (n,)."""
    out = _blocks(q).to(torch.float32).mul_(scales[:, None])  # (nb, BLOCK_SIZE)
    return out.view(-1)[:n]


def _pack_int4(q: Tensor) -> Tensor:
    """int8 values in [-7, 7], shape (n,) -> uint8 (ceil(n/2),), two nibbles per byte."""
    u = (q + 8).to(torch.uint8)
    if u.numel() % 2:
        u = torch.cat([u, u.new_full((1,), 8)])  # pad with an encoded zero
    pairs = u.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def _unpack_int4(packed: Tensor, n: int) -> Tensor:
    """uint8 (ceil(n/2),) -> int8 (n,) in [-8, 7]."""
    low = (packed & 0x0F).to(torch.int8) - 8
    high = (packed >> 4).to(torch.int8) - 8
    return torch.stack([low, high], dim=1).view(-1)[:n]


def _all_finite(t: Tensor) -> bool:
    # min and max propagate NaN and reach ±Inf: one pass, no temporary the size of t.
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


def encode_tensors(
    tensors: Mapping[str, Tensor], codec: str, *, on: str | torch.device | None = "cpu"
) -> dict[str, Tensor]:
    """Encode fp32 tensors for the wire: a flat, contiguous, safetensors-ready dict.

    on: where the encoding runs and the result stays: the CPU (the wire's side) by default, or
    None for each tensor's own device, so a learner on a GPU quantises there and only the
    encoded bytes (a quarter of fp32's for int8) cross to the host.
    """
    _check_codec(codec)
    out: dict[str, Tensor] = {}
    for name, t in tensors.items():
        if Q_SUFFIX in name or SCALE_SUFFIX in name:
            raise ValueError(f"tensor name {name!r} may not contain '::'")
        x = t.detach().to(torch.float32) if on is None else t.detach().to(on, torch.float32)
        if codec in _FLOAT_DTYPES:
            # Always a fresh tensor: the caller may reuse its buffer while the push is in flight,
            # and safetensors refuses tensors that share memory (e.g. views of a flat buffer).
            y = x.to(_FLOAT_DTYPES[codec])
            out[name] = y.clone() if y.data_ptr() == t.data_ptr() else y.contiguous()
            continue
        q, scales = _quantise(x.reshape(-1), _QMAX[codec])
        out[name + Q_SUFFIX] = (_pack_int4(q) if codec == "int4" else q).contiguous()
        out[name + SCALE_SUFFIX] = scales.contiguous()
    return out


def expected_encoded(
    expected: Mapping[str, torch.Size], codec: str
) -> dict[str, tuple[torch.dtype, torch.Size]]:
    """Key -> (dtype, shape) that encode_tensors produces for tensors of these shapes."""
    _check_codec(codec)
    spec: dict[str, tuple[torch.dtype, torch.Size]] = {}
    for name, shape in expected.items():
        shape = torch.Size(shape)
        if codec in _FLOAT_DTYPES:
            spec[name] = (_FLOAT_DTYPES[codec], shape)
            continue
        n = shape.numel()
        qn = -(-n // 2) if codec == "int4" else n
        qdtype = torch.uint8 if codec == "int4" else torch.int8
        spec[name + Q_SUFFIX] = (qdtype, torch.Size([qn]))
        spec[name + SCALE_SUFFIX] = (torch.float32, torch.Size([num_blocks(n)]))
    return spec


def _names_message(kind: str, names: set[str]) -> str:
    shown = sorted(names)
    more = f" (and {len(shown) - 5} more)" if len(shown) > 5 else ""
    return f"{kind}: {', '.join(repr(n) for n in shown[:5])}{more}"


def decode_tensors(
    flat: Mapping[str, Tensor], codec: str, expected: Mapping[str, torch.Size]
) -> dict[str, Tensor]:
    """Validate an encoded dict against the model's shapes and decode it to fp32.

    Raises ValueError naming the offending key when names are missing or unexpected, or a tensor
    has the wrong shape or dtype, or holds NaN/Inf (or, for int8, the unused value -128).
    """
    check_encoded(flat, codec, expected)
    return {name: decode_tensor(flat, name, codec, shape) for name, shape in expected.items()}


def check_encoded(
    flat: Mapping[str, Tensor], codec: str, expected: Mapping[str, torch.Size]
) -> None:
    """decode_tensors' checks without decoding: ValueError naming the offending key (see
    there)."""
    want = expected_encoded(expected, codec)
    missing = set(want) - set(flat)
    extra = set(flat) - set(want)
    if missing or extra:
        parts = []
        if missing:
            parts.append(_names_message("missing", missing))
        if extra:
            parts.append(_names_message("unexpected", extra))
        raise ValueError(
            f"pseudo-gradient names do not match the model ({codec}): " + "; ".join(parts)
        )
    for key, (dtype, shape) in want.items():
        t = flat[key]
        if t.shape != shape:
            raise ValueError(
                f"pseudo-gradient {key!r} has shape {_shape(t.shape)} but the model expects "
                f"{_shape(shape)}"
            )
        if t.dtype != dtype:
            raise ValueError(
                f"pseudo-gradient {key!r} has dtype {t.dtype} but codec {codec} needs {dtype}"
            )
        if t.is_floating_point() and t.numel() and not _all_finite(t):
            raise ValueError(f"pseudo-gradient {key!r} contains NaN or Inf")
        if codec == "int8" and key.endswith(Q_SUFFIX) and t.numel() and int(t.min()) < -127:
            raise ValueError(f"pseudo-gradient {key!r} contains -128 (int8 range is [-127, 127])")


def decode_tensor(
    flat: Mapping[str, Tensor], name: str, codec: str, shape: torch.Size | tuple[int, ...]
) -> Tensor:
    """One tensor of an encoded dict that decode_tensors checked, decoded to fp32 (the syncer
    keeps pushes encoded and decodes a tensor at a time when it must read one again)."""
    shape = torch.Size(shape)
    if codec in _FLOAT_DTYPES:
        # No copy for fp32: the result may share memory with `flat` (a freshly loaded body).
        return flat[name].to(torch.float32).reshape(shape)
    n = shape.numel()
    q = flat[name + Q_SUFFIX]
    if codec == "int4":
        q = _unpack_int4(q, n)
    return _dequantise(q, flat[name + SCALE_SUFFIX], n).view(shape)


def decoded_slices(
    flat: Mapping[str, Tensor],
    name: str,
    codec: str,
    shape: torch.Size | tuple[int, ...],
    work: Tensor | None = None,
) -> Iterator[tuple[slice, Tensor]]:
    """One tensor of a checked encoded dict decoded a slice (of whole blocks) at a time, as
    (slice of the flattened tensor, its fp32 values): decode_tensor's values bit for bit, with
    no fp32 copy of the whole tensor. The integer codecs decode into one buffer (`work`, or
    one made here), so a slice's values are good until the next one is asked for."""
    n = torch.Size(shape).numel()
    if codec in _FLOAT_DTYPES:
        src = flat[name].reshape(-1)
        for sl in slices(n):
            yield sl, src[sl].to(torch.float32)  # codec none: a view, no copy
        return
    q = flat[name + Q_SUFFIX].reshape(-1)
    if codec == "int4":
        q = _unpack_int4(q, n)  # int8, a quarter of the fp32 bytes
    scales = flat[name + SCALE_SUFFIX]
    need = min(num_blocks(n) * BLOCK_SIZE, SLICE)
    if work is None or work.numel() < need:
        work = torch.empty(need)
    for sl in slices(n):
        m = sl.stop - sl.start
        nb = num_blocks(m)
        w = work[: nb * BLOCK_SIZE]
        w[:m].copy_(q[sl])  # int8 -> fp32, then times each block's scale (_dequantise's ops)
        if m < nb * BLOCK_SIZE:
            w[m:].zero_()
        first = sl.start // BLOCK_SIZE
        w.view(nb, BLOCK_SIZE).mul_(scales[first : first + nb, None])
        yield sl, w[:m]


def wire_bytes_per_value(codec: str) -> float:
    """Bytes a codec puts on the wire per value, its fp32 scales counted (one per BLOCK_SIZE
    values): none 4, fp16 and bf16 2, int8 1 + 4/128, int4 1/2 + 4/128."""
    _check_codec(codec)
    if codec in _FLOAT_DTYPES:
        return float(torch.finfo(_FLOAT_DTYPES[codec]).bits // 8)
    return (0.5 if codec == "int4" else 1.0) + 4.0 / BLOCK_SIZE


def encoded_nbytes(flat: Mapping[str, Tensor]) -> int:
    """Payload bytes of an encoded dict (tensor data only, without container headers)."""
    return sum(t.numel() * t.element_size() for t in flat.values())


class ErrorFeedback:
    """Per-name quantisation residuals carried into the next push (error feedback).

    Usage per push: `sent = ef.compensate(name, delta)`; encode `sent`; decode it the way the
    syncer will; `ef.record(name, sent, decoded)`. What the codec dropped this time is added back
    next time, so over many rounds nothing is lost for good.
    """

    def __init__(self) -> None:
        self.residuals: dict[str, Tensor] = {}

    def compensate(self, name: str, delta: Tensor) -> Tensor:
        """delta plus the residual left from the previous push of this name (fp32, new tensor)."""
        residual = self.carried(name, delta)
        delta = delta.detach().to(torch.float32)
        if residual is None:
            return delta.clone()
        return delta + residual

    def carried(self, name: str, delta: Tensor) -> Tensor | None:
        """The residual to add to this push of `name` (on delta's device), None when there is
        none; ValueError when its shape is not delta's."""
        residual = self.residuals.get(name)
        if residual is None:
            return None
        if residual.shape != delta.shape:
            raise ValueError(
                f"error feedback for {name!r}: shape {_shape(delta.shape)} differs from the "
                f"stored residual {_shape(residual.shape)}"
            )
        return residual.to(delta.device)

    def keep(self, name: str, residual: Tensor) -> None:
        """Store a residual computed elsewhere (learner/push_encoding's batched int8 path)."""
        self.residuals[name] = residual

    def record(self, name: str, sent: Tensor, decoded: Tensor) -> None:
        """Store what the codec lost: the compensated delta minus what the syncer will decode."""
        # Kept where the pushes are computed (a learner's GPU): compensate adds it there.
        sent = sent.detach().to(torch.float32)
        self.residuals[name] = (sent - decoded.detach().to(sent.device, torch.float32)).contiguous()

    def reset(self, names: list[str] | None = None) -> None:
        """Forget residuals (all, or the given names), e.g. after a rejoin."""
        if names is None:
            self.residuals.clear()
        for name in names or []:
            self.residuals.pop(name, None)

    def state_tensors(self) -> dict[str, Tensor]:
        """Residuals by name, for a safetensors checkpoint."""
        return dict(self.residuals)

    def load_state_tensors(self, state: Mapping[str, Tensor]) -> None:
        """Restore residuals saved by state_tensors()."""
        self.residuals = {k: v.to(torch.float32).contiguous() for k, v in state.items()}
