"""`kubectl get dj` shows Progress and ETA from the syncer's figures: a real syncer on loopback
and a real learner train the job while the operator polls the syncer and writes its status."""

from __future__ import annotations

from typing import Any

import pytest

from .operator_helpers import Cluster, OperatorProcess, job_manifest
from .waits import WAIT, wait_until

pytestmark = pytest.mark.cluster


def _columns(cluster: Cluster, name: str) -> dict[str, str]:
    """`kubectl get dj NAME`'s columns by header (headers and values are single words, but
    'OUTER STEP' and 'EVAL LOSS', whose headers are two)."""
    out = cluster.cp.kubectl("get", "dj", name, "-n", cluster.ns).stdout
    header, row = out.strip().splitlines()
    names = header.replace("OUTER STEP", "OUTER_STEP").replace("EVAL LOSS", "EVAL_LOSS").split()
    return dict(zip(names, row.split(), strict=True))


def test_kubectl_get_dj_shows_progress_and_eta(
    cluster: Cluster, operator: OperatorProcess, make_local_syncer: Any
) -> None:
    manifest = job_manifest(
        "eta",
        islands={"count": 1, "replicas": 1},
        stopAfter={"outerSteps": 4},
        ttlSecondsAfterFinished=600,
    )
    syncer = make_local_syncer(manifest)
    manifest["spec"]["syncer"] = {"endpoint": syncer.url, "tokenSecretName": syncer.secret_name}
    cluster.apply(manifest)
    wait_until(lambda: cluster.status("eta").get("phase") == "Running", WAIT, message="Running")
    learner = syncer.start_learner("island-0", 0)

    def under_way() -> dict[str, str] | None:
        columns = _columns(cluster, "eta")
        return columns if columns.get("PROGRESS", "<none>") not in ("<none>", "0%") else None

    columns = wait_until(under_way, 300, message="a Progress past 0%")
    # Outer steps of 4: 25%, 50% or 75% (or 100% on a fast machine), with an ETA beside it.
    assert columns["PROGRESS"] in ("25%", "50%", "75%", "100%"), columns
    assert columns["ETA"] != "<none>" and columns["ETA"][-1] in "smhd", columns
    status = cluster.status("eta")
    assert int(status["progress"].rstrip("%")) == min(100, 25 * status["outerStep"])

    def finished() -> dict[str, str] | None:
        columns = _columns(cluster, "eta")
        return columns if columns["PHASE"] == "Succeeded" else None

    done = wait_until(finished, 300, message="Succeeded")
    assert (done["PROGRESS"], done["ETA"]) == ("100%", "0s"), done
    learner.wait(timeout=120)
