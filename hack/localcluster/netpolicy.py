"""The real node's NetworkPolicy enforcer: kube-network-policies (sigs.k8s.io), a host process
started after the kubelet and stopped before it, its log in DIR/logs/network-policies.log.

What it does: it writes the nftables table `inet kube-network-policies`, whose postrouting chain
queues the first packet of every connection from or to a pod of this node that a NetworkPolicy
selects (nfqueue NFQUEUE_ID); it answers accept or drop after evaluating the policies on both
ends. Established connections, and packets sent by root processes of the node itself (the
kubelet's probes, the API server's proxy, a test on the host), are never queued (upstream's
rules). It runs fail-closed (no --fail-open): while it is not running, queued packets are
dropped, so a dead enforcer fails the tests instead of letting them pass unguarded. The kernels
of this project's machines lack nft_queue; hack/build-node.sh builds it to queue through
xtables' NFQUEUE target instead (same queue, same verdicts).

How it runs: it finds the API server only the in-cluster way (client-go's InClusterConfig: a
ServiceAccount token and CA at /var/run/secrets/kubernetes.io/serviceaccount, the address from
KUBERNETES_SERVICE_HOST/PORT). Rather than write that machine-wide path, it runs in a mount
namespace of its own (unshare) in which a tmpfs covers /run (= /var/run) and
DIR/node/network-policies is bound at that path; nothing else of /run is needed (NRI is off:
our containerd has it disabled). Its ServiceAccount kube-system/diloco-network-policies may list
and watch pods, namespaces and NetworkPolicies (upstream's install.yaml) and nothing else.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.error
from pathlib import Path
from typing import Any

from .errors import ClusterError, info
from .processes import pid_matches, wait_for
from .settings import NETWORK_POLICIES, NODE_NAME
from .state import Cluster

NAME = NETWORK_POLICIES
BINARY = "kube-network-policies"
TABLE = ("inet", "kube-network-policies")
# Any free queue number will do: one real node per machine, and nothing else here uses nfqueue.
NFQUEUE_ID = 98
SERVICE_ACCOUNT = ("kube-system", "diloco-network-policies")
# A year: the token is read once per minute by client-go; a local cluster never lives that long.
TOKEN_SECONDS = 365 * 24 * 3600
SA_MOUNT = "/run/secrets/kubernetes.io/serviceaccount"
# Runs as `sh -c SCRIPT netpol SA_DIR BINARY ARGS...` inside `unshare --mount`: private mounts,
# a tmpfs over /run and the credentials bound where InClusterConfig reads them.
MOUNT_SCRIPT = (
    "set -e; sa_dir=$1; shift; "
    "mount -t tmpfs -o mode=0755,size=1m diloco-netpol /run; "
    f'mkdir -p {SA_MOUNT}; mount --bind -o ro "$sa_dir" {SA_MOUNT}; '
    'exec "$@"'
)
STOP_TIMEOUT = 15.0  # it sleeps 5 s after SIGINT (its grace period), then deletes its table


def rbac_objects() -> list[tuple[str, dict[str, Any]]]:
    """(collection path, object): the enforcer's ServiceAccount, ClusterRole and binding."""
    ns, name = SERVICE_ACCOUNT
    role_name = f"diloco:{NAME}"
    account = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {"name": name, "namespace": ns},
    }
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": role_name},
        "rules": [
            {"apiGroups": [""], "resources": ["pods", "namespaces"], "verbs": ["list", "watch"]},
            {
                "apiGroups": ["networking.k8s.io"],
                "resources": ["networkpolicies"],
                "verbs": ["list", "watch"],
            },
        ],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": role_name},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": role_name,
        },
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ns}],
    }
    rbac = "/apis/rbac.authorization.k8s.io/v1"
    return [
        (f"/api/v1/namespaces/{ns}/serviceaccounts", account),
        (f"{rbac}/clusterroles", role),
        (f"{rbac}/clusterrolebindings", binding),
    ]


