"""Compressed pulls: the published copy of the global weights and the updates between its versions.

The syncer keeps two copies of the global weights. θ_exact is what the outer optimizer steps.
θ_pub is what learners hold: after a merge of fragment f the syncer encodes the difference

    u = θ_exact_f − θ_pub_f,    q = encode(u, sync.pullCompression),    θ_pub_f += decode(q)

and keeps q as "update v" (v the fragment's new version). What the codec dropped stays in
θ_exact − θ_pub and is part of the next u, so nothing is lost for good (error feedback without a
separate residual). A learner holding θ_pub at version V rebuilds version W from updates
V+1..W with the very float ops the syncer used (each tensor decoded, then one fp32 add per
update), so it holds θ_pub bit for bit, and checks that against the syncer's checksum of θ_pub at
W.

Checksum: CRC-32 of every tensor's bytes in name order. Unlike a float sum it does not depend
on reduction order or thread count and it notices any changed, swapped or shifted value. It
guards against bugs and mixed-up bases (a learner from before a syncer restart), not against an
attacker: the channel is authenticated already. It is computed by ISA-L (the `isal` package:
zlib's CRC-32, the same polynomial and values, folded with carry-less multiplies): 7.4 GB/s on
this project's CPU machine against 3.0 GB/s for the zlib Python links, where a merge's checksum
of θ_pub was a sixth of the path from its last push to pullable (bench/log/2026-11-26.md, "the merge
path's passes, tried one at a time"). It releases the interpreter lock as zlib's does.
"""

from __future__ import annotations

import builtins  # UpdateWriter.slice shadows the type's name in the class
import math
import mmap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from isal.isal_zlib import crc32
from torch import Tensor

from diloco_trainer.core.compress import (
    BLOCK_SIZE,
    Q_SUFFIX,
    SCALE_SUFFIX,
    SLICE,
    block_scales,
    check_encoded,
    decode_tensor,
    decoded_slices,
    encode_tensors,
    encoded_nbytes,
    expected_encoded,
    qmax,
    slices,
)

CHECKSUM_PREFIX = "crc32:"


def weights_checksum(tensors: Mapping[str, Tensor]) -> str:
    """CRC-32 over the tensors' names, dtypes, shapes and bytes, in sorted name order."""
    crc = 0
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        crc = crc32(_checksum_header(name, t), crc)
        if t.numel():
            crc = crc32(t.reshape(-1).view(torch.uint8).numpy().data, crc)
    return f"{CHECKSUM_PREFIX}{crc:08x}"


def _checksum_header(name: str, t: Tensor) -> bytes:
    """What weights_checksum hashes of a tensor before its bytes."""
    return f"{name}|{t.dtype}|{tuple(t.shape)}|".encode()


class StreamedChecksum:
    """weights_checksum of tensors whose bytes are final a slice at a time, hashed as each slice
    is written (still in cache) instead of in a pass of their own after: the same value when
    the slices come in sorted name order, each tensor's from its start to its end, as the outer
    step gives them (a pass over a gpt-125m fragment's θ_pub took 34 ms of the merge's path to
    pullable). Anything else (another order, a tensor that is not contiguous) turns it off, and
    `value` is then None: the caller hashes the tensors whole."""

    def __init__(self, tensors: Mapping[str, Tensor]) -> None:
        self.tensors = tensors
        self.order = sorted(tensors)
        self.crc, self.at, self.pos = 0, 0, 0  # CRC so far, the name it is in, its next byte
        self.on = all(t.is_contiguous() and t.device.type == "cpu" for t in tensors.values())
        self._skip_empty()

    def _skip_empty(self) -> None:
        """Hash the headers of the empty tensors next in order (they have no slices)."""
        while (
            self.on and self.at < len(self.order) and not self.tensors[self.order[self.at]].numel()
        ):
            name = self.order[self.at]
            self.crc = crc32(_checksum_header(name, self.tensors[name]), self.crc)
            self.at += 1

    def add(self, name: str, sl: slice) -> None:
        """Elements `sl` of `name` (flattened) are final."""
        if not self.on:
            return
        if self.at >= len(self.order) or name != self.order[self.at] or sl.start != self.pos:
            self.on = False
            return
        t = self.tensors[name]
        if self.pos == 0:
            self.crc = crc32(_checksum_header(name, t), self.crc)
        self.crc = crc32(t.view(-1)[sl].view(torch.uint8).numpy().data, self.crc)
        self.pos = sl.stop
        if self.pos == t.numel():
            self.at, self.pos = self.at + 1, 0
            self._skip_empty()

    @property
    def value(self) -> str | None:
        """The checksum, when every tensor was hashed in order; None otherwise."""
        if not self.on or self.at != len(self.order):
            return None
        return f"{CHECKSUM_PREFIX}{self.crc:08x}"


