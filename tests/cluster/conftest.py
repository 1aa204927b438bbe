"""Fixtures for the cluster tier: a real control plane started by hack/local-cluster.

etcd, kube-apiserver (RBAC), kube-controller-manager, kube-scheduler and kwok (fake nodes
whose pods become Running and Ready without containers) run as local processes on loopback.
The binaries are built once from pinned sources by hack/build-binaries.sh and cached.

Fixtures (pytest finds them here; test modules request them by name and import only helpers):
  k8s_bin_dir         session-scoped: the directory of the built binaries
  control_plane       session-scoped ControlPlane: .kubeconfig, .env, .bin_dir, .kubectl(...)
  make_control_plane  session-scoped factory: make_control_plane("region-b") starts (or
                      returns the already started) extra cluster with that name
  kubectl             the kubectl(*args) helper of control_plane
  namespace           a fresh namespace per test (deleted afterwards)
  crd                 session-scoped: the generated CRD, applied and Established
  cluster             query helpers (operator_helpers.Cluster) bound to the test's namespace
  operator            a running `diloco operator` watching the test's namespace
  make_local_syncer   factory: a real `diloco syncer` on loopback for a job manifest
  shared_syncer       session-scoped: one loopback syncer for the membership-only tests
  chart_operator_in   factory: the chart installed in a cluster, its operator running as the
                      chart's ServiceAccount
  kueue_plane         session-scoped: a control plane of its own with Kueue running in it
  kueue_cluster       query helpers bound to a fresh namespace of that cluster
  kueue_operator      a running `diloco operator` watching that namespace

ControlPlane, kubectl and polling come from hack/localcluster/harness.py, which the operator
benchmark shares; waits.py holds the tests' pytest-flavoured waits (a timeout fails the test),
control_planes.py the build and start-up behind the first three fixtures. The cluster is only
started when a test asks for one of the fixtures. If Go is missing or the build fails, the
fixture fails (never skips) with a message saying what is missing.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hack.localcluster import harness
from hack.localcluster.harness import ControlPlane

from .control_planes import (
    BUILD_TIMEOUT,
    UP_TIMEOUT,
    binaries_cached,
    ensure_binaries,
    start_control_plane,
    stop_control_plane,
)
from .kueue_helpers import KueuePlane
from .operator_helpers import (
    Cluster,
    LocalSyncer,
    OperatorProcess,
    create_token_secret,
    job_manifest,
    start_local_syncer,
)
from .region_helpers import (
    ChartOperator,
    ChartRelease,
    helm_for,
    operator_args,
    start_chart_operator,
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests of this directory `cluster`; give them time for a first build."""
    here = Path(__file__).parent
    mine = [item for item in items if here in Path(str(item.path)).parents]
    if not mine:
        return
    cached = binaries_cached()
    for item in mine:
        item.add_marker(pytest.mark.cluster)
        if not cached:
            # The session fixture's set-up (the build) counts against the first test's timeout.
            item.add_marker(pytest.mark.timeout(BUILD_TIMEOUT + UP_TIMEOUT + 300))


# ------------------------------------------------------------------------------ control planes


@pytest.fixture(scope="session")
def k8s_bin_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory of the control-plane binaries (built on the first run only)."""
    return ensure_binaries(request.config, tmp_path_factory.mktemp("build") / "build.log")


@pytest.fixture(scope="session")
def make_control_plane(
    k8s_bin_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[str], ControlPlane]]:
    """Factory: make_control_plane(name) starts a control plane (once per name per session)."""
    base = tmp_path_factory.mktemp("clusters", numbered=True)
    started: dict[str, ControlPlane] = {}

    def make(name: str) -> ControlPlane:
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,30}[a-z0-9])?", name):
            raise ValueError(f"cluster name must be a short DNS label, got {name!r}")
        if name in started:
            return started[name]
        cp = start_control_plane(name, base, k8s_bin_dir)
        started[name] = cp
        return cp

    yield make
    for cp in reversed(list(started.values())):
        stop_control_plane(cp)


@pytest.fixture(scope="session")
def control_plane(make_control_plane: Callable[[str], ControlPlane]) -> ControlPlane:
    """The main local control plane of the test session."""
    return make_control_plane("main")


@pytest.fixture(scope="session")
def kubectl(control_plane: ControlPlane) -> Callable[..., subprocess.CompletedProcess[str]]:
    """kubectl(*args, check=True, input=None) against control_plane."""
    return control_plane.kubectl


@pytest.fixture
def namespace(control_plane: ControlPlane, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace for one test, deleted (without waiting) afterwards."""
    name = control_plane.create_namespace(request.node.name)
    yield name
    control_plane.delete_namespace(name)


# ------------------------------------------------------------------------------ the operator


@pytest.fixture(scope="session")
def crd(control_plane: ControlPlane) -> Path:
    """The generated CRD, applied with real kubectl and Established."""
    return control_plane.install_crd(harness.CRD_FILE, timeout="180s")


@pytest.fixture
def cluster(control_plane: ControlPlane, namespace: str, crd: Path) -> Cluster:
    """Query helpers bound to this test's namespace (CRD installed)."""
    return Cluster(control_plane, namespace)


