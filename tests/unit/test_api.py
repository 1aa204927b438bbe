"""The DiLoCoJob API models: the trainer's JobSpec tightened for a cluster, and the status."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from diloco_operator import api

ROOT = Path(__file__).resolve().parents[2]


def test_api_example_manifest_parses() -> None:
    doc = yaml.safe_load((ROOT / "examples" / "job.yaml").read_text())
    assert doc["apiVersion"] == api.API_VERSION and doc["kind"] == api.KIND
    spec = api.parse_job_spec(doc["spec"])
    assert spec.islands.count == 4 and spec.sync.quorum == 3
    assert spec.image.startswith("ghcr.io/")


def test_api_parse_job_spec_requires_image() -> None:
    with pytest.raises(api.SpecError, match=r"spec\.image"):
        api.parse_job_spec({"islands": {"count": 2}})


def test_api_parse_job_spec_keeps_trainer_cross_field_rule() -> None:
    with pytest.raises(api.SpecError, match=r"sync\.quorum"):
        api.parse_job_spec({"image": "x", "islands": {"count": 2}, "sync": {"quorum": 3}})


def test_api_parse_job_spec_refuses_unknown_field_by_name() -> None:
    with pytest.raises(api.SpecError, match=r"spec\.inner\.learningRate"):
        api.parse_job_spec({"image": "x", "inner": {"learningRate": 1}})


def test_api_spec_json_is_a_valid_trainer_config() -> None:
    from diloco_trainer.api.spec import parse_spec

    spec = api.parse_job_spec({"image": "x", "islands": {"count": 3, "template": {"spec": {}}}})
    trainer = parse_spec(__import__("json").loads(spec.to_json()))
    assert trainer.islands.count == 3 and trainer.image == "x"


def test_api_status_round_trips_camel_case() -> None:
    status = api.DiLoCoJobStatus(
        phase="Running",
        islands=api.IslandCounts(desired=4, ready=3, active=3),
        islands_summary="3/4",
        island_statuses=[api.IslandEntry(name="island-0", ready_pods=2, in_quorum=True)],
        outer_step=7,
    )
    wire = status.model_dump(by_alias=True, exclude_none=True)
    assert wire["islandsSummary"] == "3/4" and wire["outerStep"] == 7
    assert wire["islandStatuses"][0]["readyPods"] == 2
    assert api.DiLoCoJobStatus.model_validate(wire) == status
