"""The syncer: a CPU service that merges islands' pseudo-gradients into the global model.

It holds the fp32 global weights, split into fragments by bytes, and the outer optimizer. Each
fragment runs rounds (rounds.py): pushes are validated against the model, collected per island
(a newer push from an island replaces its pending one), and merged once a quorum has reported and
the grace window has passed (or every active island has reported): token-weighted merge
(merge.py) times a staleness factor, then an outer Nesterov step on that fragment, version + 1,
and long-polling pullers wake up. Every merge is logged (status and state_dir/merges.jsonl) with
its contributors, their lags and normalised weights, so it can be reproduced.

Concurrency: HTTP handlers run on one asyncio loop; heavy work (decoding a push, merging, the
outer step, evaluation, serialising fragments, checkpoints, digests) runs in worker threads. One
asyncio lock makes every state change atomic: merges, evaluations and checkpoints hold it, so a
push waits for them; decoding a push does not hold it. A request that fails validation changes
nothing: size, safetensors, metadata, membership/staleness and tensor names/shapes/dtypes are all
checked before the state is touched.

Evaluation runs at start, every syncer.evalEveryOuterSteps outer steps and at the finish. When
stopAfter is reached, the syncer evaluates, writes a checkpoint, and reports finished=true; it
keeps serving status and pulls afterwards.

Shutdown (SIGTERM/SIGINT): the server stops accepting requests and exits; it does NOT write a
checkpoint. What a crash or a stop can lose is what happened since the last checkpoint (at most
syncer.checkpoint.everyOuterSteps outer steps): islands that pushed into the lost rounds notice
the syncer's older versions on their next pull or join and continue from them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import logging
import math
import re
import ssl
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch
from aiohttp import web

from diloco_trainer import checkpoint as ckpt
from diloco_trainer import wire
from diloco_trainer.compress import decode_tensors, expected_encoded
from diloco_trainer.config import ConfigError, JobSpec, load_spec
from diloco_trainer.contract import ContractError, SyncerEnv
from diloco_trainer.fragments import split_fragments
from diloco_trainer.merge import contribution_weight, merge_pseudo_gradients, staleness_factor
from diloco_trainer.outer import OuterOptimizer
from diloco_trainer.parts import build_parts, evaluate
from diloco_trainer.rounds import Contribution, Refused, RoundPolicy, SyncState
from diloco_trainer.syncer_metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from diloco_trainer.syncer_metrics import SyncerMetrics

log = logging.getLogger("diloco.syncer")

MERGE_LOG_FILE = "merges.jsonl"
RECENT_MERGES = 20
# Push size limit: exact encoded payload, plus 5%, plus header room (per-tensor JSON entries and
# metadata). Anything larger cannot be a valid push for this fragment.
BODY_SLACK_RATIO = 1.05
BODY_SLACK_BYTES = 64 * 1024
HEADER_BYTES_PER_KEY = 256
# Largest JSON body accepted on the small routes (join, heartbeat, leave, membership).
JSON_LIMIT = 64 * 1024
# The merge scheduler re-checks timeouts at least this often.
TICK_SECONDS = 0.5
ISLAND_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,251}[A-Za-z0-9])?$")


def fragment_body_limit(expected: dict[str, torch.Size], codec: str) -> int:
    """The largest push body accepted for a fragment with these tensors under `codec`."""
    spec = expected_encoded(expected, codec)
    payload = sum(shape.numel() * dtype.itemsize for dtype, shape in spec.values())
    header = HEADER_BYTES_PER_KEY * len(spec) + BODY_SLACK_BYTES
    return int(payload * BODY_SLACK_RATIO) + header


# ----- request validation (pure) -------------------------------------------------------------


def _typed(doc: dict[str, Any], key: str, where: str, kind: type, *, required: bool = True) -> Any:
    if key not in doc or doc[key] is None:
        if required:
            raise Refused(400, f"{where}.{key} is required")
        return None
    value = doc[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if (kind is int and isinstance(value, bool)) or not isinstance(value, kind):
        raise Refused(400, f"{where}.{key} must be {kind.__name__}, got {type(value).__name__}")
    if kind is float and not math.isfinite(value):
        raise Refused(400, f"{where}.{key} must be a finite number, got {value}")
    return value


def _at_least(value: float | None, minimum: float, where: str, key: str) -> None:
    if value is not None and value < minimum:
        raise Refused(400, f"{where}.{key} must be >= {minimum}, got {value}")


def _island_name(value: Any, where: str) -> str:
    if not isinstance(value, str) or not ISLAND_NAME.match(value):
        raise Refused(
            400,
            f"{where}.island must be 1-253 letters, digits, '-', '_' or '.', starting and ending "
            f"with a letter or digit; got {value!r}",
        )
    return value


def parse_push_meta(meta: dict[str, str], codec: str) -> wire.PushMeta:
    """Validate a push's safetensors metadata; Refused(400) naming the field."""
    doc: dict[str, Any] = {}
    for key, raw in meta.items():
        if key == wire.META_ISLAND or key == wire.META_CODEC or key == wire.META_PUSH_ID:
            doc[key] = raw
            continue
        try:
            doc[key] = json.loads(raw)
        except ValueError:
            raise Refused(400, f"metadata.{key} is not a JSON value: {raw[:50]!r}") from None
    where = "metadata"
    island = _island_name(doc.get(wire.META_ISLAND), where)
    base = _typed(doc, wire.META_BASE_VERSION, where, int)
    tokens = _typed(doc, wire.META_TOKENS, where, int)
    steps = _typed(doc, wire.META_STEPS, where, int)
    loss = _typed(doc, wire.META_LOSS, where, float, required=False)
    step_time = _typed(doc, wire.META_STEP_TIME, where, float, required=False)
    sync_time = _typed(doc, wire.META_SYNC_TIME, where, float, required=False)
    _at_least(base, 0, where, wire.META_BASE_VERSION)
    _at_least(tokens, 1, where, wire.META_TOKENS)
    _at_least(steps, 1, where, wire.META_STEPS)
    _at_least(step_time, 0, where, wire.META_STEP_TIME)
    _at_least(sync_time, 0, where, wire.META_SYNC_TIME)
    got_codec = doc.get(wire.META_CODEC, "")
    if got_codec != codec:
        raise Refused(
            400, f"metadata.codec {got_codec!r} does not match the job's sync.compression {codec!r}"
        )
    push_id = doc.get(wire.META_PUSH_ID, "")
    if len(push_id) > 128:
        raise Refused(400, "metadata.pushId is longer than 128 characters")
    return wire.PushMeta(
        island=island,
        base_version=base,
        tokens=tokens,
        steps=steps,
        loss=loss if loss is not None else float("nan"),
        step_time=step_time or 0.0,
        codec=codec,
        sync_time=sync_time or 0.0,
        push_id=push_id,
    )