@pytest.fixture
def operator(
    control_plane: ControlPlane, namespace: str, crd: Path, tmp_path: Path
) -> Iterator[OperatorProcess]:
    """A running operator watching this test's namespace; its log tail is shown on failure
    (the whole log with DILOCO_SHOW_OPERATOR_LOG=1)."""
    env = {**control_plane.env, "PYTHONUNBUFFERED": "1"}
    op = OperatorProcess(env=env, namespace=namespace, log_file=tmp_path / "operator.log")
    op.start()
    yield op
    op.stop()
    # pytest shows teardown output only for failing tests: the operator's side of the story.
    lines = op.log_text().splitlines()
    full = os.environ.get("DILOCO_SHOW_OPERATOR_LOG")
    print("\n".join(lines if full else lines[-60:]))


# ------------------------------------------------------------------------------ loopback syncers


@pytest.fixture
def make_local_syncer(cluster: Cluster, tmp_path: Path) -> Iterator[Callable[..., LocalSyncer]]:
    """make_local_syncer(job_manifest, tls=False) -> LocalSyncer serving that job's spec.

    With tls=True it serves HTTPS with a self-signed certificate (the `cert` attribute).

    Also creates the Secret `NAME-shared-token` holding its token; point the job at it with
    `syncer: {endpoint: syncer.url, tokenSecretName: syncer.secret_name}`.
    """
    started: list[LocalSyncer] = []

    def make(manifest: dict[str, Any], tls: bool = False) -> LocalSyncer:
        syncer = start_local_syncer(manifest, tmp_path / f"syncer-{len(started)}", tls=tls)
        started.append(syncer)
        create_token_secret(cluster.cp, cluster.ns, syncer.secret_name, syncer.token)
        return syncer

    yield make
    for syncer in started:
        syncer.stop()


@pytest.fixture(scope="session")
def shared_syncer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSyncer]:
    """One real syncer for the tests that only need island membership (no training).

    Jobs of different tests use different island names (spec.islands.namePrefix), so they never
    see each other's islands; each test stores `.token` in its namespace as `.secret_name`.
    The syncer admits only its job's island names: serving it as one region of a multi-region
    job (totalShards 64) admits other prefixes' island-0..63, as a region's syncer does.
    """
    manifest = job_manifest("shared", islands={"count": 1, "totalShards": 64})
    started = start_local_syncer(manifest, tmp_path_factory.mktemp("shared-syncer"))
    yield started
    started.stop()


# ------------------------------------------------------------------------------ the chart


@pytest.fixture
def chart_operator_in(
    tmp_path: Path,
) -> Iterator[Callable[[ControlPlane, str], ChartOperator]]:
    """chart_operator_in(cp, jobs_namespace) -> ChartOperator: the chart installed in `cp` (its
    own release namespace, watching `jobs_namespace`) and its operator running as the chart's
    ServiceAccount. Teardown stops the operator and uninstalls the release.
    """
    started: list[tuple[ControlPlane, ChartRelease, ChartOperator | None]] = []

    def make(cp: ControlPlane, jobs_namespace: str) -> ChartOperator:
        home = tmp_path / f"chart-{cp.name}"
        release_ns = cp.create_namespace("diloco-system")
        release = ChartRelease(
            helm_for(cp, home / "helm"),
            cp,
            name="diloco",
            namespace=release_ns,
            values={"watchNamespaces": [jobs_namespace]},
        )
        started.append((cp, release, None))
        release.install()
        op = start_chart_operator(
            cp,
            args=operator_args(release.manifest()),
            namespace=release_ns,
            serviceaccount=release.service_account(),
            workdir=home,
        )
        started[-1] = (cp, release, op)
        return op

    yield make
    for cp, release, op in reversed(started):
        if op is not None:
            op.stop()
        release.uninstall()
        cp.delete_namespace(release.namespace)


# ------------------------------------------------------------------------------ Kueue


@pytest.fixture(scope="session")
def kueue_plane(make_control_plane: Callable[[str], ControlPlane]) -> KueuePlane:
    """A control plane of its own ("kueue": Kueue's webhooks see every pod created in it) with
    Kueue installed from its pinned module and its manager running (stopped with the cluster),
    and the DiLoCoJob CRD."""
    cp = make_control_plane("kueue")
    try:
        manager = harness.start_kueue(cp.dir)
    except Exception as e:  # ClusterError: the message says what is missing
        log = cp.logs_dir / "kueue.log"
        tail = harness.tail_lines(log.read_text()) if log.exists() else ""
        pytest.fail(f"starting Kueue failed: {e}\n{tail}")
    cp.install_crd(harness.CRD_FILE, timeout="180s")
    return KueuePlane(cp, manager)


@pytest.fixture
def kueue_cluster(kueue_plane: KueuePlane, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """Query helpers bound to a fresh namespace of the Kueue cluster (deleted afterwards)."""
    name = kueue_plane.cp.create_namespace(request.node.name)
    yield Cluster(kueue_plane.cp, name)
    kueue_plane.cp.delete_namespace(name)


@pytest.fixture
def kueue_operator(kueue_cluster: Cluster, tmp_path: Path) -> Iterator[OperatorProcess]:
    """A running operator watching the Kueue cluster's test namespace (log tail on failure)."""
    env = {**kueue_cluster.cp.env, "PYTHONUNBUFFERED": "1"}
    op = OperatorProcess(env=env, namespace=kueue_cluster.ns, log_file=tmp_path / "operator.log")
    op.start()
    yield op
    op.stop()
    print("\n".join(op.log_text().splitlines()[-80:]))
