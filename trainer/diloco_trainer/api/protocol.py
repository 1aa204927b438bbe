"""The syncer's HTTP protocol, shared by the syncer (server) and the learners and tools (client).

Routes (all under the bearer token except /healthz and /readyz):

The JSON answers are typed in documents.py (JoinInfo, PushAnswer, HeartbeatAnswer,
MembershipAnswer, SyncerStatus, FragmentMerges) and client.py is the one JSON client of these
routes.

- ``POST /v1/join`` JSON {"island", "replicas"} -> {"fragments", "versions", "outerStep",
  "finished", "codec", "pullCompression", "state"}.
- ``GET /v1/fragments/{f}?after=V&wait=S[&have=H][&run=R]`` -> safetensors body of fragment f's fp32
  global weights (the published copy, see published.py), header metadata {"kind": "full",
  "version", "fragment", "outerStep", "finished"}; long-polls up to S seconds (capped at
  MAX_WAIT_SECONDS) for a version > V, then 304. A client that holds version H of the fragment
  may say so: when sync.pullCompression is not none, the syncer still keeps updates H+1..version and
  together they are smaller than the fragment, the body is that chain instead (``"kind":
  "updates"``): tensors named ``"{v}/{encoded key}"`` for each version v in H+1..version,
  metadata {"fromVersion": H, "codec", "checksum"} (of the weights at "version") besides the
  above. The client applies them in order (published.apply_updates) and checks the checksum;
  leaving out ``have`` (or have=-1) always gets the full weights. ``after`` is not the held
  version: a learner waits for the merge that carries its push, which may be newer than its base.
  ``run`` is the syncer run that accepted that push (PushAnswer.run): another run whose version is
  still at most V answers 409 ``restarted`` at once, since pending pushes are not checkpointed and
  the merge waited for can never carry it (the learner pushes it again: docs/algorithm.md).
- ``POST /v1/fragments/{f}/push`` safetensors body of ``compress.encode_tensors(Δ_f, codec)`` with
  metadata {"island", "baseVersion", "tokens", "steps", "loss", "stepTime", "codec"} and the
  optional {"syncTime", "pushId", "keptSteps"} -> {"accepted", "version", "pending", "run"}.
  keptSteps (an integer, 0 <= keptSteps <= steps, 0 when absent): of the push's steps, those
  trained before its base was installed; recorded in the merge log (each contributor's
  ``keptSteps``), counted by no rule (docs/algorithm.md, "A push's kept steps are recorded").
- ``GET /v1/fragments/{f}/merges?from=V`` -> {"fragment", "time", "stepTimes", "merges"}:
  fragment f's recent merges (its last merge_log.RECENT_OF_FRAGMENT, oldest first) of version V
  or later (from absent: all it keeps), the syncer's clock and each island's reported step time:
  what phase alignment reads after a push (learner/phase_alignment.py), a kilobyte or two
  where the status document is tens of kilobytes.
- ``POST /v1/heartbeat`` {"island", "step", "tokens", "loss", "stepTime"} and the optional
  {"holding", "drained"} (JSON booleans) and {"waiting"} (a number in [0, 1]: the share of the
  learner's wall time since its previous heartbeat spent blocked on the syncer; absent or null:
  not known) -> {"state", "finished", "versions"}.
- ``POST /v1/leave`` {"island"} -> {"island", "state"}; ``GET /v1/status[?digest=1]`` -> the
  status document; ``PUT /v1/islands/{island}`` {"state", "reason"} -> {"island", "state",
  "reason"}; ``/healthz``, ``/readyz``, ``/metrics``.

Tensors travel as safetensors bytes (never pickle). Metadata lives in the safetensors header's
``__metadata__`` (a str -> str map): strings are stored as they are, numbers and booleans as JSON.

Retries: the client (client.py) retries connection failures and 502/503/504 with exponential
backoff until a deadline, so a learner rides out a syncer restart. Pushes carry a ``pushId`` that
stays the same across retries of one call; the syncer answers a repeated id with its first answer,
so a retried push is never counted twice even when the first attempt was merged before its answer
got lost.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

API_PREFIX = "/v1"
ROUTE_JOIN = "/v1/join"
ROUTE_FRAGMENT = "/v1/fragments/{fragment}"
ROUTE_PUSH = "/v1/fragments/{fragment}/push"
ROUTE_MERGES = "/v1/fragments/{fragment}/merges"
ROUTE_HEARTBEAT = "/v1/heartbeat"
ROUTE_LEAVE = "/v1/leave"
ROUTE_STATUS = "/v1/status"
ROUTE_ISLAND = "/v1/islands/{island}"
ROUTE_HEALTHZ = "/healthz"
ROUTE_READYZ = "/readyz"
ROUTE_METRICS = "/metrics"
# Routes anyone may call (Kubernetes probes carry no token).
PUBLIC_ROUTES = frozenset({ROUTE_HEALTHZ, ROUTE_READYZ})

SAFETENSORS_CONTENT_TYPE = "application/octet-stream"
# The syncer caps a long-poll at this many seconds; clients ask for less or get 304 sooner.
MAX_WAIT_SECONDS = 60.0

# An island's membership state, as the syncer reports it (the one definition of these names):
# active (counts towards the quorum), dropped (by the admin route, until re-added), timedOut (no
# sign of life for heartbeatTimeoutSeconds), left (said goodbye, until it joins again).
IslandState = Literal["active", "dropped", "timedOut", "left"]
ISLAND_STATES: tuple[IslandState, ...] = get_args(IslandState)
STATE_ACTIVE, STATE_DROPPED, STATE_TIMED_OUT, STATE_LEFT = ISLAND_STATES
# The states the admin route accepts.
ADMIN_STATES: tuple[IslandState, ...] = (STATE_ACTIVE, STATE_DROPPED)

# Machine-readable "code" in some error bodies ({"error": message, "code": code}).
ERROR_STALE = "stale"  # 409: baseVersion older than maxStaleness allows: pull, then push again
ERROR_AHEAD = "ahead"  # 409: baseVersion newer than the syncer's (it restarted from a checkpoint)
# 409: a pull for the merge of a push that an earlier run of the syncer accepted, from a run that
# resumed at or before its base: the push was lost with that run's pending rounds; push it again.
ERROR_RESTARTED = "restarted"
ERROR_UNKNOWN_ISLAND = "unknown_island"  # 404: join first (e.g. the syncer lost its state)
ERROR_DROPPED = "dropped"  # 403: the operator dropped this island
# 422: a contribution the syncer refused to merge (syncer/intake/guards.py): each names its reason.
ERROR_NON_FINITE = "non_finite"  # decoded values overflow (e.g. an int8 scale near fp32's max)
ERROR_NORM_CAP = "norm_above_cap"  # Δ's norm above syncer.guards.maxDeltaNorm
ERROR_NORM_OUTLIER = "norm_outlier"  # Δ's norm above normFactor x the fragment's median
ERROR_STEPS_RANGE = "steps_out_of_range"  # more inner steps than one round of the island allows
ERROR_TOKENS_RANGE = "tokens_out_of_range"  # more tokens than its steps x batch x seq x replicas
# Δ moved far less per claimed step than the other island's pushes do (a job of two: guards.py)
ERROR_UNSUPPORTED_WORK = "work_unsupported"
CONTRIBUTION_REFUSALS = (
    ERROR_NON_FINITE,
    ERROR_NORM_CAP,
    ERROR_NORM_OUTLIER,
    ERROR_STEPS_RANGE,
    ERROR_TOKENS_RANGE,
    ERROR_UNSUPPORTED_WORK,
)
# A push of a known island whose body does not decode to the fragment's tensors (400: NaN, a
# wrong shape or codec). Not an error code of a body: a reason in the status document's
# `refusals`, beside CONTRIBUTION_REFUSALS.
REFUSAL_INVALID = "invalid_push"
# The reasons of the status document's `refusals` ({island: {reason: count}}): a bounded set,
# so the operator may name them in Events and metric labels.
REFUSAL_REASONS = (*CONTRIBUTION_REFUSALS, REFUSAL_INVALID)
# An island the syncer dropped itself, for syncer.guards.maxRefusals refused pushes in a row: its
# reason starts with this code and ": ". The operator re-adds islands it dropped for their pods'
# health, never these (the island keeps sending bad work; only the admin route brings it back).
DROPPED_FOR_REFUSALS = "refused_pushes"
# Joins and island names (syncer/intake/admission.py).
ERROR_NOT_JOB_ISLAND = "not_job_island"  # 403: not an island name of this job ([prefix-]island-N)
ERROR_NOT_ADMITTED = "not_admitted"  # 503: a name or replicas the job does not have (yet)
# 503 with Retry-After: the syncer is at its limit of concurrent push bodies or connections.
ERROR_BUSY = "busy"
# 408: a request's headers or body did not arrive in time (syncer.limits).
ERROR_TIMEOUT = "timeout"
# Set by the client, never sent: a success status whose body is not the documented JSON.
ERROR_MALFORMED = "malformed"

# Push metadata keys (safetensors header).
META_ISLAND = "island"
META_BASE_VERSION = "baseVersion"
META_TOKENS = "tokens"
META_STEPS = "steps"
META_LOSS = "loss"
META_STEP_TIME = "stepTime"
META_SYNC_TIME = "syncTime"
META_CODEC = "codec"
META_PUSH_ID = "pushId"
# Of a push's steps, those trained before its base was installed (kept on top of it: sync.
# lateMergeRule keep); optional, 0 when absent; recorded in merges.jsonl.
META_KEPT_STEPS = "keptSteps"
# Pull metadata keys.
META_VERSION = "version"
META_FRAGMENT = "fragment"
META_OUTER_STEP = "outerStep"
META_FINISHED = "finished"
# A pull body's seconds from its merge's start to the body (the version's mergeSeconds but the
# body's install): what sync.overlapMode auto hides. Optional: absent from older syncers.
META_MERGE_SECONDS = "mergeSeconds"
# A pull answer's header: the seconds the syncer held the request before answering (its
# long-poll wait and the body's building), so that the learner can tell the pull's own time.
HEADER_HELD_SECONDS = "X-Diloco-Held-Seconds"
META_KIND = "kind"  # KIND_FULL or KIND_UPDATES
META_FROM_VERSION = "fromVersion"  # updates: the version they start from (the client's `have`)
META_CHECKSUM = "checksum"  # updates: published.weights_checksum of the weights at `version`
KIND_FULL = "full"
KIND_UPDATES = "updates"
# An update chain's tensor names: "{version}{UPDATE_SEPARATOR}{encoded key}".
UPDATE_SEPARATOR = "/"

# The safetensors header is an 8-byte little-endian length followed by that much JSON.
_HEADER_LEN = struct.Struct("<Q")
# Larger headers are refused before JSON parsing (a real header for our models is a few KB).
MAX_HEADER_BYTES = 16 * 1024 * 1024


class SyncerError(RuntimeError):
    """The syncer refused a request (a 4xx), stayed unreachable past the retry deadline
    (`status` 0), failed (other 5xx) or answered something that is not the documented JSON
    (`code` ERROR_MALFORMED)."""

    def __init__(self, status: int, message: str, code: str = "") -> None:
        super().__init__(f"syncer answered {status}: {message}" if status else message)
        self.status = status
        self.message = message
        self.code = code  # one of the ERROR_* constants, or ""

    @property
    def unavailable(self) -> bool:
        """True when the syncer could not do it (unreachable or 5xx): trying later may work.
        False for a refusal (4xx) or a malformed answer: the same request would fail again."""
        return self.status == 0 or self.status >= 500


@dataclass(frozen=True)
class PushMeta:
    """What a push says about its pseudo-gradient.

    tokens and steps count the island's work on this fragment since it last received the
    fragment (so a later push replaces an earlier pending one without double counting).
    """

    island: str
    base_version: int
    tokens: int
    steps: int
    loss: float
    step_time: float
    codec: str
    sync_time: float = 0.0  # seconds from the last push to receiving the merged fragment
    push_id: str = ""  # filled by SyncerClient.push when empty
    # Of `steps`, those trained before the base was installed (kept on top of it): recorded by
    # the syncer (docs/algorithm.md, "A push's kept steps are recorded").
    kept_steps: int = 0

    def to_metadata(self) -> dict[str, str]:
        """The safetensors header metadata for this push."""
        return encode_metadata(
            {
                META_ISLAND: self.island,
                META_BASE_VERSION: self.base_version,
                META_TOKENS: self.tokens,
                META_STEPS: self.steps,
                META_LOSS: self.loss,
                META_STEP_TIME: self.step_time,
                META_SYNC_TIME: self.sync_time,
                META_CODEC: self.codec,
                META_PUSH_ID: self.push_id,
                META_KEPT_STEPS: self.kept_steps,
            }
        )


def dropped_for_refusals(state: str, reason: str) -> bool:
    """True for an island the syncer dropped for refused pushes (not the admin route)."""
    return state == STATE_DROPPED and reason.startswith(DROPPED_FOR_REFUSALS + ":")


def encode_metadata(values: Mapping[str, Any]) -> dict[str, str]:
    """Strings as they are; numbers and booleans as JSON (safetensors metadata is str -> str)."""
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in values.items()}


def read_metadata(body: bytes) -> dict[str, str]:
    """The ``__metadata__`` map of a safetensors body; ValueError when the header is malformed."""
    if len(body) < _HEADER_LEN.size:
        raise ValueError("body is too short to be safetensors")
    (n,) = _HEADER_LEN.unpack_from(body)
    if n > MAX_HEADER_BYTES or _HEADER_LEN.size + n > len(body):
        raise ValueError("safetensors header length is out of range")
    try:
        header = json.loads(body[_HEADER_LEN.size : _HEADER_LEN.size + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"safetensors header is not JSON: {err}") from None
    if not isinstance(header, dict):
        raise ValueError("safetensors header is not a JSON object")
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise ValueError("safetensors __metadata__ must map strings to strings")
    return meta


def meta_int(meta: Mapping[str, str], key: str) -> int:
    try:
        return int(json.loads(meta[key]))
    except (KeyError, ValueError, TypeError):
        raise ValueError(f"metadata {key!r} must be an integer") from None


def meta_bool(meta: Mapping[str, str], key: str) -> bool:
    return meta.get(key, "false") == "true"


def meta_seconds(meta: Mapping[str, str], key: str) -> float | None:
    """An optional non-negative duration; None when absent or not one (it only tunes a
    schedule, so a bad value is ignored rather than refused)."""
    try:
        value = json.loads(meta[key])
    except (KeyError, ValueError):
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) and value >= 0 else None


def error_message(body: bytes) -> tuple[str, str]:
    """(message, code) from an error body."""
    try:
        doc = json.loads(body)
        if isinstance(doc, dict) and "error" in doc:
            return str(doc["error"]), str(doc.get("code", ""))
    except (ValueError, UnicodeDecodeError):
        pass
    return body[:500].decode("utf-8", "replace"), ""
