"""Validation of what clients send the syncer: typed fields, island names, and a push from its
body and metadata to the round's Contribution. Each check raises Refused(400) naming the bad
field, before any state is touched. Numbers are bounded too (MAX_WIRE_INT: what JSON and int64
carry exactly), so a self-reported count can never overflow what it is copied into."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import safetensors.torch
import torch

from diloco_trainer.api import protocol
from diloco_trainer.api.credentials import Principal
from diloco_trainer.core import payloads
from diloco_trainer.core.compress import check_encoded, expected_encoded
from diloco_trainer.syncer.errors import Refused
from diloco_trainer.syncer.intake.guards import DeltaStats, delta_stats
from diloco_trainer.syncer.intake.payload import EncodedPayload
from diloco_trainer.syncer.intake.rights import require_push
from diloco_trainer.syncer.state import Contribution

ISLAND_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,251}[A-Za-z0-9])?$")
# The largest count a client may report: 2**53 - 1 (exact in JSON numbers, within int64).
MAX_WIRE_INT = 2**53 - 1
# The longest step or sync time a client may report (a day).
MAX_SECONDS = 86400.0
# A claimed step time may be at most this many heartbeat timeouts (sync.heartbeatTimeoutSeconds:
# 600 s at its default of 30 s), and a day at most (step_time_limit): a longer claim is no step
# a learner of the job takes, only a lever on the work-rate bounds.
STEP_TIME_HEARTBEATS = 20.0
# The largest |loss| a client may report (a heartbeat's, a push's): a language model's
# cross-entropy is tens at most, a diverged one's beyond this is not finite in practice; a
# larger finite value (1e308) only overflows what is computed from it (status, means).
MAX_LOSS = 1e9
# The most replicas an island may have (islands.replicas' bound).
MAX_REPLICAS = 1024


def typed_field(
    doc: dict[str, Any], key: str, where: str, kind: type, *, required: bool = True
) -> Any:
    """doc[key] as `kind` (an int is taken for a float; a bool is no int); None when absent and
    not required."""
    if key not in doc or doc[key] is None:
        if required:
            raise Refused(400, f"{where}.{key} is required")
        return None
    value = doc[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            value = float(value)
        except OverflowError:  # a JSON integer beyond a float (10^400): was a 500 (audit46)
            raise Refused(
                400, f"{where}.{key} must be a finite number, got an integer beyond a float"
            ) from None
    if (kind is int and isinstance(value, bool)) or not isinstance(value, kind):
        raise Refused(400, f"{where}.{key} must be {kind.__name__}, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise Refused(400, f"{where}.{key} must be a finite number, got {value}")
    return value


def at_least(value: float | None, minimum: float, where: str, key: str) -> None:
    """Refused(400) when a present value is below `minimum`."""
    if value is not None and value < minimum:
        raise Refused(400, f"{where}.{key} must be >= {minimum}, got {value}")


def at_most(value: float | None, maximum: float, where: str, key: str) -> None:
    """Refused(400) when a present value is above `maximum`."""
    if value is not None and value > maximum:
        shown = (
            str(value)
            if len(str(value)) <= 24
            else f"{str(value)[:12]}... ({len(str(value))} digits)"
        )
        raise Refused(400, f"{where}.{key} must be <= {maximum:g}, got {shown}")


def step_time_limit(heartbeat_timeout: float) -> float:
    """The longest step time a client may claim (seconds): STEP_TIME_HEARTBEATS heartbeat
    timeouts of the job, at most MAX_SECONDS."""
    return min(MAX_SECONDS, STEP_TIME_HEARTBEATS * heartbeat_timeout)


def bounded_loss(value: float | None, where: str) -> None:
    """Refused(400) when a present loss is beyond ±MAX_LOSS."""
    if value is not None and abs(value) > MAX_LOSS:
        raise Refused(400, f"{where}.loss must be within ±{MAX_LOSS:g}, got {value:.4g}")


def island_name(value: Any, where: str) -> str:
    """The island name, when it is a DNS-label-like name of 1-253 characters."""
    if not isinstance(value, str) or not ISLAND_NAME.match(value):
        raise Refused(
            400,
            f"{where}.island must be 1-253 letters, digits, '-', '_' or '.', starting and ending "
            f"with a letter or digit; got {value!r}",
        )
    return value


def parse_push_meta(
    meta: dict[str, str], codec: str, max_step_time: float = MAX_SECONDS
) -> protocol.PushMeta:
    """Validate a push's safetensors metadata; Refused(400) naming the field. A step time above
    `max_step_time` (step_time_limit) is refused."""
    doc: dict[str, Any] = {}
    for key, raw in meta.items():
        if (
            key == protocol.META_ISLAND
            or key == protocol.META_CODEC
            or key == protocol.META_PUSH_ID
        ):
            doc[key] = raw
            continue
        try:
            if json_too_deep(raw):
                raise ValueError("nested too deep")
            doc[key] = json.loads(raw)
        except (ValueError, RecursionError):
            raise Refused(400, f"metadata.{key} is not a JSON value: {raw[:50]!r}") from None
    where = "metadata"
    island = island_name(doc.get(protocol.META_ISLAND), where)
    base = typed_field(doc, protocol.META_BASE_VERSION, where, int)
    tokens = typed_field(doc, protocol.META_TOKENS, where, int)
    steps = typed_field(doc, protocol.META_STEPS, where, int)
    loss = typed_field(doc, protocol.META_LOSS, where, float, required=False)
    step_time = typed_field(doc, protocol.META_STEP_TIME, where, float, required=False)
    sync_time = typed_field(doc, protocol.META_SYNC_TIME, where, float, required=False)
    kept = typed_field(doc, protocol.META_KEPT_STEPS, where, int, required=False)
    at_least(base, 0, where, protocol.META_BASE_VERSION)
    at_least(tokens, 1, where, protocol.META_TOKENS)
    at_least(steps, 1, where, protocol.META_STEPS)
    at_least(step_time, 0, where, protocol.META_STEP_TIME)
    at_least(sync_time, 0, where, protocol.META_SYNC_TIME)
    at_least(kept, 0, where, protocol.META_KEPT_STEPS)
    # The island's own word, only recorded: bounded by the steps the push carries (all of them
    # kept at most), so the merge log never says more were kept than pushed.
    if kept is not None and steps is not None and kept > steps:
        raise Refused(
            400,
            f"{where}.{protocol.META_KEPT_STEPS} must be <= {where}.{protocol.META_STEPS} "
            f"({steps}), got {kept}",
        )
    for key, value in (
        (protocol.META_BASE_VERSION, base),
        (protocol.META_TOKENS, tokens),
        (protocol.META_STEPS, steps),
    ):
        at_most(value, MAX_WIRE_INT, where, key)
    at_most(step_time, min(MAX_SECONDS, max_step_time), where, protocol.META_STEP_TIME)
    at_most(sync_time, MAX_SECONDS, where, protocol.META_SYNC_TIME)
    bounded_loss(loss, where)
    got_codec = doc.get(protocol.META_CODEC, "")
    if got_codec != codec:
        raise Refused(
            400, f"metadata.codec {got_codec!r} does not match the job's sync.compression {codec!r}"
        )
    push_id = doc.get(protocol.META_PUSH_ID, "")
    if len(push_id) > 128:
        raise Refused(400, "metadata.pushId is longer than 128 characters")
    return protocol.PushMeta(
        island=island,
        base_version=base,
        tokens=tokens,
        steps=steps,
        loss=loss if loss is not None else float("nan"),
        step_time=step_time or 0.0,
        codec=codec,
        sync_time=sync_time or 0.0,
        push_id=push_id,
        kept_steps=kept or 0,
    )


def read_push_header(body: bytes | bytearray) -> dict[str, str]:
    """A push body's safetensors metadata, as strings (the one time it is read: who pushes is
    checked on it, then parse_push_meta types it)."""
    n = int.from_bytes(body[:8], "little") if len(body) >= 8 else 0
    # Only the header is copied (read_metadata reads bytes): its length is checked there.
    head = bytes(body[: 8 + min(n, protocol.MAX_HEADER_BYTES + 1)])
    try:
        return protocol.read_metadata(head)
    except ValueError as err:
        raise Refused(400, f"push body: {err}") from None
    except RecursionError:  # a header nested deeper than the JSON parser goes
        raise Refused(400, "push body: safetensors header is nested too deep") from None


def read_push_tensors(body: bytes | bytearray) -> dict[str, torch.Tensor]:
    """A push body's (still encoded) tensors (its header was read by read_push_header): views of
    the body itself when it is the buffer the HTTP edge read it into (no copy of it), else
    safetensors' copies."""
    try:
        if isinstance(body, bytearray):
            return payloads.tensors_in_body(body)
        return safetensors.torch.load(body)
    except Exception as err:  # the Rust parser raises its own error types
        raise Refused(400, f"push body: body is not valid safetensors: {err}") from None


