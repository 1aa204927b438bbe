"""helm for the tests: locating the pinned binary, running it, parsing what it renders.

helm is located like the other Kubernetes binaries of the project (tests/cluster/control_planes.py):
$DILOCO_K8S_BIN_DIR when set, otherwise the cache directory of hack/build-binaries.sh, which
builds every pinned binary from source on first use. Shared by tests/chart and tests/kind.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "diloco-operator"
BUILD_SCRIPT = REPO / "hack" / "build-binaries.sh"
# Building every control-plane binary on a 2-core machine can take half an hour (first run only).
BUILD_TIMEOUT_S = float(os.environ.get("DILOCO_K8S_BUILD_TIMEOUT", "3600"))


def cached_bin_dir() -> Path | None:
    """The directory that holds (or will hold) the pinned binaries; None if it cannot be told."""
    override = os.environ.get("DILOCO_K8S_BIN_DIR")
    if override:
        return Path(override)
    printed = subprocess.run(
        ["bash", str(BUILD_SCRIPT), "--print-bin-dir"], capture_output=True, text=True, check=False
    )
    lines = printed.stdout.strip().splitlines()
    return Path(lines[-1]) if printed.returncode == 0 and lines else None


def helm_cached() -> bool:
    """True when helm is already built (or given through DILOCO_K8S_BIN_DIR)."""
    bin_dir = cached_bin_dir()
    return bin_dir is not None and os.access(bin_dir / "helm", os.X_OK)


def locate_binary(name: str) -> Path:
    """Path of a pinned binary (helm, kubectl, ...), building them all first if it is missing.

    Raises RuntimeError saying why when it can neither be found nor built.
    """
    bin_dir = cached_bin_dir()
    if bin_dir is None:
        raise RuntimeError(f"{BUILD_SCRIPT} --print-bin-dir failed")
    path = bin_dir / name
    if os.access(path, os.X_OK):
        return path
    if os.environ.get("DILOCO_K8S_BIN_DIR"):
        raise RuntimeError(f"DILOCO_K8S_BIN_DIR={bin_dir} has no executable {name}")
    # First run: the build's progress goes to stderr, so a long build is visible with -s.
    print(f"building the pinned Kubernetes binaries for {name} (first run only)", file=sys.stderr)
    try:
        built = subprocess.run(
            ["bash", str(BUILD_SCRIPT)],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{BUILD_SCRIPT} did not finish within {BUILD_TIMEOUT_S:.0f}s") from None
    if built.returncode != 0:
        tail = "\n".join(built.stderr.strip().splitlines()[-30:])
        raise RuntimeError(f"{BUILD_SCRIPT} failed (exit {built.returncode}):\n{tail}")
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"{BUILD_SCRIPT} finished but {path} is missing")
    return path


@dataclass(frozen=True)
class Helm:
    """A helm binary and the environment it runs in."""

    path: Path
    env: dict[str, str]

    @classmethod
    def located(cls, home: Path, env: dict[str, str] | None = None) -> Helm:
        """The pinned helm, keeping its config, cache and data under `home` (not the user's)."""
        merged = dict(os.environ if env is None else env)
        for key in ("HELM_CONFIG_HOME", "HELM_CACHE_HOME", "HELM_DATA_HOME"):
            merged[key] = str(home / key.lower())
        return cls(locate_binary("helm"), merged)

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """Run helm with these arguments; the result carries returncode, stdout and stderr."""
        return subprocess.run(
            [str(self.path), *args], capture_output=True, text=True, env=self.env, timeout=timeout
        )


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
