"""The job spec schema (config.py): defaults, validation messages, loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from diloco_trainer.api.spec import ConfigError, JobSpec, load_spec, parse_spec


def test_parse_spec_empty_gives_defaults() -> None:
    spec = parse_spec({})
    assert spec.model.preset == "gpt-tiny"
    assert spec.data.source == "builtin:stdlib-text"
    assert spec.sync.grace_seconds == "auto"
    assert spec.outer.nesterov is True
    assert spec.total_shards() == spec.islands.count


def test_parse_spec_camel_case_fields() -> None:
    spec = parse_spec({"inner": {"batchSize": 8, "seqLen": 64}, "stopAfter": {"outerSteps": 3}})
    assert (spec.inner.batch_size, spec.inner.seq_len) == (8, 64)
    assert spec.stop_after.outer_steps == 3


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        ({"inner": {"lr": 0}}, "spec.inner.lr"),
        ({"inner": {"seqLen": 2}}, "spec.inner.seqLen"),
        ({"inner": {"batchSize": "many"}}, "spec.inner.batchSize"),
        ({"outer": {"momentum": 1.0}}, "spec.outer.momentum"),
        ({"sync": {"compression": "int2"}}, "spec.sync.compression"),
        ({"sync": {"merge": "median"}}, "spec.sync.merge"),
        ({"islands": {"namePrefix": "Bad_Name"}}, "spec.islands.namePrefix"),
        ({"model": {"entrypoint": "not an entrypoint"}}, "spec.model.entrypoint"),
        ({"stopAfter": {"outerSteps": 0}}, "spec.stopAfter.outerSteps"),
    ],
)
def test_parse_spec_bad_value_names_field_in_camel_case(doc: dict, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_spec(doc)
    assert str(err.value).startswith(field + ":"), str(err.value)


def test_parse_spec_reports_every_bad_field() -> None:
    with pytest.raises(ConfigError) as err:
        parse_spec({"inner": {"lr": -1, "steps": 0}})
    lines = str(err.value).splitlines()
    assert any(line.startswith("spec.inner.lr:") for line in lines)
    assert any(line.startswith("spec.inner.steps:") for line in lines)


def test_parse_spec_quorum_above_count_refused() -> None:
    with pytest.raises(ConfigError, match=r"sync\.quorum \(3\) must be <= islands\.count \(2\)"):
        parse_spec({"islands": {"count": 2}, "sync": {"quorum": 3}})
    assert parse_spec({"islands": {"count": 3}, "sync": {"quorum": 3}}).sync.quorum == 3


def test_parse_spec_quorum_above_local_count_allowed_with_remote_syncer() -> None:
    # With an external syncer the quorum counts islands of every cluster.
    spec = parse_spec(
        {"islands": {"count": 1}, "sync": {"quorum": 3}, "syncer": {"endpoint": "https://s:443"}}
    )
    assert spec.sync.quorum == 3


@pytest.mark.parametrize(
    "doc",
    [{"inner": {"learningRate": 1}}, {"colour": "blue"}, {"syncer": {"checkpoint": {"x": 1}}}],
)
def test_parse_spec_unknown_field_refused(doc: dict) -> None:
    with pytest.raises(ConfigError, match="Extra inputs are not permitted"):
        parse_spec(doc)


@pytest.mark.parametrize(("value", "expected"), [("auto", "auto"), (0, 0.0), (2.5, 2.5)])
def test_parse_spec_grace_seconds_accepts_auto_or_non_negative(
    value: object, expected: object
) -> None:
    assert parse_spec({"sync": {"graceSeconds": value}}).sync.grace_seconds == expected


@pytest.mark.parametrize("value", [-1, "soon", None])
def test_parse_spec_grace_seconds_refuses_other_values(value: object) -> None:
    with pytest.raises(ConfigError, match=r"sync(\.graceSeconds)?"):
        parse_spec({"sync": {"graceSeconds": value}})
    with pytest.raises(ConfigError) as err:
        parse_spec({"sync": {"graceSeconds": value}})
    assert "graceSeconds" in str(err.value)


def test_load_spec_accepts_manifest_and_bare_spec(tmp_path: Path) -> None:
    spec = {"islands": {"count": 4}, "sync": {"quorum": 3, "compression": "int8"}}
    manifest = {
        "apiVersion": "diloco.dev/v1alpha1",
        "kind": "DiLoCoJob",
        "metadata": {"name": "demo"},
        "spec": spec,
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(manifest))
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    loaded = [load_spec(tmp_path / n) for n in ("job.yaml", "spec.yaml", "spec.json")]
    assert all(s == loaded[0] for s in loaded)
    assert loaded[0].islands.count == 4 and loaded[0].sync.compression == "int8"


def test_load_spec_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        load_spec(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("inner: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_spec(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_spec(scalar)
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text(yaml.safe_dump({"kind": "DiLoCoJob", "spec": {"inner": {"lr": -1}}}))
    with pytest.raises(ConfigError, match=r"spec\.inner\.lr"):
        load_spec(wrong)


def test_job_spec_json_round_trips_in_camel_case() -> None:
    spec = parse_spec({"sync": {"graceSeconds": 1.5, "maxStaleness": 2}})
    doc = json.loads(spec.to_json())
    assert doc["sync"]["graceSeconds"] == 1.5 and doc["sync"]["maxStaleness"] == 2
    assert parse_spec(doc) == spec
    assert isinstance(JobSpec.model_validate(doc), JobSpec)


def test_config_quorum_may_count_other_regions_islands_with_total_shards() -> None:
    spec = parse_spec({"islands": {"count": 1, "totalShards": 3}, "sync": {"quorum": 3}})
    assert spec.sync.quorum == 3
    with pytest.raises(ConfigError, match=r"sync\.quorum"):
        parse_spec({"islands": {"count": 1, "totalShards": 2}, "sync": {"quorum": 3}})
