"""Prometheus metrics of one syncer, in their own registry (not the process-global one), so several
syncers in one process (tests) never collide."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class SyncerMetrics:
    """Counters and gauges the syncer updates; `render()` is the /metrics body."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.pushes = Counter(
            "diloco_syncer_pushes",
            "Pseudo-gradient pushes by result (accepted, or the refusal reason)",
            ["result"],
            registry=r,
        )
        self.merges = Counter("diloco_syncer_merges", "Fragment merges applied", registry=r)
        self.bytes_in = Counter(
            "diloco_syncer_bytes_in", "Pseudo-gradient bytes received", registry=r
        )
        self.bytes_out = Counter("diloco_syncer_bytes_out", "Fragment bytes served", registry=r)
        self.active_islands = Gauge(
            "diloco_syncer_active_islands", "Islands counting towards the quorum", registry=r
        )
        self.outer_step = Gauge("diloco_syncer_outer_step", "Completed outer steps", registry=r)
        self.tokens = Gauge(
            "diloco_syncer_tokens", "Tokens merged into the global model", registry=r
        )
        self.eval_loss = Gauge(
            "diloco_syncer_eval_loss", "Eval loss of the global weights (latest)", registry=r
        )
        self.merge_seconds = Histogram(
            "diloco_syncer_merge_seconds",
            "Time to merge one fragment's round and apply the outer step",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30),
            registry=r,
        )

        self.refused_joins = Counter(
            "diloco_syncer_refused_joins",
            "Joins and membership changes refused, by reason (syncer/intake/admission.py)",
            ["reason"],
            registry=r,
        )
        self.refused_contributions = Counter(
            "diloco_syncer_refused_contributions",
            "Pushes of known islands refused, by island and reason (protocol.REFUSAL_REASONS)",
            ["island", "reason"],
            registry=r,
        )
        self.dropped_islands = Counter(
            "diloco_syncer_dropped_islands",
            "Islands dropped for sending syncer.guards.maxRefusals refused pushes in a row",
            registry=r,
        )
        self.merge_failures = Counter(
            "diloco_syncer_merge_failures",
            "Contributions a merge could not take and left out",
            registry=r,
        )
        self.checkpoint_failures = Counter(
            "diloco_syncer_checkpoint_failures", "Checkpoint writes that failed", registry=r
        )
        self.healthy = Gauge(
            "diloco_syncer_healthy", "1 when the syncer has no problem (status.health)", registry=r
        )
        self.healthy.set(1)

    def render(self) -> bytes:
        """The exposition-format text of this registry."""
        return generate_latest(self.registry)
