"""Fixtures for the chart tests: the pinned `helm` and helpers that render the chart with it.

A helm that cannot be found or built fails the tests; it never skips them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from .helm_tool import BUILD_TIMEOUT_S, CHART, Helm, Rendered, helm_cached

RELEASE = "diloco"
NAMESPACE = "diloco-system"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give the chart tests time for a first build of helm (the project timeout is 900 s)."""
    here = Path(__file__).parent
    mine = [item for item in items if here in Path(str(item.path)).parents]
    if mine and not helm_cached():
        # The session fixture's set-up (the build) counts against the first test's timeout.
        for item in mine:
            item.add_marker(pytest.mark.timeout(BUILD_TIMEOUT_S + 300))


@pytest.fixture(scope="session")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    """The pinned helm, with its config/cache/data homes in a temp dir."""
    try:
        return Helm.located(tmp_path_factory.mktemp("helm-home"))
    except RuntimeError as err:
        pytest.fail(f"helm is needed for the chart tests and could not be located or built: {err}")


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
        args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
        result = helm.run(*args, *_values_args(tmp_path, values), *extra)
        assert result.returncode == 0, f"helm template failed:\n{result.stderr}"
        return Rendered([d for d in yaml.safe_load_all(result.stdout) if d])

    return _render


@pytest.fixture
def render_error(helm: Helm, tmp_path: Path) -> Callable[..., str]:
    """render_error(values) -> str: `helm template` that must fail; returns its error output."""

    def _render_error(values: dict[str, Any]) -> str:
        args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
        result = helm.run(*args, *_values_args(tmp_path, values))
        assert result.returncode != 0, f"helm template accepted {values}:\n{result.stdout[:2000]}"
        return result.stderr

    return _render_error


@pytest.fixture
def chart_meta() -> dict[str, Any]:
    """Chart.yaml, parsed."""
    return yaml.safe_load((CHART / "Chart.yaml").read_text())
