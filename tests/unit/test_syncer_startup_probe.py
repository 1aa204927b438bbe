"""The syncer's pod gives it minutes to start (reading its data, evaluating the initial weights
or resuming from a checkpoint) before its liveness probe counts: on the real node the liveness
probe alone killed a syncer that needed 70 s to start (tests/node/test_job_on_node.py)."""

from __future__ import annotations

from diloco_operator import api, resources
from diloco_operator.resources import JobRef

JOB = JobRef(name="demo", namespace="ns", uid="uid-1")


def test_syncer_startup_probe_covers_a_slow_start_and_probes_do_not_time_out_at_1s() -> None:
    spec = api.parse_job_spec({"image": "trainer:1"})
    dep = resources.build_syncer_deployment(JOB, spec)
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    startup = container["startupProbe"]
    assert startup["httpGet"]["path"] == "/healthz"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["timeoutSeconds"] > 1, probe
