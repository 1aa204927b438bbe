"""Prometheus metrics of the operator, served on --metrics-port."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

RECONCILES = Counter(
    "diloco_operator_reconciles_total", "Reconciles of DiLoCoJobs, by result.", ["result"]
)
# The default buckets stop at 10 s; a busy API server (100 jobs x 8 islands in bench/) pushed
# the tail past that, and a histogram whose top bucket holds the tail cannot show it.
_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, float("inf"))
RECONCILE_SECONDS = Histogram(
    "diloco_operator_reconcile_seconds",
    "Time to reconcile one DiLoCoJob's children, from when the reconcile starts its work (its "
    "wait for a slot is diloco_operator_reconcile_queue_seconds).",
    buckets=_BUCKETS,
)
RECONCILE_QUEUE_SECONDS = Histogram(
    "diloco_operator_reconcile_queue_seconds",
    "Time a job's first reconcile waited before starting its work: from the start of its sync "
    "(the job's lock included) until it held a first-reconcile slot (reconcile_slots.py).",
    buckets=_BUCKETS,
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
REFUSED_CONTRIBUTIONS = Counter(
    "diloco_operator_refused_contributions_total",
    "Pushes the jobs' syncers refused, by reason (protocol.REFUSAL_REASONS, or other); each "
    "also a ContributionRefused Event on its job.",
    ["reason"],
)
SYNCER_UNREACHABLE = Counter(
    "diloco_operator_syncer_unreachable_total", "Syncer requests that failed after retries."
)
API_READS = Counter(
    "diloco_operator_api_reads_total",
    "Reads sent to the API server, by verb and kind. Pods and children come from the watches: "
    "lists happen on a job's first sync and on the slow resync only.",
    ["verb", "kind"],
)
API_READY = Gauge(
    "diloco_operator_api_ready", "1 while the API server answers the operator (its readiness)."
)
JOBS = Gauge("diloco_operator_jobs", "DiLoCoJobs seen by this operator, by phase.", ["phase"])


def serve(port: int, addr: str = "0.0.0.0") -> None:
    """Serve /metrics on a background thread (port 0 disables it)."""
    if port:
        start_http_server(port, addr=addr)
