"""Chart-wide checks: lint, what the defaults render, labels, CRD copy, NOTES, values docs."""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from .conftest import NAMESPACE
from .helm_tool import CHART, REPO, Helm, Rendered

CLUSTER_SCOPED = {"ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"}


@pytest.mark.parametrize(
    "extra",
    [[], ["--set", "rbac.scope=namespace", "--set", "watchNamespaces={team-a,team-b}"]],
    ids=["defaults", "namespace-scope"],
)
def test_chart_should_pass_strict_lint_when_values_valid(helm: Helm, extra: list[str]) -> None:
    result = helm.run("lint", "--strict", str(CHART), *extra)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


def test_chart_should_render_operator_rbac_and_metrics_when_default_values(
    render: Callable[..., Rendered],
) -> None:
    out = render()
    assert sorted(out.kinds()) == sorted(
        [
            "ServiceAccount",
            "ClusterRole",  # the operator's
            "ClusterRole",  # -edit (aggregated into admin/edit)
            "ClusterRole",  # -view (aggregated into view)
            "ClusterRoleBinding",
            "Service",
            "Deployment",
        ]
    )


def test_chart_should_label_every_resource_when_rendered(
    render: Callable[..., Rendered], chart_meta: dict[str, Any]
) -> None:
    out = render({"commonLabels": {"team": "ml-infra"}})
    for doc in out.docs:
        labels = doc["metadata"]["labels"]
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        assert labels["app.kubernetes.io/name"] == "diloco-operator", where
        assert labels["app.kubernetes.io/instance"] == "diloco", where
        assert labels["app.kubernetes.io/managed-by"] == "Helm", where
        assert labels["app.kubernetes.io/version"] == chart_meta["appVersion"], where
        assert labels["team"] == "ml-infra", where


def test_chart_should_put_namespaced_objects_in_release_namespace_when_rendered(
    render: Callable[..., Rendered],
) -> None:
    for doc in render().docs:
        if doc["kind"] in CLUSTER_SCOPED:
            assert "namespace" not in doc["metadata"], doc["kind"]
        else:
            assert doc["metadata"]["namespace"] == NAMESPACE, doc["kind"]


def test_chart_should_use_fullname_override_when_set(render: Callable[..., Rendered]) -> None:
    out = render({"fullnameOverride": "dj-op"})
    assert out.one("Deployment")["metadata"]["name"] == "dj-op"
    assert out.one("ServiceAccount")["metadata"]["name"] == "dj-op"


def test_crds_should_match_generated_crd_when_chart_packaged() -> None:
    generated = REPO / "crds" / "dilocojob.yaml"
    copy = CHART / "crds" / "dilocojob.yaml"
    assert generated.exists(), "crds/dilocojob.yaml is missing: run `make crd`"
    assert copy.read_text() == generated.read_text(), (
        "charts/diloco-operator/crds/dilocojob.yaml is stale: run `make crd`"
    )


def test_crds_should_install_dilocojob_crd_when_crds_included(
    render: Callable[..., Rendered],
) -> None:
    crd = render(None, "--include-crds").one("CustomResourceDefinition")
    assert crd["metadata"]["name"] == "dilocojobs.diloco.dev"
    assert "dj" in crd["spec"]["names"]["shortNames"]


def render_notes(helm: Helm, tmp_path: Path, values: dict[str, Any] | None) -> str:
    """NOTES.txt as helm renders it for these values.

    `helm template` leaves NOTES.txt out and `helm install --dry-run` needs a reachable cluster, so
    a copy of the chart wraps the unchanged NOTES.txt in a named template and a ConfigMap.
    """
    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    notes = (chart / "templates" / "NOTES.txt").read_text()
    (chart / "templates" / "_notes_preview.tpl").write_text(
        '{{- define "notes-preview" -}}\n' + notes + "{{- end }}\n"
    )
    (chart / "templates" / "notes-preview.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes-preview}\n"
        'data: {notes: {{ include "notes-preview" . | quote }}}\n'
    )
    args = ["template", "diloco", str(chart), "--namespace", NAMESPACE]
    if values:
        (tmp_path / "values.yaml").write_text(yaml.safe_dump(values))
        args += ["--values", str(tmp_path / "values.yaml")]
    result = helm.run(*args, "--show-only", "templates/notes-preview.yaml")
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)["data"]["notes"]


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        (None, ["kubectl get dilocojobs -A", "every namespace"]),
        (
            {"watchNamespaces": ["team-a"], "rbac": {"scope": "namespace"}},
            ["kubectl get dilocojobs -n team-a", "kubectl apply -n team-a", "in: team-a"],
        ),
    ],
    ids=["cluster", "namespace"],
)
def test_notes_should_tell_next_steps_when_installed(
    helm: Helm, tmp_path: Path, values: dict[str, Any] | None, expected: list[str]
) -> None:
    notes = render_notes(helm, tmp_path, values)
    assert "rollout status deployment/diloco-diloco-operator" in notes
    assert "-f examples/job.yaml" in notes
    assert (REPO / "examples" / "job.yaml").exists(), "NOTES point at a missing example"
    assert "kubectl describe dj" in notes
    for text in expected:
        assert text in notes, notes


def _undocumented_keys(lines: list[str]) -> list[str]:
    """Leaf keys of values.yaml that neither they nor an ancestor document with `# --`."""
    entries: list[tuple[str, bool]] = []  # (dotted key, covered by its own or an ancestor's doc)
    stack: list[tuple[int, str, bool]] = []  # (indent, key, covered)
    comments: list[str] = []
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("#"):
            comments.append(stripped)
            continue
        match = re.match(r"^( *)([A-Za-z][\w.-]*):", line)
        if not match:
            if not stripped:
                comments = []
            continue
        indent = len(match.group(1))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        covered = any(c.startswith("# --") for c in comments) or any(c for _, _, c in stack)
        key = ".".join([k for _, k, _ in stack] + [match.group(2)])
        entries.append((key, covered))
        stack.append((indent, match.group(2), covered))
        comments = []
    keys = [k for k, _ in entries]
    leaves = [(k, c) for k, c in entries if not any(o.startswith(k + ".") for o in keys)]
    return [k for k, covered in leaves if not covered]


def test_values_should_document_every_key_when_read() -> None:
    lines = (CHART / "values.yaml").read_text().splitlines()
    assert _undocumented_keys(lines) == []
    # The check itself catches an undocumented leaf.
    assert _undocumented_keys(["a:", "  # -- ok", "  b: 1", "  c: 2"]) == ["a.c"]
