"""Tensor bodies on the wire: safetensors bytes of fragments, pushes and update chains.

The header metadata and every constant live in `diloco_trainer.api.protocol` (torch-free); this
module adds what needs torch. Tensors travel as safetensors bytes, never pickle.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import safetensors.torch
import torch

from diloco_trainer.api.protocol import UPDATE_SEPARATOR, encode_metadata, read_metadata


@dataclass(frozen=True)
class PullCost:
    """What a pull tells of the sync's latency (learner/overlap.sync_latency): the syncer's
    mergeSeconds for the version (None: it did not say), the body's bytes, the pull's own
    seconds without the syncer's long-poll wait (None: not known), and the learner's seconds
    rebuilding weights from an update chain."""

    merge_seconds: float | None = None
    body_bytes: int = 0
    pull_seconds: float | None = None
    rebuild_seconds: float = 0.0


@dataclass(frozen=True)
class PulledFragment:
    """A fragment's fp32 global weights at `version`."""

    fragment: int
    version: int
    outer_step: int
    finished: bool
    tensors: dict[str, torch.Tensor] = field(repr=False)
    cost: PullCost = PullCost()


@dataclass(frozen=True)
class PulledUpdates:
    """A fragment's encoded weight updates from_version+1..version (apply them in order to the
    weights at from_version, then compare `checksum`)."""

    fragment: int
    version: int
    from_version: int
    outer_step: int
    finished: bool
    codec: str
    checksum: str
    updates: list[dict[str, torch.Tensor]] = field(repr=False)
    cost: PullCost = PullCost()

    @property
    def nbytes(self) -> int:
        """Payload bytes of every update."""
        return sum(t.numel() * t.element_size() for u in self.updates for t in u.values())


def encode_update_chain(
    updates: list[tuple[int, Mapping[str, torch.Tensor]]], metadata: Mapping[str, Any]
) -> bytes:
    """Safetensors bytes of encoded updates [(version, encoded tensors)], named by version."""
    tensors = {
        f"{version}{UPDATE_SEPARATOR}{key}": t.detach().contiguous()
        for version, encoded in updates
        for key, t in encoded.items()
    }
    return safetensors.torch.save(tensors, metadata=encode_metadata(metadata))


def encode_update_chain_buffer(
    updates: list[tuple[int, Mapping[str, torch.Tensor]]], metadata: Mapping[str, Any]
) -> memoryview:
    """encode_update_chain's bytes, written as encode_body_buffer writes (no interpreter lock
    held for the copy)."""
    tensors = {
        f"{version}{UPDATE_SEPARATOR}{key}": t
        for version, encoded in updates
        for key, t in encoded.items()
    }
    return encode_body_buffer(tensors, metadata)


def split_update_chain(
    tensors: Mapping[str, torch.Tensor], from_version: int, version: int
) -> list[dict[str, torch.Tensor]]:
    """The per-version encoded dicts of a chain, in order; ValueError unless it holds exactly the
    versions from_version+1..version."""
    by_version: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        head, sep, key = name.partition(UPDATE_SEPARATOR)
        if not sep or not head.isdigit() or not key:
            raise ValueError(f"update chain tensor {name!r} is not named 'VERSION/KEY'")
        by_version.setdefault(int(head), {})[key] = t
    want = list(range(from_version + 1, version + 1))
    if sorted(by_version) != want or not want:
        raise ValueError(
            f"update chain holds versions {sorted(by_version)}, expected {want[:1]}..{want[-1:]}"
        )
    return [by_version[v] for v in want]


def encode_body(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, Any]) -> bytes:
    """Serialise tensors and metadata as safetensors bytes.

    Tensors are made contiguous and given their own storage where they lack it, because
    safetensors refuses views and tensors that share memory (tied weights); a tensor that is the
    whole of its own storage is serialised as it is (no copy of a P-sized body first).
    """
    own: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in tensors.items():
        t = t.detach()
        storage = t.untyped_storage()
        whole = (
            t.is_contiguous()
            and t.storage_offset() == 0
            and storage.nbytes() == t.numel() * t.element_size()
            and storage.data_ptr() not in seen
        )
        own[name] = t if whole else t.contiguous().clone()
        seen.add(storage.data_ptr())
    return safetensors.torch.save(own, metadata=encode_metadata(metadata))