def enforcer_argv(unshare: str, bin_dir: Path, credentials: Path, metrics_port: int) -> list[str]:
    """The command line: the mount namespace's wrapper, then the enforcer's own flags."""
    return [
        unshare, "--mount", "--propagation", "private", "--",
        "sh", "-c", MOUNT_SCRIPT, "netpol", str(credentials),
        str(bin_dir / BINARY),
        f"--hostname-override={NODE_NAME}",
        f"--nfqueue-id={NFQUEUE_ID}",
        f"--metrics-bind-address=127.0.0.1:{metrics_port}",
        "--disable-nri",
        # Only kernels before 6.12 need DNS packets queued on prerouting too.
        "--netfilter-bug-1766-fix=false",
        "--v=2",
    ]  # fmt: skip


def request_token(c: Cluster) -> str:
    """A TokenRequest for the enforcer's ServiceAccount."""
    ns, name = SERVICE_ACCOUNT
    body = {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenRequest",
        "spec": {"expirationSeconds": TOKEN_SECONDS},
    }
    try:
        answer = c.api("POST", f"/api/v1/namespaces/{ns}/serviceaccounts/{name}/token", body)
    except urllib.error.HTTPError as e:
        raise ClusterError(
            f"requesting a token for {ns}/{name} failed: HTTP {e.code} {e.read()[:300]!r}",
            "kube-apiserver", retryable=True,
        ) from e  # fmt: skip
    return str(answer["status"]["token"])


def write_credentials(directory: Path, token: str, ca_file: Path) -> None:
    """What InClusterConfig reads: token, ca.crt and namespace, readable by root only."""
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    (directory / "token").write_text(token)
    (directory / "ca.crt").write_bytes(ca_file.read_bytes())
    (directory / "namespace").write_text(SERVICE_ACCOUNT[0])


def table_rules(nft: str) -> str:
    """`nft list table inet kube-network-policies`, or "" while there is none."""
    try:
        proc = subprocess.run(
            [nft, "list", "table", *TABLE], stdin=subprocess.DEVNULL, capture_output=True,
            text=True, timeout=20,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return proc.stdout if proc.returncode == 0 else ""


def start_network_policies(
    c: Cluster, root: Path, bin_dir: Path, tools: dict[str, str], metrics_port: int,
    timeout: float,
) -> None:  # fmt: skip
    """Start the enforcer (its credentials under ROOT; TOOLS: the paths of unshare and nft);
    return once its table queues to NFQUEUE_ID: its caches synced and the kernel took its
    rules."""
    binary = bin_dir / BINARY
    if not os.access(binary, os.X_OK):
        raise ClusterError(f"missing {binary}: `make node` (hack/build-node.sh) builds it", "build")
    credentials = root / "serviceaccount"
    write_credentials(credentials, request_token(c), c.pki / "ca.crt")
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin") + ":/usr/sbin:/sbin",
        "KUBERNETES_SERVICE_HOST": "127.0.0.1",
        "KUBERNETES_SERVICE_PORT": str(c.state["ports"]["apiserver"]),
    }
    info("starting kube-network-policies...")
    c.start(NAME, enforcer_argv(tools["unshare"], bin_dir, credentials, metrics_port), env=env)

    def alive() -> None:
        c.check_alive()
        if not c.running(NAME):
            raise ClusterError(f"{NAME} exited; see {c.logs / (NAME + '.log')}", NAME, True)

    wait_for(
        f"{NAME} to write its nftables table (queue num {NFQUEUE_ID})",
        lambda: f"queue num {NFQUEUE_ID}" in table_rules(tools["nft"]),
        timeout,
        component=NAME,
        alive=alive,
    )


def stop_network_policies(c: Cluster, nft: str) -> None:
    """SIGINT (it deletes its own table then), SIGTERM/SIGKILL if it does not end; then delete
    the table if it is still there: left behind, its queue rules would drop pod traffic."""
    record = c.processes().get(NAME)
    if record and pid_matches(record["pid"], record["exe"], record.get("start")):
        with contextlib.suppress(ProcessLookupError):
            os.kill(record["pid"], signal.SIGINT)
        deadline = time.monotonic() + STOP_TIMEOUT
        while time.monotonic() < deadline and c.running(NAME):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(record["pid"], os.WNOHANG)
            time.sleep(0.2)
    c.stop(NAME)
    if table_rules(nft):
        subprocess.run(
            [nft, "delete", "table", *TABLE], stdin=subprocess.DEVNULL, capture_output=True,
            timeout=20,
        )  # fmt: skip
