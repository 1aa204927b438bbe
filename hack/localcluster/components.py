"""The control-plane binaries, each component's command line, and starting them in order."""

from __future__ import annotations

import os
import shutil
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

from .errors import ClusterError, info
from .pki import CLIENTS, kubeconfig_yaml, make_pki
from .processes import wait_for
from .settings import (
    APISERVER_TIMEOUT,
    BINARIES,
    BUILD_SCRIPT,
    COMPONENT_TIMEOUT,
    ETCD_TIMEOUT,
    KWOK_NODE_ANNOTATION,
    KWOK_STAGES,
    POD_CIDR,
    SA_ISSUER,
    SERVICE_CIDR,
)
from .state import Cluster

Ports = Mapping[str, int]


def resolve_bin_dir() -> Path:
    """hack/build-binaries.sh (at once when cached) or DILOCO_K8S_BIN_DIR: the control plane's."""
    return built_bin_dir(BUILD_SCRIPT, "DILOCO_K8S_BIN_DIR", BINARIES, "control-plane binaries")


def built_bin_dir(script: Path, override: str, binaries: Sequence[str], what: str) -> Path:
    """The directory the environment variable `override` names, else the one `bash SCRIPT`
    prints last (the build scripts return at once when everything is cached); each of
    `binaries` must be an executable there. `what` names them in errors."""
    given = os.environ.get(override)
    bin_dir = Path(given) if given else run_build_script(script, what)
    missing = [b for b in binaries if not os.access(bin_dir / b, os.X_OK)]
    if missing:
        raise ClusterError(f"missing {what} in {bin_dir}: {', '.join(missing)}", "build")
    return bin_dir


def run_build_script(script: Path, what: str) -> Path:
    """Run a hack/ build script (its progress lines pass through on stderr): its bin dir."""
    if not script.exists():
        raise ClusterError(f"missing {script}")
    try:
        proc = subprocess.run(
            ["bash", str(script)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            text=True,
        )
    except FileNotFoundError as e:
        raise ClusterError(f"bash is required to run hack/{script.name}") from e
    if proc.returncode != 0:
        raise ClusterError(
            f"building the {what} failed (hack/{script.name} exit {proc.returncode}); "
            "see its output above",
            "build",
        )
    lines = proc.stdout.strip().splitlines()
    if not lines:
        raise ClusterError(f"hack/{script.name} printed no bin dir", "build")
    return Path(lines[-1])


# --------------------------------------------------------------------------- arguments


def etcd_argv(directory: Path, ports: Ports, bin_dir: Path) -> list[str]:
    etcd_url = f"http://127.0.0.1:{ports['etcd']}"
    peer_url = f"http://127.0.0.1:{ports['etcd_peer']}"
    return [
        str(bin_dir / "etcd"),
        "--name=local",
        f"--data-dir={directory / 'etcd'}",
        f"--listen-client-urls={etcd_url}",
        f"--advertise-client-urls={etcd_url}",
        f"--listen-peer-urls={peer_url}",
        f"--initial-advertise-peer-urls={peer_url}",
        f"--initial-cluster=local={peer_url}",
        "--initial-cluster-state=new",
        # Test cluster: trade durability for speed.
        "--unsafe-no-fsync=true",
        "--quota-backend-bytes=4294967296",
        "--log-level=warn",
    ]


def apiserver_argv(
    directory: Path, ports: Ports, bin_dir: Path, advertise: str | None = None
) -> list[str]:
    """`advertise`: the real node's IP, so that pods reach the API through the `kubernetes`
    Service (its endpoint is the advertised address; loopback is not reachable from a pod)."""
    pki = directory / "pki"
    return [
        str(bin_dir / "kube-apiserver"),
        f"--etcd-servers=http://127.0.0.1:{ports['etcd']}",
        f"--bind-address={'0.0.0.0' if advertise else '127.0.0.1'}",
        f"--advertise-address={advertise or '127.0.0.1'}",
        f"--secure-port={ports['apiserver']}",
        f"--cert-dir={pki / 'apiserver-generated'}",
        f"--tls-cert-file={pki / 'apiserver.crt'}",
        f"--tls-private-key-file={pki / 'apiserver.key'}",
        f"--client-ca-file={pki / 'ca.crt'}",
        f"--service-account-issuer={SA_ISSUER}",
        f"--service-account-key-file={pki / 'sa.pub'}",
        f"--service-account-signing-key-file={pki / 'sa.key'}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--authorization-mode=Node,RBAC",
        "--allow-privileged=true",
        "--profiling=false",
        "--event-ttl=1h",
        "--v=1",
        *kubelet_client_flags(pki),
    ]


def kubelet_client_flags(pki: Path) -> list[str]:
    """With a real node (its certificates exist): the apiserver's client certificate for the
    kubelet's port, which `kubectl logs/exec` go through."""
    cert = pki / "apiserver-kubelet-client.crt"
    if not cert.exists():
        return []
    return [
        f"--kubelet-client-certificate={cert}",
        f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
        "--kubelet-preferred-address-types=InternalIP,Hostname",
    ]


def client_flags(directory: Path, name: str) -> list[str]:
    """The kubeconfig flags of a component that talks to the apiserver with its own cert."""
    kubeconfig = directory / f"{name}.kubeconfig"
    return [
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
    ]


def controller_manager_argv(directory: Path, ports: Ports, bin_dir: Path) -> list[str]:
    pki = directory / "pki"
    return [
        str(bin_dir / "kube-controller-manager"),
        *client_flags(directory, "kube-controller-manager"),
        "--bind-address=127.0.0.1",
        f"--secure-port={ports['controller_manager']}",
        f"--cert-dir={pki / 'controller-manager-generated'}",
        "--leader-elect=false",
        "--controllers=*",
        "--use-service-account-credentials=true",
        f"--service-account-private-key-file={pki / 'sa.key'}",
        f"--root-ca-file={pki / 'ca.crt'}",
        f"--cluster-signing-cert-file={pki / 'ca.crt'}",
        f"--cluster-signing-key-file={pki / 'ca.key'}",
        "--profiling=false",
        "--v=1",
    ]


def scheduler_argv(directory: Path, ports: Ports, bin_dir: Path) -> list[str]:
    return [
        str(bin_dir / "kube-scheduler"),
        *client_flags(directory, "kube-scheduler"),
        "--bind-address=127.0.0.1",
        f"--secure-port={ports['scheduler']}",
        f"--cert-dir={directory / 'pki' / 'scheduler-generated'}",
        "--leader-elect=false",
        "--profiling=false",
        "--v=1",
    ]


def kwok_argv(directory: Path, ports: Ports, bin_dir: Path) -> list[str]:
    return [
        str(bin_dir / "kwok"),
        f"--kubeconfig={directory / 'kwok.kubeconfig'}",
        f"--config={directory / 'kwok-stages.yaml'}",
        "--manage-all-nodes=false",
        f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}=fake",
        f"--cidr={POD_CIDR}",
        "--node-ip=10.0.0.1",
        "--node-lease-duration-seconds=40",
        f"--server-address=127.0.0.1:{ports['kwok']}",
    ]


