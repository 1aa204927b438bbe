"""ttlSecondsAfterFinished over an emptyDir checkpoint volume is warned about on the job."""

# ruff: noqa: F811  (fixtures are imported from operator_fixtures and requested by name)
from __future__ import annotations

import pytest

from .conftest import wait_until
from .operator_fixtures import (  # noqa: F401
    Cluster,
    OperatorProcess,
    cluster,
    crd,
    job_manifest,
    operator,
)

pytestmark = pytest.mark.cluster

WAIT = 180  # seconds; generous for a loaded 2-core machine, waits end once their condition holds


def test_ttl_over_an_empty_dir_gets_a_warning_event(
    cluster: Cluster, operator: OperatorProcess
) -> None:
    cluster.apply(job_manifest("kept", ttlSecondsAfterFinished=600))
    (event,) = wait_until(
        lambda: cluster.events("FinalWeightsNotKept"), WAIT, message="a FinalWeightsNotKept Event"
    )
    assert event["type"] == "Warning"
    assert event["involvedObject"]["kind"] == "DiLoCoJob"
    assert event["involvedObject"]["name"] == "kept"
    assert "syncer.checkpoint.claimName" in event["message"]