# ----- the engine ------------------------------------------------------------------------------


class Syncer:
    """Global weights, outer optimizer, rounds and membership of one job."""

    def __init__(
        self,
        spec: JobSpec,
        *,
        job_name: str,
        state_dir: Path,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.spec = spec
        self.job_name = job_name
        self.state_dir = state_dir
        self.clock = clock
        self.codec = spec.sync.compression
        self.rule = spec.sync.merge
        self.metrics = SyncerMetrics()
        self.parts = build_parts(
            spec, shard_index=0, num_shards=spec.total_shards(), with_train=False
        )
        model = self.parts.model.float().cpu()
        model.requires_grad_(False)
        self.weights: dict[str, torch.Tensor] = dict(model.named_parameters())
        self.fragments = split_fragments(
            {n: t.numel() * t.element_size() for n, t in self.weights.items()},
            spec.sync.fragments,
        )
        self.expected = [{n: self.weights[n].shape for n in names} for names in self.fragments]
        self.body_limits = [fragment_body_limit(e, self.codec) for e in self.expected]
        self.outer = OuterOptimizer(
            self.weights,
            lr=spec.outer.lr,
            momentum=spec.outer.momentum,
            nesterov=spec.outer.nesterov,
        )
        grace = spec.sync.grace_seconds
        self.state = SyncState(
            RoundPolicy(
                quorum=spec.sync.quorum,
                max_staleness=spec.sync.max_staleness,
                heartbeat_timeout=spec.sync.heartbeat_timeout_seconds,
                grace_seconds=None if grace == "auto" else float(grace),
                overlap_steps=spec.sync.overlap_steps,
            ),
            len(self.fragments),
        )
        self.merged_tokens = [0.0] * len(self.fragments)
        self.eval_history: list[dict[str, Any]] = []
        self.initial_eval_loss: float | None = None
        self.loss: float | None = None
        self.merges: deque[dict[str, Any]] = deque(maxlen=RECENT_MERGES)
        self.merge_count = 0
        self.finished = False
        self.last_merge_time: float | None = None
        self.bytes_in = 0
        self.bytes_out = 0
        self.last_eval_step = -1
        self.last_checkpoint_step = -1
        self.resumed_from: str | None = None
        self._spec_hash = ckpt.spec_hash(spec.to_json())
        # Created on the serving loop (start()).
        self.lock: asyncio.Lock | None = None
        self._poke: asyncio.Event | None = None
        self._published: list[asyncio.Event] = []
        self._bodies: list[tuple[tuple[int, int, bool], bytes]] = []
        self._resume_or_init()

    # ----- start-up ----------------------------------------------------------------------------

    def _resume_or_init(self) -> None:
        loaded = ckpt.load_latest(self.state_dir)
        if loaded is None:
            loss = evaluate(self.parts)
            self.initial_eval_loss = loss
            self._record_eval(loss)
            # The initial state is a pure function of the spec: nothing to checkpoint yet.
            self.last_checkpoint_step = 0
            log.info("fresh start: initial eval loss %.4f", loss)
        else:
            self._restore(loaded)
        self.finished = self._stop_reached()
        self.metrics.outer_step.set(self.state.outer_step)

    def _restore(self, loaded: ckpt.Checkpoint) -> None:
        m = loaded.manifest
        if m.get("fragments") != self.fragments:
            raise ConfigError(
                f"checkpoint {loaded.path} splits the model into different fragments than "
                f"sync.fragments={len(self.fragments)} does now; use a fresh state dir"
            )
        missing = set(self.weights) ^ set(loaded.weights)
        if missing:
            raise ConfigError(
                f"checkpoint {loaded.path} holds other tensors than the model "
                f"(differences: {sorted(missing)[:5]}); was model.preset changed?"
            )
        for name, t in loaded.weights.items():
            if t.shape != self.weights[name].shape:
                raise ConfigError(
                    f"checkpoint {loaded.path}: {name} has shape {tuple(t.shape)}, the model "
                    f"{tuple(self.weights[name].shape)}"
                )
        if m.get("specHash") != self._spec_hash:
            log.warning("the job spec changed since checkpoint %s; resuming anyway", loaded.path)
        with torch.no_grad():
            for name, t in loaded.weights.items():
                self.weights[name].copy_(t)
        self.outer.load_state_tensors(loaded.momentum)
        self.state = SyncState(self.state.policy, len(self.fragments), versions=m["versions"])
        self.state.restore_islands(m.get("islands", {}), now=self.clock())
        self.merged_tokens = [float(t) for t in m["fragmentTokens"]]
        self.eval_history = list(m.get("evalHistory", []))
        self.initial_eval_loss = m.get("initialEvalLoss")
        self.loss = m.get("loss")
        self.merge_count = int(m.get("merges", 0))
        self.last_merge_time = m.get("lastMergeTime")
        self.last_eval_step = self.last_checkpoint_step = loaded.outer_step
        self.resumed_from = str(loaded.path)
        log.info(
            "resumed from %s: outer step %d, versions %s",
            loaded.path,
            loaded.outer_step,
            self.state.versions,
        )

    async def start(self) -> None:
        """Create the loop-bound primitives and the pull bodies (call on the serving loop)."""
        self.lock = asyncio.Lock()
        self._poke = asyncio.Event()
        self._published = [asyncio.Event() for _ in self.fragments]
        self._bodies = await asyncio.to_thread(
            lambda: [self._encode_fragment(f) for f in range(len(self.fragments))]
        )

    # ----- derived figures ---------------------------------------------------------------------

    @property
    def tokens(self) -> int:
        """Tokens merged into the global model (each fragment's merges, averaged over fragments)."""
        return round(sum(self.merged_tokens) / len(self.merged_tokens))

    @property
    def eval_loss(self) -> float | None:
        return self.eval_history[-1]["evalLoss"] if self.eval_history else None

    def _stop_reached(self) -> bool:
        stop = self.spec.stop_after
        if stop.outer_steps is not None and self.state.outer_step >= stop.outer_steps:
            return True
        return stop.tokens is not None and self.tokens >= stop.tokens

    def _record_eval(self, loss: float) -> None:
        self.eval_history.append(
            {
                "outerStep": self.state.outer_step,
                "tokens": self.tokens,
                "evalLoss": loss,
                "time": self.clock(),
            }
        )
        self.last_eval_step = self.state.outer_step
        self.metrics.eval_loss.set(loss)

    def digest(self) -> str:
        """sha256 of the global weights and the outer momentum."""
        return ckpt.state_digest(self.weights, self.outer.state_tensors())

    def _encode_fragment(self, f: int) -> tuple[tuple[int, int, bool], bytes]:
        key = (self.state.versions[f], self.state.outer_step, self.finished)
        meta = {
            wire.META_VERSION: key[0],
            wire.META_FRAGMENT: f,
            wire.META_OUTER_STEP: key[1],
            wire.META_FINISHED: key[2],
        }
        return key, wire.encode_body({n: self.weights[n] for n in self.fragments[f]}, meta)

    # ----- requests ----------------------------------------------------------------------------

    def _check_fragment(self, fragment: int) -> None:
        if not 0 <= fragment < len(self.fragments):
            raise Refused(404, f"fragment {fragment} does not exist (0..{len(self.fragments) - 1})")

    def _wake(self) -> None:
        if self._poke is not None:
            self._poke.set()

    def _locked(self) -> asyncio.Lock:
        assert self.lock is not None, "Syncer.start() was not called"
        return self.lock

    async def join(self, island: str, replicas: int) -> dict[str, Any]:
        """Register an island; returns the fragment layout and current versions."""
        async with self._locked():
            rec = self.state.join(island, replicas, self.clock())
            self._update_gauges()
        self._wake()
        log.info(
            "island %s joined (join %d, %d replicas, %s)", island, rec.joins, replicas, rec.state
        )
        return {
            "fragments": self.fragments,
            "versions": self.state.versions,
            "outerStep": self.state.outer_step,
            "finished": self.finished,
            "codec": self.codec,
            "state": rec.state,
        }

    async def heartbeat(
        self, island: str, *, step: int, tokens: int, loss: float | None, step_time: float | None
    ) -> dict[str, Any]:
        """A learner's sign of life; returns its membership state and whether the job finished."""
        async with self._locked():
            rec = self.state.heartbeat(
                island, self.clock(), step=step, tokens=tokens, loss=loss, step_time=step_time
            )
            self._update_gauges()
        self._wake()
        return {"state": rec.state, "finished": self.finished, "versions": self.state.versions}

    async def leave(self, island: str) -> dict[str, Any]:
        """An island says goodbye."""
        async with self._locked():
            rec = self.state.leave(island, self.clock())
            self._update_gauges()
        self._wake()
        log.info("island %s left", island)
        return {"island": island, "state": rec.state}

    async def set_membership(self, island: str, state: str, reason: str) -> dict[str, Any]:
        """Admin: mark an island active or dropped."""
        async with self._locked():
            rec = self.state.set_admin_state(island, state, reason, self.clock())
            self._update_gauges()
        self._wake()
        log.info("island %s set %s by admin (%s)", island, state, reason or "no reason given")
        return {"island": island, "state": rec.state, "reason": rec.reason}

    async def push(self, fragment: int, body: bytes) -> dict[str, Any]:
        """Validate and record a pushed pseudo-gradient; Refused (state unchanged) on a problem."""
        self._check_fragment(fragment)
        try:
            flat, raw_meta = wire.decode_body(body)
        except ValueError as err:
            raise Refused(400, f"push body: {err}") from None
        meta = parse_push_meta(raw_meta, self.codec)
        async with self._locked():
            early = self._finished_or_duplicate(fragment, meta)
            if early is not None:
                return early
            self.state.check_push(fragment, meta.island, meta.base_version)
        try:
            decoded = await asyncio.to_thread(
                decode_tensors, flat, self.codec, self.expected[fragment]
            )
        except ValueError as err:
            raise Refused(400, f"push to fragment {fragment}: {err}") from None
        async with self._locked():
            early = self._finished_or_duplicate(fragment, meta)
            if early is not None:
                return early
            now = self.clock()
            # Checked again: a merge or a drop may have happened while decoding.
            lag = self.state.check_push(fragment, meta.island, meta.base_version)
            answer = self.state.accept_push(
                fragment,
                Contribution(
                    island=meta.island,
                    base_version=meta.base_version,
                    lag=lag,
                    tokens=meta.tokens,
                    steps=meta.steps,
                    loss=meta.loss if math.isfinite(meta.loss) else None,
                    received_at=now,
                    push_id=meta.push_id,
                    payload=decoded,
                    step_time=meta.step_time or None,
                    sync_time=meta.sync_time or None,
                ),
                now,
            )
            self.bytes_in += len(body)
            self.metrics.bytes_in.inc(len(body))
            self._update_gauges()
        self._wake()
        return answer

    def _finished_or_duplicate(self, fragment: int, meta: wire.PushMeta) -> dict[str, Any] | None:
        if self.finished:
            return {
                "accepted": False,
                "finished": True,
                "version": self.state.versions[fragment],
                "pending": 0,
                "reason": "the job has finished",
            }
        prev = self.state.previous_answer(fragment, meta.island, meta.push_id)
        return {**prev, "duplicate": True} if prev is not None else None

    async def pull(self, fragment: int, *, after: int, wait: float) -> bytes | None:
        """Fragment bytes once its version is > after (or the job finished); None after `wait`."""
        self._check_fragment(fragment)
        deadline = time.monotonic() + max(0.0, min(wait, wire.MAX_WAIT_SECONDS))
        while True:
            (version, _, finished), body = self._bodies[fragment]
            if version > after or finished:
                self.bytes_out += len(body)
                self.metrics.bytes_out.inc(len(body))
                return body
            published = self._published[fragment]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            try:
                await asyncio.wait_for(published.wait(), remaining)
            except asyncio.TimeoutError:
                return None

    async def status(self, *, digest: bool = False) -> dict[str, Any]:
        """The status document (see the module docstring of wire.py for the route)."""
        doc = {
            "jobName": self.job_name,
            "outerStep": self.state.outer_step,
            "versions": self.state.versions,
            "finished": self.finished,
            "quorum": self.state.effective_quorum(),
            "quorumTarget": self.state.policy.quorum,
            "grace": self.state.grace(),
            "fragments": len(self.fragments),
            "pending": [len(r.pending) for r in self.state.rounds],
            "codec": self.codec,
            "tokens": self.tokens,
            "loss": self.loss,
            "evalLoss": self.eval_loss,
            "initialEvalLoss": self.initial_eval_loss,
            "evalHistory": list(self.eval_history),
            "bytesIn": self.bytes_in,
            "bytesOut": self.bytes_out,
            "lastMergeTime": self.last_merge_time,
            "mergeCount": self.merge_count,
            "activeIslands": len(self.state.active_islands()),
            "islands": self.state.islands_json(),
            "merges": list(self.merges),
            "resumedFrom": self.resumed_from,
            "time": self.clock(),
        }
        if digest:
            async with self._locked():
                doc["versions"] = self.state.versions
                doc["outerStep"] = self.state.outer_step
                doc["digest"] = await asyncio.to_thread(self.digest)
        return doc

    def _update_gauges(self) -> None:
        self.metrics.active_islands.set(len(self.state.active_islands()))
        self.metrics.outer_step.set(self.state.outer_step)
        self.metrics.tokens.set(self.tokens)

    # ----- merging -----------------------------------------------------------------------------

    async def tick(self) -> float | None:
        """One scheduler pass: expire silent islands, merge every due round. Returns the next
        grace deadline (clock time), if a round is waiting for one."""
        async with self._locked():
            now = self.clock()
            for island in self.state.expire(now):
                log.warning("island %s timed out: %s", island, self.state.islands[island].reason)
                self._update_gauges()
            if not self.finished:
                for f in self.state.due_fragments(now):
                    await self._merge(f)
                    if self.finished:
                        break
            return None if self.finished else self.state.next_deadline()

    async def run_scheduler(self) -> None:
        """tick() whenever something changed, a grace window ends, or TICK_SECONDS passed."""
        assert self._poke is not None
        while True:
            deadline = await self.tick()
            wait = TICK_SECONDS
            if deadline is not None:
                wait = min(wait, max(0.005, deadline - self.clock()))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._poke.wait(), wait)
            self._poke.clear()

    async def _merge(self, f: int) -> None:
        """Merge fragment f's round (lock held): weights, outer step, version, log, publish."""
        started = time.perf_counter()
        now = self.clock()
        grace, quorum = self.state.grace(), self.state.effective_quorum()
        contributions = self.state.take_round(f, now)
        max_staleness = self.state.policy.max_staleness
        raw = [
            contribution_weight(c.tokens, c.steps, self.rule)
            * staleness_factor(c.lag, max_staleness)
            for c in contributions
        ]

        def work() -> None:
            merged = merge_pseudo_gradients(
                [c.payload for c in contributions], raw, self.rule, self.parts.plain_merge_names
            )
            self.outer.step(merged)

        await asyncio.to_thread(work)
        seconds = time.perf_counter() - started
        total = sum(raw)
        shares = [w / total for w in raw]
        tokens = sum(c.tokens for c in contributions)
        self.merged_tokens[f] += tokens
        losses = [(c.loss, c.tokens) for c in contributions if c.loss is not None]
        if losses:
            self.loss = sum(v * t for v, t in losses) / sum(t for _, t in losses)
        self.merge_count += 1
        self.last_merge_time = now
        entry = {
            "version": self.state.versions[f],
            "fragment": f,
            "outerStep": self.state.outer_step,
            "time": now,
            "quorum": quorum,
            "grace": grace,
            "rule": self.rule,
            "tokens": tokens,
            "mergeSeconds": seconds,
            "contributors": [
                {**c.log_entry(), "rawWeight": w, "weight": s}
                for c, w, s in zip(contributions, raw, shares, strict=True)
            ],
        }
        self.merges.append(entry)
        await asyncio.to_thread(ckpt.append_jsonl, self.state_dir / MERGE_LOG_FILE, entry)
        self.metrics.merges.inc()
        self.metrics.merge_seconds.observe(seconds)
        self._update_gauges()
        evaluated = await self._after_merge()
        parts = ", ".join(
            f"{c.island} w={s:.3f} lag={c.lag}" for c, s in zip(contributions, shares, strict=True)
        )
        log.info(
            "merged fragment %d -> version %d (outer step %d, %d tokens, %.3fs): %s%s",
            f,
            entry["version"],
            self.state.outer_step,
            tokens,
            seconds,
            parts,
            f"; eval loss {evaluated:.4f}" if evaluated is not None else "",
        )

    async def _after_merge(self) -> float | None:
        """Evaluate, finish, publish and checkpoint as due (lock held); returns a new eval loss."""
        step = self.state.outer_step
        stop = self._stop_reached()
        loss = None
        every_eval = self.spec.syncer.eval_every_outer_steps
        if step > self.last_eval_step and (step % every_eval == 0 or stop):
            loss = await asyncio.to_thread(evaluate, self.parts)
            self._record_eval(loss)
        if stop:
            await self._checkpoint()
            self.finished = True
            log.info("finished at outer step %d with %d tokens", step, self.tokens)
        await self._publish()
        every_ckpt = self.spec.syncer.checkpoint.every_outer_steps
        if not stop and step > self.last_checkpoint_step and step % every_ckpt == 0:
            await self._checkpoint()
        return loss

    async def _publish(self) -> None:
        """Re-encode changed fragments and wake their pullers."""
        stale = [
            f
            for f in range(len(self.fragments))
            if self._bodies[f][0] != (self.state.versions[f], self.state.outer_step, self.finished)
        ]
        fresh = await asyncio.to_thread(lambda: [self._encode_fragment(f) for f in stale])
        for f, body in zip(stale, fresh, strict=True):
            self._bodies[f] = body
            old, self._published[f] = self._published[f], asyncio.Event()
            old.set()

    def _manifest(self) -> dict[str, Any]:
        return {
            "jobName": self.job_name,
            "versions": self.state.versions,
            "fragments": self.fragments,
            "fragmentTokens": self.merged_tokens,
            "tokens": self.tokens,
            "evalHistory": self.eval_history,
            "initialEvalLoss": self.initial_eval_loss,
            "loss": self.loss,
            "merges": self.merge_count,
            "lastMergeTime": self.last_merge_time,
            "islands": self.state.islands_json(),
            "specHash": self._spec_hash,
            "codec": self.codec,
            "time": self.clock(),
        }

    async def _checkpoint(self) -> None:
        step = self.state.outer_step
        manifest = self._manifest()
        path = await asyncio.to_thread(
            ckpt.save_checkpoint,
            self.state_dir,
            outer_step=step,
            weights=self.weights,
            momentum=self.outer.state_tensors(),
            manifest=manifest,
            keep=self.spec.syncer.checkpoint.keep,
        )
        self.last_checkpoint_step = step
        log.info("checkpoint %s written", path)


