"""Fixtures for the node tier: the local control plane with one real node (`up --real-node`).

The real node runs containerd + runc, the kubelet, kube-proxy (iptables) and CoreDNS on this
machine (root only, one per machine), built by hack/build-node.sh; the control plane's binaries
come from hack/build-binaries.sh. Both scripts return at once when their cache is full and
otherwise build with progress lines on the terminal (`make node binaries` does it before
pytest). There is no registry: images are OCI archives made here and loaded with
`hack/local-cluster load-image`.

Fixtures:
  node_cluster   session-scoped ControlPlane with real-node-0 Ready (and one kwok node)
  busybox_image  session-scoped: the name of a static-busybox image loaded into the node
  node_ns        a fresh namespace per test (deleted afterwards)
  node_images    session-scoped: the operator and trainer images of hack/build-images.sh (or of
                 the directory DILOCO_NODE_IMAGES_DIR names), loaded into the node

What is missing (root, Go, a host tool, a build) fails the tests with a message; they never
skip.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from hack.localcluster import harness
from hack.localcluster.harness import ControlPlane
from hack.localcluster.ociimage import busybox_image as busybox_spec
from hack.localcluster.ociimage import write_archive

from .builds import run_build, say

REPO_ROOT = Path(__file__).resolve().parents[2]
BUSYBOX = Path(os.environ.get("DILOCO_BUSYBOX", "/bin/busybox"))
BUSYBOX_IMAGE = "localhost/diloco/busybox:node-tests"
APPLETS = [
    "sh",
    "echo",
    "cat",
    "sleep",
    "mkdir",
    "nslookup",
    "nc",
    "printf",
    "httpd",
    "id",
    "hostname",
]
UP_TIMEOUT = float(os.environ.get("DILOCO_K8S_UP_TIMEOUT", "600"))


@pytest.fixture(scope="session")
def node_cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ControlPlane]:
    if os.geteuid() != 0:
        pytest.fail("the node tier needs root: containerd, runc, iptables and cgroups")
    if shutil.which("openssl") is None:
        pytest.fail("the node tier needs `openssl` to create the cluster certificates")
    base = tmp_path_factory.mktemp("node")
    bin_dir = run_build(request.config, "build-binaries.sh", base / "build-binaries.log")
    node_bin = run_build(request.config, "build-node.sh", base / "build-node.log")
    os.environ["DILOCO_NODE_BIN_DIR"] = str(node_bin)
    try:
        cp, retried = harness.start_control_plane(
            base / "real",
            name="real",
            nodes=1,
            attempts=2,
            timeout=UP_TIMEOUT,
            bin_dir=bin_dir,
            extra_args=("--real-node",),
        )
    except harness.ClusterStartError as e:
        pytest.fail(str(e))
    if retried:
        say(request.config, "local-cluster up --real-node needed retries: " + "; ".join(retried))
    yield cp
    warning = harness.stop_control_plane(cp, keep_logs=True)
    assert warning is None, warning


@pytest.fixture(scope="session")
def busybox_image(node_cluster: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A static busybox (Debian's busybox-static) as an OCI archive, loaded into the node."""
    if not BUSYBOX.is_file():
        pytest.fail(
            f"the node tier needs a static busybox at {BUSYBOX}: `make node` installs it "
            "(Debian's busybox-static)"
        )
    archive = write_archive(
        busybox_spec(BUSYBOX, BUSYBOX_IMAGE, APPLETS),
        tmp_path_factory.mktemp("images") / "busybox.tar",
    )
    result = harness.run_local_cluster("load-image", "--dir", str(node_cluster.dir), str(archive))
    assert result.returncode == 0, result.stderr
    return BUSYBOX_IMAGE


@pytest.fixture
def node_ns(node_cluster: ControlPlane, request: pytest.FixtureRequest) -> Iterator[str]:
    name = node_cluster.create_namespace(request.node.name)
    yield name
    node_cluster.delete_namespace(name)


@pytest.fixture(scope="session")
def node_images(
    request: pytest.FixtureRequest,
    node_cluster: ControlPlane,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, str]:
    """The operator and trainer images (hack/build-images.sh: instant when its cache holds the
    current sources; DILOCO_NODE_IMAGES_DIR names an already built directory instead), loaded
    into the node; {"operator": name, "trainer": name}."""
    given = os.environ.get("DILOCO_NODE_IMAGES_DIR")
    if given:
        image_dir = Path(given)
    else:
        image_dir = run_build(
            request.config,
            "build-images.sh",
            tmp_path_factory.mktemp("images") / "build-images.log",
        )
    names = dict(
        line.split("=", 1)
        for line in (image_dir / "images.env").read_text().splitlines()
        if "=" in line
    )
    for which in ("operator", "trainer"):
        result = harness.run_local_cluster(
            "load-image",
            "--dir",
            str(node_cluster.dir),
            str(image_dir / f"{which}.tar"),
            timeout=600,
        )
        assert result.returncode == 0, f"load-image {which}.tar failed:\n{result.stderr}"
    return {"operator": names["OPERATOR_IMAGE"], "trainer": names["TRAINER_IMAGE"]}
