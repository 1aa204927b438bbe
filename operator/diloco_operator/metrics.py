"""Prometheus metrics of the operator, served on --metrics-port."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

RECONCILES = Counter(
    "diloco_operator_reconciles_total", "Reconciles of DiLoCoJobs, by result.", ["result"]
)
RECONCILE_SECONDS = Histogram(
    "diloco_operator_reconcile_seconds", "Time to reconcile one DiLoCoJob's children."
)
CHILD_CHANGES = Counter(
    "diloco_operator_child_changes_total",
    "Children created/updated or deleted.",
    ["action", "kind"],
)
ERRORS = Counter("diloco_operator_errors_total", "Errors while handling DiLoCoJobs.", ["where"])
ISLANDS_DROPPED = Counter(
    "diloco_operator_islands_dropped_total", "Islands the operator dropped from a syncer quorum."
)
ISLANDS_READDED = Counter(
    "diloco_operator_islands_readded_total", "Islands the operator re-added to a syncer quorum."
)
SYNCER_UNREACHABLE = Counter(
    "diloco_operator_syncer_unreachable_total", "Syncer requests that failed after retries."
)
JOBS = Gauge("diloco_operator_jobs", "DiLoCoJobs seen by this operator, by phase.", ["phase"])


def serve(port: int, addr: str = "0.0.0.0") -> None:
    """Serve /metrics on a background thread (port 0 disables it)."""
    if port:
        start_http_server(port, addr=addr)