# safetensors' names of the dtypes a body may hold.
_DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


@dataclass(frozen=True)
class BodyLayout:
    """Where a safetensors body puts each tensor: its prefix (the 8-byte length and the JSON
    header, padded with spaces to 8 bytes), then each tensor's bytes at its offset after it,
    in `order` (by dtype size, then name: safetensors' own layout)."""

    prefix: bytes
    order: list[str]
    offsets: dict[str, tuple[int, int]]
    data_bytes: int


def body_layout(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, Any]) -> BodyLayout:
    """The layout safetensors gives these tensors and metadata; ValueError for a dtype it has
    no name for."""
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    # safetensors leaves __metadata__ out when there is none
    header: dict[str, Any] = {"__metadata__": dict(encode_metadata(metadata))} if metadata else {}
    offsets: dict[str, tuple[int, int]] = {}
    offset = 0
    for name in order:
        t = tensors[name]
        if t.dtype not in _DTYPE_NAMES:
            raise ValueError(f"tensor {name!r} has dtype {t.dtype}, which a body cannot hold")
        size = t.numel() * t.element_size()
        offsets[name] = (offset, offset + size)
        header[name] = {
            "dtype": _DTYPE_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return BodyLayout(len(text).to_bytes(8, "little") + text, order, offsets, offset)


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's values as contiguous bytes (a view when it is contiguous already)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def encode_body_buffer(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, Any]
) -> memoryview:
    """The bytes encode_body gives, written by torch into memory torch allocated, which releases
    the interpreter lock throughout (safetensors' serialiser holds it for the whole P-sized
    copy, and even a bytearray is zero-filled under it, so a pull body built in a worker thread
    still stalled the event loop): the same layout (body_layout), as a read-only view."""
    layout = body_layout(tensors, metadata)
    start = len(layout.prefix)
    out = torch.empty(start + layout.data_bytes, dtype=torch.uint8)
    out[:start].copy_(torch.frombuffer(bytearray(layout.prefix), dtype=torch.uint8))
    for name in layout.order:
        begin, end = layout.offsets[name]
        if end > begin:
            out[start + begin : start + end].copy_(tensor_bytes(tensors[name]))
    return out.numpy().data.toreadonly()


@dataclass(frozen=True)
class SplitBody:
    """A safetensors body served in parts, its prefix (length and JSON header, with the
    metadata) and its data (the tensors' bytes, in one or more pieces), one after the other:
    the data may be memory that other code reads as tensors (the syncer's published weights,
    body_data; an update's own encoded tensors, update_body), so a new prefix (a new outer
    step) needs no copy of it. bytes() gives the body whole."""

    prefix: bytes
    parts: tuple[memoryview, ...] = field(repr=False)

    def __len__(self) -> int:
        return len(self.prefix) + sum(part.nbytes for part in self.parts)

    def __bytes__(self) -> bytes:
        return self.prefix + b"".join(part.tobytes() for part in self.parts)