# ----- HTTP ------------------------------------------------------------------------------------

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(status: int, message: str, code: str = "") -> web.Response:
    doc = {"error": message, "code": code} if code else {"error": message}
    return web.json_response(doc, status=status)


_REFUSAL_REASON = {
    400: "malformed",
    401: "unauthenticated",
    403: "forbidden",
    404: "unknown",
    409: "stale",
    413: "too_large",
}


def build_app(syncer: Syncer, token: str) -> web.Application:
    """The aiohttp application serving `syncer` behind bearer-token auth."""
    expected = token.encode()

    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except Refused as err:
            return _error(err.status, err.message, err.code)
        except web.HTTPException as err:
            if err.status < 400:
                raise
            return _error(err.status, err.reason or str(err))
        except Exception:
            log.exception("internal error on %s %s", request.method, request.path)
            return _error(500, "internal error in the syncer; see its log")

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in wire.PUBLIC_ROUTES:
            return await handler(request)
        header = request.headers.get("Authorization", "")
        if not header:
            raise Refused(401, "missing bearer token: send 'Authorization: Bearer <token>'")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise Refused(401, "malformed Authorization header: expected 'Bearer <token>'")
        if not hmac.compare_digest(given.strip().encode(), expected):
            raise Refused(403, "invalid bearer token")
        return await handler(request)

    async def json_object(request: web.Request, route: str) -> dict[str, Any]:
        if request.content_length is not None and request.content_length > JSON_LIMIT:
            raise Refused(413, f"{route} body larger than {JSON_LIMIT} bytes")
        raw = await request.content.read(JSON_LIMIT + 1)
        if len(raw) > JSON_LIMIT:
            raise Refused(413, f"{route} body larger than {JSON_LIMIT} bytes")
        try:
            doc = json.loads(raw)
        except ValueError as err:
            raise Refused(400, f"{route} body is not valid JSON: {err}") from None
        if not isinstance(doc, dict):
            raise Refused(400, f"{route} body must be a JSON object")
        return doc

    def fragment_arg(request: web.Request) -> int:
        raw = request.match_info["fragment"]
        try:
            return int(raw)
        except ValueError:
            raise Refused(404, f"fragment {raw!r} does not exist") from None

    async def read_push_body(request: web.Request, fragment: int) -> bytes:
        syncer._check_fragment(fragment)
        limit = syncer.body_limits[fragment]
        too_big = (
            f"push body for fragment {fragment} exceeds {limit} bytes, the most a "
            f"{syncer.codec}-encoded pseudo-gradient of this fragment can take"
        )
        if request.content_length is not None and request.content_length > limit:
            raise Refused(413, too_big)
        buf = bytearray()
        async for chunk in request.content.iter_any():
            buf += chunk
            if len(buf) > limit:
                raise Refused(413, too_big)
        return bytes(buf)

    async def join(request: web.Request) -> web.Response:
        doc = await json_object(request, "join")
        island = _island_name(doc.get("island"), "join")
        replicas = _typed(doc, "replicas", "join", int, required=False) or 1
        _at_least(replicas, 1, "join", "replicas")
        return web.json_response(await syncer.join(island, replicas))

    async def pull(request: web.Request) -> web.Response:
        fragment = fragment_arg(request)
        try:
            after = int(request.query.get("after", "-1"))
            wait = float(request.query.get("wait", "0"))
        except ValueError:
            raise Refused(400, "query after must be an integer and wait a number") from None
        if not math.isfinite(wait) or wait < 0:
            raise Refused(400, f"query wait must be a number >= 0, got {wait}")
        body = await syncer.pull(fragment, after=after, wait=wait)
        if body is None:
            return web.Response(status=304)
        return web.Response(body=body, content_type=wire.SAFETENSORS_CONTENT_TYPE)

    async def push(request: web.Request) -> web.Response:
        fragment = fragment_arg(request)
        try:
            body = await read_push_body(request, fragment)
            answer = await syncer.push(fragment, body)
        except Refused as err:
            syncer.metrics.pushes.labels(_REFUSAL_REASON.get(err.status, str(err.status))).inc()
            raise
        result = "accepted" if answer.get("accepted") else "finished"
        syncer.metrics.pushes.labels(result).inc()
        return web.json_response(answer)

    async def heartbeat(request: web.Request) -> web.Response:
        doc = await json_object(request, "heartbeat")
        island = _island_name(doc.get("island"), "heartbeat")
        step = _typed(doc, "step", "heartbeat", int, required=False) or 0
        tokens = _typed(doc, "tokens", "heartbeat", int, required=False) or 0
        loss = _typed(doc, "loss", "heartbeat", float, required=False)
        step_time = _typed(doc, "stepTime", "heartbeat", float, required=False)
        _at_least(step, 0, "heartbeat", "step")
        _at_least(tokens, 0, "heartbeat", "tokens")
        _at_least(step_time, 0, "heartbeat", "stepTime")
        answer = await syncer.heartbeat(
            island, step=step, tokens=tokens, loss=loss, step_time=step_time
        )
        return web.json_response(answer)

    async def leave(request: web.Request) -> web.Response:
        doc = await json_object(request, "leave")
        return web.json_response(await syncer.leave(_island_name(doc.get("island"), "leave")))

    async def membership(request: web.Request) -> web.Response:
        island = _island_name(request.match_info["island"], "path")
        doc = await json_object(request, "membership")
        state = _typed(doc, "state", "membership", str)
        if state not in wire.ADMIN_STATES:
            raise Refused(
                400, f"membership.state must be one of {list(wire.ADMIN_STATES)}, got {state!r}"
            )
        reason = _typed(doc, "reason", "membership", str, required=False) or ""
        return web.json_response(await syncer.set_membership(island, state, reason[:500]))

    async def status(request: web.Request) -> web.Response:
        digest = request.query.get("digest", "0") not in ("", "0", "false")
        return web.json_response(await syncer.status(digest=digest))

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def readyz(request: web.Request) -> web.Response:
        return web.json_response({"ready": True, "outerStep": syncer.state.outer_step})

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(
            body=syncer.metrics.render(), headers={"Content-Type": METRICS_CONTENT_TYPE}
        )

    async def on_startup(app: web.Application) -> None:
        await syncer.start()
        app["scheduler"] = asyncio.create_task(syncer.run_scheduler())

    async def on_cleanup(app: web.Application) -> None:
        task: asyncio.Task[None] = app["scheduler"]
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    app = web.Application(middlewares=[errors, auth], client_max_size=JSON_LIMIT)
    app.router.add_post(wire.ROUTE_JOIN, join)
    app.router.add_get(wire.ROUTE_FRAGMENT, pull)
    app.router.add_post(wire.ROUTE_PUSH, push)
    app.router.add_post(wire.ROUTE_HEARTBEAT, heartbeat)
    app.router.add_post(wire.ROUTE_LEAVE, leave)
    app.router.add_get(wire.ROUTE_STATUS, status)
    app.router.add_put(wire.ROUTE_ISLAND, membership)
    app.router.add_get(wire.ROUTE_HEALTHZ, healthz)
    app.router.add_get(wire.ROUTE_READYZ, readyz)
    app.router.add_get(wire.ROUTE_METRICS, metrics)
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