def component_argv(
    directory: Path, ports: Ports, bin_dir: Path, advertise: str | None = None
) -> dict[str, list[str]]:
    """Every component's command line, in start order (settings.COMPONENTS)."""
    return {
        "etcd": etcd_argv(directory, ports, bin_dir),
        "kube-apiserver": apiserver_argv(directory, ports, bin_dir, advertise),
        "kube-controller-manager": controller_manager_argv(directory, ports, bin_dir),
        "kube-scheduler": scheduler_argv(directory, ports, bin_dir),
        "kwok": kwok_argv(directory, ports, bin_dir),
    }


# --------------------------------------------------------------------------- health


def https_ok(url: str, ctx: ssl.SSLContext) -> bool:
    try:
        with urllib.request.urlopen(url, context=ctx, timeout=3) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ssl.SSLError):
        return False


def insecure_ctx() -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


class Health(NamedTuple):
    """How `up` knows a component is ready: a URL that answers 200, within a deadline."""

    url: str
    what: str
    timeout: float
    admin: bool = False  # the apiserver checks the admin client certificate


def health_checks(ports: Ports) -> dict[str, Health]:
    """Each component's readiness check, in start order."""
    return {
        "etcd": Health(
            f"http://127.0.0.1:{ports['etcd']}/health", "etcd to report healthy", ETCD_TIMEOUT
        ),
        "kube-apiserver": Health(
            f"https://127.0.0.1:{ports['apiserver']}/readyz",
            "kube-apiserver /readyz",
            APISERVER_TIMEOUT,
            admin=True,
        ),
        "kube-controller-manager": Health(
            f"https://127.0.0.1:{ports['controller_manager']}/healthz",
            "kube-controller-manager /healthz",
            COMPONENT_TIMEOUT,
        ),
        "kube-scheduler": Health(
            f"https://127.0.0.1:{ports['scheduler']}/healthz",
            "kube-scheduler /healthz",
            COMPONENT_TIMEOUT,
        ),
        "kwok": Health(
            f"http://127.0.0.1:{ports['kwok']}/healthz", "kwok /healthz", COMPONENT_TIMEOUT
        ),
    }


def budget(c: Cluster, timeout: float) -> float:
    """A wait's deadline: its own timeout, cut to what is left of the whole `up`."""
    if c.deadline is None:
        return timeout
    return max(1.0, min(timeout, c.deadline - time.monotonic()))


def start_and_wait(
    c: Cluster, name: str, argv: list[str], ready: Callable[[], bool], what: str, timeout: float
) -> None:
    info(f"starting {name}...")
    c.start(name, argv)
    wait_for(what, ready, budget(c, timeout), component=name, alive=c.check_alive)


def start_components(c: Cluster, bin_dir: Path) -> None:
    """Start every component in order, each once the previous one reports healthy."""
    ports = c.state["ports"]
    argv = component_argv(c.dir, ports, bin_dir, c.state.get("advertise_address"))
    insecure, admin = insecure_ctx(), c.ssl_context()
    for name, check in health_checks(ports).items():
        ctx = admin if check.admin else insecure

        def ready(url: str = check.url, ctx: ssl.SSLContext = ctx) -> bool:
            return https_ok(url, ctx)

        start_and_wait(c, name, argv[name], ready, check.what, check.timeout)


def write_client_files(c: Cluster, name: str) -> None:
    """Certificates, one kubeconfig per client, and kwok's stages, all in c.dir."""
    info(f"creating certificates in {c.pki}")
    make_pki(c.pki)
    for user in CLIENTS:
        text = kubeconfig_yaml(
            name,
            c.server,
            c.pki / "ca.crt",
            user,
            cert=c.pki / f"{user}.crt",
            key=c.pki / f"{user}.key",
        )
        path = c.kubeconfig if user == "admin" else c.dir / f"{user}.kubeconfig"
        path.write_text(text)
        os.chmod(path, 0o600)
    shutil.copyfile(KWOK_STAGES, c.dir / "kwok-stages.yaml")