@dataclass(frozen=True)
class IncomingPush:
    """A push's body as read: its typed metadata, its still-encoded tensors and its size."""

    meta: protocol.PushMeta
    flat: dict[str, torch.Tensor]
    size: int


def read_push(
    body: bytes | bytearray,
    principal: Principal,
    codec: str,
    max_step_time: float = MAX_SECONDS,
) -> IncomingPush:
    """A push's body read in order: the safetensors header once, the credential allowed to push
    as the island it names (rights.require_push), the metadata parsed into typed, bounded
    fields, the encoded tensors taken (P-sized: a worker thread calls this). Refused (400, 403),
    with nothing changed, at the first problem."""
    raw_meta = read_push_header(body)
    require_push(principal, raw_meta)
    meta = parse_push_meta(raw_meta, codec, max_step_time)
    return IncomingPush(meta=meta, flat=read_push_tensors(body), size=len(body))


def measure_push(fragment: int, payload: EncodedPayload) -> DeltaStats:
    """The checks of a push kept encoded (names, shapes, encodings against the fragment), and its
    stats for the guards, decoded a slice at a time (a worker thread): no decoded copy of it (the
    fold reads it the same way)."""
    try:
        check_encoded(payload.flat, payload.codec, payload.expected)
    except ValueError as err:
        raise Refused(400, f"push to fragment {fragment}: {err}") from None
    return delta_stats(payload)


