"""Fixtures for the chart tests: a real `helm` binary and helpers that render the chart.

helm is located like the other Kubernetes binaries of the project: $DILOCO_K8S_BIN_DIR when set,
otherwise the cache directory of hack/build-binaries.sh, which builds it from pinned sources on
first use. A helm that cannot be found or built fails the tests; it never skips them.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "diloco-operator"
BUILD_SCRIPT = REPO / "hack" / "build-binaries.sh"
RELEASE = "diloco"
NAMESPACE = "diloco-system"
# Building every control-plane binary on a 2-core machine can take half an hour (first run only).
BUILD_TIMEOUT_S = 3600


def _helm_cached() -> bool:
    """True when helm is already built (or given through DILOCO_K8S_BIN_DIR)."""
    override = os.environ.get("DILOCO_K8S_BIN_DIR")
    if override:
        return os.access(Path(override) / "helm", os.X_OK)
    printed = subprocess.run(
        ["bash", str(BUILD_SCRIPT), "--print-bin-dir"], capture_output=True, text=True, check=False
    )
    lines = printed.stdout.strip().splitlines()
    return printed.returncode == 0 and bool(lines) and os.access(Path(lines[-1]) / "helm", os.X_OK)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give the chart tests time for a first build of helm (the project timeout is 900 s)."""
    here = Path(__file__).parent
    mine = [item for item in items if here in Path(str(item.path)).parents]
    if mine and not _helm_cached():
        for item in mine:
            item.add_marker(pytest.mark.timeout(BUILD_TIMEOUT_S + 300))


def locate_helm() -> Path:
    """Return the path of the pinned helm binary, building it with hack/build-binaries.sh if needed.

    Raises RuntimeError with the reason when helm can neither be found nor built.
    """
    override = os.environ.get("DILOCO_K8S_BIN_DIR")
    if override:
        helm = Path(override) / "helm"
        if not os.access(helm, os.X_OK):
            raise RuntimeError(f"DILOCO_K8S_BIN_DIR={override} has no executable helm")
        return helm
    printed = subprocess.run(
        ["bash", str(BUILD_SCRIPT), "--print-bin-dir"],
        capture_output=True,
        text=True,
        check=False,
    )
    if printed.returncode != 0:
        raise RuntimeError(f"{BUILD_SCRIPT} --print-bin-dir failed: {printed.stderr.strip()}")
    helm = Path(printed.stdout.strip().splitlines()[-1]) / "helm"
    if os.access(helm, os.X_OK):
        return helm
    # Not cached yet: build (its log goes to our stderr so a long first build shows progress).
    try:
        built = subprocess.run(
            ["bash", str(BUILD_SCRIPT)],
            stdout=subprocess.PIPE,
            text=True,
            timeout=BUILD_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{BUILD_SCRIPT} did not finish in {BUILD_TIMEOUT_S}s") from None
    if built.returncode != 0:
        raise RuntimeError(f"{BUILD_SCRIPT} failed (exit {built.returncode}); see its log above")
    if not os.access(helm, os.X_OK):
        raise RuntimeError(f"{BUILD_SCRIPT} finished but {helm} is missing")
    return helm


@dataclass(frozen=True)
class Helm:
    """A helm binary and the environment it runs in."""

    path: Path
    env: dict[str, str]

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        """Run helm with these arguments; the result carries returncode, stdout and stderr."""
        return subprocess.run(
            [str(self.path), *args], capture_output=True, text=True, env=self.env, timeout=120
        )


@pytest.fixture(scope="session")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    """The helm binary, with its config/cache/data homes in a temp dir (nothing of the user's)."""
    try:
        path = locate_helm()
    except RuntimeError as err:
        pytest.fail(f"helm is needed for the chart tests and could not be located or built: {err}")
    home = tmp_path_factory.mktemp("helm-home")
    env = dict(os.environ)
    for key in ("HELM_CONFIG_HOME", "HELM_CACHE_HOME", "HELM_DATA_HOME"):
        env[key] = str(home / key.lower())
    return Helm(path, env)


@dataclass(frozen=True)
class Rendered:
    """The parsed documents of one `helm template` run."""

    docs: list[dict[str, Any]]

    def kinds(self) -> list[str]:
        """Kinds of every document, in render order."""
        return [d["kind"] for d in self.docs]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        """Every document of this kind."""
        return [d for d in self.docs if d["kind"] == kind]

    def one(self, kind: str, name: str | None = None) -> dict[str, Any]:
        """The single document of this kind (and name); fails the test when not exactly one."""
        found = [d for d in self.of_kind(kind) if name is None or d["metadata"]["name"] == name]
        assert len(found) == 1, f"want one {kind} {name or ''}, got {len(found)}: {self.kinds()}"
        return found[0]


def _values_args(tmp_path: Path, values: dict[str, Any] | None) -> list[str]:
    if values is None:
        return []
    path = tmp_path / f"values-{len(list(tmp_path.glob('values-*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(values))
    return ["--values", str(path)]


@pytest.fixture
def render(helm: Helm, tmp_path: Path) -> Callable[..., Rendered]:
    """render(values=None, *extra_args) -> Rendered: `helm template` that must succeed."""

    def _render(values: dict[str, Any] | None = None, *extra: str) -> Rendered:
        result = helm.run(
            "template",
            RELEASE,
            str(CHART),
            "--namespace",
            NAMESPACE,
            *_values_args(tmp_path, values),
            *extra,
        )
        assert result.returncode == 0, f"helm template failed:\n{result.stderr}"
        docs = [d for d in yaml.safe_load_all(result.stdout) if d]
        return Rendered(docs)

    return _render


@pytest.fixture
def render_error(helm: Helm, tmp_path: Path) -> Callable[..., str]:
    """render_error(values) -> str: `helm template` that must fail; returns its error output."""

    def _render_error(values: dict[str, Any]) -> str:
        result = helm.run(
            "template",
            RELEASE,
            str(CHART),
            "--namespace",
            NAMESPACE,
            *_values_args(tmp_path, values),
        )
        assert result.returncode != 0, f"helm template accepted {values}:\n{result.stdout[:2000]}"
        return result.stderr

    return _render_error


@pytest.fixture
def chart_meta() -> dict[str, Any]:
    """Chart.yaml, parsed."""
    return yaml.safe_load((CHART / "Chart.yaml").read_text())
