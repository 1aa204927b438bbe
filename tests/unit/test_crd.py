"""The generated CRD: fresh on disk, structural, documented, and carrying the validation rules."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import yaml
from diloco_operator import api, crd

ROOT = Path(__file__).resolve().parents[2]
COPIES = [ROOT / "crds" / "dilocojob.yaml"]
_CHART_COPY = ROOT / "charts" / "diloco-operator" / "crds" / "dilocojob.yaml"
if _CHART_COPY.exists():
    COPIES.append(_CHART_COPY)


def _schema() -> dict[str, Any]:
    return crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _walk(node: dict[str, Any], path: str = ""):
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{name}" if path else name)
    if "items" in node:
        yield from _walk(node["items"], f"{path}[]")


@pytest.mark.parametrize("path", COPIES, ids=lambda p: str(p.relative_to(ROOT)))
def test_crd_committed_copy_is_fresh(path: Path) -> None:
    assert path.exists(), f"{path} is missing: run `make crd`"
    assert path.read_text() == crd.render_crd(), f"{path} is stale: run `make crd`"


def test_crd_names_and_subresources() -> None:
    body = crd.build_crd()
    assert body["metadata"]["name"] == "dilocojobs.diloco.dev"
    names = body["spec"]["names"]
    assert (names["kind"], names["plural"], names["shortNames"]) == (
        "DiLoCoJob",
        "dilocojobs",
        ["dj"],
    )
    version = body["spec"]["versions"][0]
    assert version["name"] == "v1alpha1" and version["storage"] and version["served"]
    assert version["subresources"] == {
        "status": {},
        "scale": {
            "specReplicasPath": ".spec.islands.count",
            "statusReplicasPath": ".status.islands.ready",
        },
    }


def test_crd_printer_columns() -> None:
    columns = crd.build_crd()["spec"]["versions"][0]["additionalPrinterColumns"]
    by_name = {c["name"]: c["jsonPath"] for c in columns}
    assert by_name == {
        "Phase": ".status.phase",
        "Islands": ".status.islandsSummary",
        "Outer Step": ".status.outerStep",
        "Progress": ".status.progress",
        "ETA": ".status.eta",
        "Eval Loss": ".status.evalLoss",
        "Age": ".metadata.creationTimestamp",
        "Rounds": ".status.roundsSummary",
        "Waiting": ".status.waitingSummary",
    }
    # Issue 47: each island's round and step time only in the wide output (priority 1); issue
    # 45: each island's share of its time waiting for merges too.
    priority = {c["name"]: c.get("priority", 0) for c in columns}
    assert {n for n, p in priority.items() if p} == {"Rounds", "Waiting"}
    # Issue 48: the column said "Latest training loss"; it shows the evaluation loss.
    described = {c["name"]: c.get("description", "") for c in columns}
    assert described["Eval Loss"].startswith("Latest evaluation loss")


def test_crd_every_field_is_typed_and_described() -> None:
    for path, node in _walk(_schema()):
        if path == "metadata":
            continue
        assert "type" in node or node.get("x-kubernetes-int-or-string"), path
        assert node.get("description"), f"{path} has no description (kubectl explain shows it)"
        assert "$ref" not in node and "anyOf" not in node and "title" not in node, path


def test_crd_ranges_enums_and_required() -> None:
    spec = _schema()["properties"]["spec"]
    props = spec["properties"]
    assert spec["required"] == ["image"]
    assert props["image"]["minLength"] == 1
    lr = props["inner"]["properties"]["lr"]
    assert (lr["minimum"], lr["exclusiveMinimum"]) == (0, True)
    outer_lr = props["outer"]["properties"]["lr"]
    assert (outer_lr["minimum"], outer_lr["exclusiveMinimum"]) == (0, True)
    momentum = props["outer"]["properties"]["momentum"]
    assert (momentum["maximum"], momentum["exclusiveMaximum"]) == (1, True)
    assert props["islands"]["properties"]["count"]["minimum"] == 1
    assert props["sync"]["properties"]["compression"]["enum"] == [
        "none",
        "fp16",
        "bf16",
        "int8",
        "int4",
    ]
    assert props["inner"]["properties"]["optimizer"]["enum"] == ["adamw"]
    assert props["islands"]["properties"]["namePrefix"]["pattern"].startswith("^")


def test_crd_defaults_fill_nested_sections() -> None:
    props = _schema()["properties"]["spec"]["properties"]
    # A section omitted from a manifest defaults to {} so its own field defaults apply.
    for section in ("model", "data", "islands", "inner", "outer", "sync", "stopAfter", "syncer"):
        assert props[section]["default"] == {}, section
    assert props["islands"]["properties"]["count"]["default"] == 2
    assert props["sync"]["properties"]["graceSeconds"]["default"] == "auto"
    assert props["syncer"]["properties"]["checkpoint"]["default"] == {}
    # Optional fields without a default stay absent rather than null.
    assert "default" not in props["syncer"]["properties"]["tokenSecretName"]


def test_crd_free_form_kubernetes_objects_are_preserved() -> None:
    props = _schema()["properties"]["spec"]["properties"]
    for node in (
        props["islands"]["properties"]["resources"],
        props["islands"]["properties"]["template"],
        props["syncer"]["properties"]["resources"],
    ):
        assert node["type"] == "object"
        assert node["x-kubernetes-preserve-unknown-fields"] is True


def test_crd_grace_seconds_is_int_or_string_with_rule() -> None:
    grace = _schema()["properties"]["spec"]["properties"]["sync"]["properties"]["graceSeconds"]
    assert grace["x-kubernetes-int-or-string"] is True
    assert "type" not in grace
    (rule,) = grace["x-kubernetes-validations"]
    assert "'auto'" in rule["rule"] and "spec.sync.graceSeconds" in rule["message"]


def test_crd_cross_field_rules_name_their_fields() -> None:
    spec = _schema()["properties"]["spec"]
    (quorum,) = spec["x-kubernetes-validations"]
    assert quorum["fieldPath"] == ".sync.quorum"
    assert "spec.sync.quorum" in quorum["message"]
    syncer_rules = spec["properties"]["syncer"]["x-kubernetes-validations"]
    paths = {r["fieldPath"] for r in syncer_rules}
    assert paths == {".endpoint", ".checkpoint.claimName", ".service.type", ".tls.secretName"}
    for rule in syncer_rules:
        assert "spec.syncer." + rule["fieldPath"].lstrip(".") in rule["message"]


def test_crd_root_rules_bound_the_job_name() -> None:
    rules = _schema()["x-kubernetes-validations"]
    assert any("52" in r["message"] for r in rules)
    assert all(r["message"].startswith("metadata.name") for r in rules)


def test_crd_status_schema_matches_status_model() -> None:
    status = _schema()["properties"]["status"]
    fields = {f.alias or name for name, f in api.DiLoCoJobStatus.model_fields.items()}
    assert set(status["properties"]) == fields
    assert status["properties"]["conditions"]["x-kubernetes-list-map-keys"] == ["type"]
    assert "default" not in status["properties"]["phase"]


def test_crd_structural_refuses_unexpressible_union() -> None:
    node = {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}
    with pytest.raises(ValueError, match=r"spec\.x"):
        crd.structural(node, {}, "spec.x")


def test_crd_main_writes_file(tmp_path: Path) -> None:
    out = tmp_path / "crd.yaml"
    assert crd.main(argparse.Namespace(output=str(out))) == 0
    doc = yaml.safe_load(out.read_text())
    assert doc == crd.build_crd()
    assert out.read_text().startswith("# Generated by `diloco crd`")