def body_data(template: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A new buffer laid out as the data part of a body of tensors like `template` (their
    names, dtypes and shapes; body_layout), and one tensor per name viewing its place in it:
    what is written through the views is the body's data (split_body serves it as it is)."""
    layout = body_layout(template, {})
    data = torch.empty(layout.data_bytes, dtype=torch.uint8)
    views = {}
    for name in layout.order:
        begin, end = layout.offsets[name]
        t = template[name]
        views[name] = data[begin:end].view(t.dtype).view(t.shape)
    return data, views


def split_body(
    data: torch.Tensor, template: Mapping[str, torch.Tensor], metadata: Mapping[str, Any]
) -> SplitBody:
    """The body of `data` (laid out by body_data for `template`) with this metadata, without a
    copy of the data: the caller must not write it while the body is served."""
    prefix = body_layout(template, metadata).prefix
    return SplitBody(prefix, (data.numpy().data.toreadonly(),))


def update_body(
    version: int, encoded: Mapping[str, torch.Tensor], metadata: Mapping[str, Any]
) -> SplitBody:
    """The update chain of one update, as encode_update_chain_buffer gives it byte for byte,
    served from the update's own encoded tensors (contiguous: the codecs make them so) after
    a prefix, in body_layout's order: no copy of them. The caller must not write them while
    the body is served."""
    tensors = {f"{version}{UPDATE_SEPARATOR}{key}": t for key, t in encoded.items()}
    layout = body_layout(tensors, metadata)
    parts = tuple(
        tensor_bytes(tensors[name]).numpy().data.toreadonly()
        for name in layout.order
        if tensors[name].numel()
    )
    return SplitBody(layout.prefix, parts)


_DTYPES_BY_NAME = {name: dtype for dtype, name in _DTYPE_NAMES.items()}


def _entry(name: str, entry: Any, data_bytes: int) -> tuple[torch.dtype, list[int], int, int]:
    """A header entry's dtype, shape and [begin, end), checked; ValueError naming the tensor."""
    if not isinstance(entry, dict) or entry.get("dtype") not in _DTYPES_BY_NAME:
        raise ValueError(f"tensor {name!r}: no dtype a body may hold")
    dtype = _DTYPES_BY_NAME[entry["dtype"]]
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise ValueError(f"tensor {name!r}: shape must be a list of sizes")
    if not (
        isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
    ):
        raise ValueError(f"tensor {name!r}: data_offsets must be two integers")
    begin, end = offsets
    numel = 1
    for d in shape:
        numel *= d
    if not 0 <= begin <= end <= data_bytes or end - begin != numel * dtype.itemsize:
        raise ValueError(f"tensor {name!r}: data_offsets {offsets} do not fit its shape")
    return dtype, shape, begin, end


def tensors_in_body(body: bytearray | memoryview) -> dict[str, torch.Tensor]:
    """A safetensors body's tensors as views of its own memory (no copy: safetensors' load
    copies every tensor out of it), checked as safetensors checks them: known dtypes, offsets
    that fit each shape and tile the data exactly. The tensors keep `body` alive and see any
    change to it. ValueError for anything malformed."""
    view = memoryview(body).cast("B")
    if len(view) < 8:
        raise ValueError("body is too short to be safetensors")
    n = int.from_bytes(view[:8], "little")
    if 8 + n > len(view):
        raise ValueError("safetensors header length is out of range")
    try:
        header = json.loads(bytes(view[8 : 8 + n]))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"safetensors header is not JSON: {err}") from None
    if not isinstance(header, dict):
        raise ValueError("safetensors header is not a JSON object")
    start, data_bytes = 8 + n, len(view) - 8 - n
    entries = {k: _entry(k, v, data_bytes) for k, v in header.items() if k != "__metadata__"}
    covered = 0
    for _, _, begin, end in sorted(entries.values(), key=lambda e: (e[2], e[3])):
        if begin != covered:
            raise ValueError("safetensors data offsets leave a gap or overlap")
        covered = end
    if covered != data_bytes:
        raise ValueError("safetensors data offsets do not cover the body's data")
    out = {}
    for name, (dtype, shape, begin, end) in entries.items():
        if end == begin:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        flat = torch.frombuffer(
            body, dtype=dtype, count=(end - begin) // dtype.itemsize, offset=start + begin
        )
        out[name] = flat.view(shape)
    return out


def decode_body_unlocked(body: bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """decode_body's tensors and metadata, the tensors views of one copy of `body` that torch
    makes with the interpreter lock released. safetensors' load copies each tensor out under
    the lock: 22 ms at a stretch for a gpt-125m fragment's int8 update, which a GPU learner's
    training thread, waiting for the lock to launch its next kernels, spent idle."""
    meta = read_metadata(body)
    with warnings.catch_warnings():
        # `body` is only read, by the clone: torch warns that it cannot write to bytes.
        warnings.simplefilter("ignore", UserWarning)
        source = torch.frombuffer(body, dtype=torch.uint8)
    return tensors_in_body(source.clone().numpy().data), meta


def decode_body(
    body: bytes | bytearray | memoryview | SplitBody,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Parse a safetensors body into (tensors, metadata); ValueError for anything malformed."""
    if not isinstance(body, bytes):  # a body the syncer built (encode_body_buffer, SplitBody)
        body = bytes(body)
    meta = read_metadata(body)
    try:
        tensors = safetensors.torch.load(body)
    except Exception as err:  # the Rust parser raises its own error types
        raise ValueError(f"body is not valid safetensors: {err}") from None
    return tensors, meta