# Each tensor's offset in populated_tensors' buffer is a multiple of this (fp32 scales after int8
# values of any length; a cache line, so no two tensors share one).
_ALIGN = 64


def populated_tensors(
    spec: Mapping[str, tuple[torch.dtype, torch.Size]],
) -> dict[str, Tensor]:
    """Uninitialised tensors of these dtypes and shapes, views of one buffer whose pages are in
    memory already: an update is written into fresh memory at every merge, and one
    mmap(MAP_POPULATE) faults its pages in at once where the merge's first writes took one
    fault a page (0.08-0.10 s against 0.13-0.19 s for 177 MB, gpt-350m's fragment, on this
    project's CPU machine). Its memory goes back to the system when the last view goes. Plain
    torch.empty where the platform has no MAP_POPULATE."""
    offsets, end = {}, 0
    for key, (dtype, shape) in spec.items():
        offsets[key] = end
        end += -(-shape.numel() * dtype.itemsize // _ALIGN) * _ALIGN
    if not end or not hasattr(mmap, "MAP_POPULATE"):
        return {key: torch.empty(shape, dtype=dtype) for key, (dtype, shape) in spec.items()}
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE
    data = torch.frombuffer(mmap.mmap(-1, end, flags=flags), dtype=torch.uint8)
    return {
        key: data[offsets[key] : offsets[key] + shape.numel() * dtype.itemsize]
        .view(dtype)
        .view(shape)
        for key, (dtype, shape) in spec.items()
    }


@dataclass(frozen=True)
class WeightUpdate:
    """Update `version` of one fragment: θ_pub(version) = θ_pub(version − 1) + decode(encoded)."""

    version: int
    encoded: dict[str, Tensor] = field(repr=False)
    nbytes: int  # payload bytes of `encoded`
    checksum: str  # of θ_pub at `version`


class UpdateWriter:
    """θ_pub's update written a slice at a time (compress.slices: whole codec blocks, so each
    slice encodes exactly as its part of the tensor does): `slice(name, sl)` once θ_exact's
    slice is final, for every slice of every name, then `finish()`. The outer step calls it
    after each of its slices, so θ_exact's slice is read while it is still in cache."""

    def __init__(
        self,
        exact: Mapping[str, Tensor],
        published: Mapping[str, Tensor],
        names: Sequence[str],
        codec: str,
        version: int,
        out: Mapping[str, Tensor] | None = None,
    ) -> None:
        """`out`: where the new θ_pub of `names` goes (θ_pub's own tensors, in place, when
        None): the syncer writes it into a new body's memory while the old one is served."""
        self.exact, self.published, self.names = exact, published, list(names)
        self.out = published if out is None else out
        self.codec, self.version = codec, version
        shapes = {n: published[n].shape for n in self.names}
        self.encoded = populated_tensors(expected_encoded(shapes, codec))
        self._work: Tensor | None = None  # a slice's fp32 buffer, reused (int8)
        self._checksum = StreamedChecksum({n: self.out[n] for n in self.names})

    def slice(self, name: str, sl: slice) -> None:
        """Encode u = θ_exact − θ_pub on one slice of `name`, and θ_pub's slice += decode(q)."""
        self._slice(name, sl)
        self.written(name, sl)

    def int8_targets(self, name: str, sl: builtins.slice) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """For a writer of int8 slices of its own (the syncer's fused merge,
        core/fused_update.py): θ_pub's slice, the new θ_pub's slice, and the update's int8
        values and block scales of the slice; then written(name, sl)."""
        if self.codec != "int8":
            raise ValueError(f"int8 targets of a {self.codec} update")
        first = sl.start // BLOCK_SIZE
        nb = -(-(sl.stop - sl.start) // BLOCK_SIZE)
        return (
            self.published[name].view(-1)[sl],
            self.out[name].view(-1)[sl],
            self.encoded[name + Q_SUFFIX].view(-1)[sl],
            self.encoded[name + SCALE_SUFFIX].view(-1)[first : first + nb],
        )

    def written(self, name: str, sl: builtins.slice) -> None:
        """The new θ_pub's slice of `name` is final (slices in order: its checksum reads it)."""
        self._checksum.add(name, sl)

    def _slice(self, name: str, sl: builtins.slice) -> None:
        if self.codec == "int8":
            self._slice_int8(name, sl)
            return
        pub = self.published[name].view(-1)[sl]
        one = encode_tensors({name: self.exact[name].reshape(-1)[sl] - pub}, self.codec)
        # the same fp32 add as the learner's in-place one, bit for bit
        torch.add(
            pub, decode_tensor(one, name, self.codec, pub.shape), out=self.out[name].view(-1)[sl]
        )
        for key, part in one.items():
            target = self.encoded[key].view(-1)
            if key.endswith(SCALE_SUFFIX):  # one scale per block
                start = sl.start // BLOCK_SIZE
            elif key.endswith(Q_SUFFIX) and self.codec == "int4":  # two values a byte
                start = sl.start // 2
            else:
                start = sl.start
            target[start : start + part.numel()].copy_(part.reshape(-1))

    def _slice_int8(self, name: str, sl: builtins.slice) -> None:
        """slice() for int8 in one reused slice buffer and the update's own tensors: the same
        float ops as encode_tensors then decode_tensor (compress._quantise, _dequantise), so the
        same bytes and θ_pub bit for bit, with no temporary but a slice's (fewer passes: the
        quantised values are written straight into the update, and decoded from there)."""
        pub = self.published[name].view(-1)[sl]
        n = pub.numel()
        if not n:
            return
        nb = -(-n // BLOCK_SIZE)
        if self._work is None or self._work.numel() < nb * BLOCK_SIZE:
            self._work = torch.empty(max(SLICE, nb * BLOCK_SIZE), dtype=torch.float32)
        work = self._work[: nb * BLOCK_SIZE]
        if n < nb * BLOCK_SIZE:
            work[n:].zero_()  # the last block's padding, as compress._blocks pads
        torch.sub(self.exact[name].reshape(-1)[sl], pub, out=work[:n])
        blocks = work.view(nb, BLOCK_SIZE)
        scales, inv = block_scales(blocks, qmax("int8"))
        blocks.mul_(inv[:, None]).round_()
        q = self.encoded[name + Q_SUFFIX].view(-1)[sl]
        q.copy_(work[:n])  # whole numbers in [-127, 127]: the int8 cast is exact
        first = sl.start // BLOCK_SIZE
        self.encoded[name + SCALE_SUFFIX].view(-1)[first : first + nb].copy_(scales)
        # decode: int8 -> fp32, times the block's scale (compress._dequantise's ops)
        work[:n].copy_(q)
        blocks.mul_(scales[:, None])
        # the same fp32 add as the learner's in-place one, bit for bit
        torch.add(pub, work[:n], out=self.out[name].view(-1)[sl])

    def finish(self) -> WeightUpdate:
        """The update, once every slice of every name was written."""
        return WeightUpdate(
            version=self.version,
            encoded=self.encoded,
            nbytes=encoded_nbytes(self.encoded),
            checksum=self._checksum.value or weights_checksum({n: self.out[n] for n in self.names}),
        )


def publish_update(
    exact: Mapping[str, Tensor],
    published: Mapping[str, Tensor],
    names: Sequence[str],
    codec: str,
    version: int,
    out: Mapping[str, Tensor] | None = None,
) -> WeightUpdate:
    """Move the published tensors `names` towards the exact ones by one encoded update (in place,
    or into `out`).

    The update is encoded from u = exact − published and decoded exactly as a learner decodes
    it, so published + decode(q) here equals the learner's result bit for bit. A slice at a
    time (UpdateWriter): the difference and its decoded form are a slice's size, not the
    fragment's, and the codecs give the same bytes as on whole tensors.
    """
    writer = UpdateWriter(exact, published, names, codec, version, out)
    with torch.no_grad():
        for n in writer.names:
            for sl in slices(published[n].numel()):
                writer.slice(n, sl)
    return writer.finish()


def apply_updates(
    base: Mapping[str, Tensor], updates: Sequence[Mapping[str, Tensor]], codec: str
) -> dict[str, Tensor]:
    """θ_pub after the given encoded updates, in order, from `base` (never modified).

    ValueError when an update does not match the base's names, shapes or the codec.
    """
    check_updates({n: t.shape for n, t in base.items()}, updates, codec)
    out = {n: t.detach().to(torch.float32).clone() for n, t in base.items()}
    add_updates(out, updates, codec)
    return out


def check_updates(
    shapes: Mapping[str, torch.Size], updates: Sequence[Mapping[str, Tensor]], codec: str
) -> None:
    """apply_updates' checks of each encoded update against the held weights' shapes, alone:
    ValueError naming the key (compress.check_encoded). A GPU learner runs them on the host
    copy of an update before it crosses to the device."""
    for encoded in updates:
        check_encoded(encoded, codec, shapes)


# Tensors of more values than this are decoded and added a slice at a time on the host. On one
# core a 38.6M-value embedding's decoded copy cost more in fresh pages (0.31 s against 0.19 s for
# a fragment holding one), while gpt-125m's fragments, 64M values in tensors of at most 2.4M,
# took as long either way (0.08-0.26 s, bench.studies.host_sync_path): the allocator reuses memory
# of that size.
SLICED_ADD = 16 * SLICE


def add_updates(
    out: Mapping[str, Tensor], updates: Sequence[Mapping[str, Tensor]], codec: str
) -> None:
    """Add checked encoded updates, in order, to the fp32 tensors `out` in place: the float ops
    of apply_updates (each tensor decoded, then added), so the result is the same bit for bit
    on any device."""
    work = None
    for encoded in updates:
        for n, t in out.items():
            if t.device.type != "cpu" or not t.is_contiguous() or t.numel() <= SLICED_ADD:
                t.add_(decode_tensor(encoded, n, codec, t.shape))
                continue
            # A large tensor on the host: a slice at a time (decoded_slices: the same values),
            # without a decoded fp32 copy of it (bench/studies/host_sync_path.py).
            if work is None:
                work = torch.empty(SLICE)
            flat = t.view(-1)
            for sl, values in decoded_slices(encoded, n, codec, t.shape, work):
                flat[sl].add_(values)


def checksum_after_updates(
    base: Mapping[str, Tensor], updates: Sequence[Mapping[str, Tensor]], codec: str
) -> str:
    """weights_checksum(apply_updates(base, updates, codec)), without that copy: each tensor's
    result is made a slice at a time (compress.SLICE) in one buffer, hashed and let go, and
    `base` (fp32, contiguous, on the host) is only read. The same float ops on each element as
    add_updates (base, then each update's decoded value added in order), so the same bytes
    and the same checksum. A learner checks a pulled chain with it before it adds the chain
    into the weights it holds, in place (learner/syncer_link.py): what fails the check never
    wrote them. The updates must be checked already (check_updates)."""
    crc = 0
    work = torch.empty(0)
    # The integer codecs' decoded slices, one buffer an update (decoded_slices).
    decode_work = [torch.empty(SLICE) for _ in updates]
    for name in sorted(base):
        t = base[name]
        if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"tensor {name!r}: not a contiguous fp32 host tensor")
        crc = crc32(_checksum_header(name, t), crc)
        n = t.numel()
        if not n:
            continue
        if work.numel() < min(n, SLICE):
            work = torch.empty(min(n, SLICE))
        flat = t.view(-1)
        streams = [
            decoded_slices(u, name, codec, t.shape, w)
            for u, w in zip(updates, decode_work, strict=True)
        ]
        for sl in slices(n):
            w = work[: sl.stop - sl.start]
            w.copy_(flat[sl])
            for stream in streams:
                _, values = next(stream)
                w.add_(values)
            crc = crc32(w.view(torch.uint8).numpy().data, crc)
    return f"{CHECKSUM_PREFIX}{crc:08x}"


def history_length(full_bytes: int, update_bytes: int, max_staleness: int) -> int:
    """How many updates of a fragment the syncer keeps (at least 1).

    A learner pushes on the version it holds, V; a push lagging by more than sync.maxStaleness is
    refused, so the merge that carries an accepted push yields at most V + maxStaleness + 1, and
    the chain such a learner needs is at most maxStaleness + 1 long (at least 2, for a learner
    whose pull comes one merge late). Longer chains are never sent because a chain is sent only
    when it is smaller than the full fragment: keeping more than that many updates (3 for int8,
    7 for int4, 1 for fp16/bf16) would only cost memory.
    """
    wanted = max(2, max_staleness + 1)
    useful = math.ceil(full_bytes / update_bytes) - 1 if update_bytes > 0 else wanted
    return max(1, min(wanted, useful))
