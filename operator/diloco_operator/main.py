"""`diloco operator`: run the kopf operator for DiLoCoJobs.

Wraps `kopf.run` with the options the chart passes: namespaces to watch (cluster-wide when none),
standalone mode (no peering: one replica), /healthz (liveness) and /readyz (readiness: the API
server answers; probes.py) on --health-port, and Prometheus metrics on --metrics-port.
"""

from __future__ import annotations

import argparse
import logging

import kopf

from diloco_operator import metrics

# Handlers that run on every pod/child event: kopf's "succeeded" line for each would drown the log.
QUIET_HANDLERS = ("pod_event", "child_event", "job_event")


class _QuietEventHandlers(logging.Filter):
    """Drop kopf's per-event success lines of the high-frequency event handlers."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (
            message.endswith("succeeded.") and any(f"'{h}'" in message for h in QUIET_HANDLERS)
        )


def main(args: argparse.Namespace) -> int:
    """Run the operator until it is signalled to stop; returns the exit code."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("kopf.objects").addFilter(_QuietEventHandlers())
    from diloco_operator import handlers  # noqa: F401  (registers the handlers with kopf)

    namespaces: list[str] = list(getattr(args, "namespace", []) or [])
    metrics.serve(int(getattr(args, "metrics_port", 0) or 0))
    health_port = int(getattr(args, "health_port", 0) or 0)
    kopf.run(
        standalone=bool(getattr(args, "standalone", False)),
        namespaces=namespaces,
        clusterwide=not namespaces,
        memo=kopf.Memo(health_port=health_port),  # handlers.configure serves the probes there
    )
    return 0