def push_contribution(
    meta: protocol.PushMeta, *, lag: int, payload: Mapping[str, torch.Tensor], now: float
) -> Contribution:
    """A validated push as a round contribution."""
    return Contribution(
        island=meta.island,
        base_version=meta.base_version,
        lag=lag,
        tokens=meta.tokens,
        steps=meta.steps,
        loss=meta.loss if math.isfinite(meta.loss) else None,
        received_at=now,
        push_id=meta.push_id,
        payload=payload,
        step_time=meta.step_time or None,
        sync_time=meta.sync_time or None,
        kept_steps=meta.kept_steps,
    )


# Deepest JSON nesting accepted in a request body or a push's metadata values.
MAX_JSON_DEPTH = 32


def json_too_deep(raw: bytes | str, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether JSON text nests arrays/objects deeper than `limit` (strings are skipped; the text
    need not be valid JSON: the parser judges that afterwards)."""
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    depth, in_string, escaped = 0, False, False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > limit:
                return True
        elif ch in "]}":
            depth -= 1
    return False


# Push size limit: exact encoded payload, plus 5%, plus header room (per-tensor JSON entries and
# metadata). Anything larger cannot be a valid push for this fragment.
BODY_SLACK_RATIO = 1.05


BODY_SLACK_BYTES = 64 * 1024


HEADER_BYTES_PER_KEY = 256


def fragment_body_limit(expected: dict[str, torch.Size], codec: str) -> int:
    """The largest push body accepted for a fragment with these tensors under `codec`."""
    spec = expected_encoded(expected, codec)
    payload = sum(shape.numel() * dtype.itemsize for dtype, shape in spec.values())
    header = HEADER_BYTES_PER_KEY * len(spec) + BODY_SLACK_BYTES
    return int(payload * BODY_SLACK_RATIO) + header
