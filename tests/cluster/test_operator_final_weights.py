"""ttlSecondsAfterFinished over an emptyDir checkpoint volume is warned about on the job."""

from __future__ import annotations

import pytest

from .operator_helpers import Cluster, OperatorProcess, job_manifest
from .waits import WAIT, wait_until

pytestmark = pytest.mark.cluster


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