def _ssl_context(env: SyncerEnv) -> ssl.SSLContext | None:
    if env.tls_cert_file is None or env.tls_key_file is None:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(str(env.tls_cert_file), str(env.tls_key_file))
    return ctx


def main(args: argparse.Namespace) -> int:
    """`diloco syncer`: serve the job in $DILOCO_CONFIG_FILE until SIGTERM."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        env = SyncerEnv.from_env()
        spec = load_spec(env.config_file)
    except (ContractError, ConfigError) as err:
        print(f"diloco syncer: {err}", file=sys.stderr)
        return 2
    try:
        ssl_context = _ssl_context(env)
    except (OSError, ssl.SSLError) as err:
        print(f"diloco syncer: cannot load TLS certificate or key: {err}", file=sys.stderr)
        return 2
    try:
        syncer = Syncer(spec, job_name=env.job_name, state_dir=env.state_dir)
    except ConfigError as err:
        print(f"diloco syncer: {err}", file=sys.stderr)
        return 2
    app = build_app(syncer, env.token)
    log.info(
        "syncer for job %s serving %s on port %d: %d fragments, outer step %d, versions %s",
        env.job_name,
        "https" if ssl_context else "http",
        env.port,
        len(syncer.fragments),
        syncer.state.outer_step,
        syncer.state.versions,
    )
    web.run_app(
        app,
        host="0.0.0.0",
        port=env.port,
        ssl_context=ssl_context,
        print=None,
        access_log=None,
        handle_signals=True,
    )
    log.info("syncer stopped")
    return 0
