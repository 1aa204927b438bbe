"""The cluster's certificates (made with the openssl CLI) and kubeconfigs.

Layout of DIR/pki: ca.crt/ca.key (the cluster CA, also the CSR signer), one certificate and key
per entry of LEAVES, and sa.key/sa.pub (service-account token signing). Keys are mode 0600, the
directory 0700.
"""

from __future__ import annotations

import base64
import os
import shutil
from pathlib import Path
from typing import NamedTuple

from .errors import ClusterError
from .processes import run
from .settings import NODE_NAME, SERVICE_FIRST_IP

EC_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
APISERVER_SANS = [
    "IP:127.0.0.1",
    f"IP:{SERVICE_FIRST_IP}",
    "DNS:localhost",
    "DNS:kubernetes",
    "DNS:kubernetes.default",
    "DNS:kubernetes.default.svc",
    "DNS:kubernetes.default.svc.cluster.local",
]


class Leaf(NamedTuple):
    """One certificate signed by the cluster CA."""

    name: str  # file stem in DIR/pki
    subject: str
    usage: str  # extendedKeyUsage
    san: str | None = None


LEAVES = [
    Leaf("apiserver", "/CN=kube-apiserver", "serverAuth", ",".join(APISERVER_SANS)),
    Leaf("admin", "/O=system:masters/CN=kubernetes-admin", "clientAuth"),
    Leaf("kube-controller-manager", "/CN=system:kube-controller-manager", "clientAuth"),
    Leaf("kube-scheduler", "/CN=system:kube-scheduler", "clientAuth"),
    # kwok acts as the kubelet of every fake node (nodes, leases, pod status, deletes).
    Leaf("kwok", "/O=system:masters/CN=kwok", "clientAuth"),
]
# The real node's clients (`up --real-node` only): kubelet (Node authorizer), kube-proxy
# (bound to system:node-proxier by default), CoreDNS (diloco:coredns), and the apiserver's
# client certificate for the kubelet's port (logs, exec).
NODE_LEAVES = [
    Leaf("kubelet", f"/O=system:nodes/CN=system:node:{NODE_NAME}", "clientAuth"),
    Leaf("kube-proxy", "/CN=system:kube-proxy", "clientAuth"),
    Leaf("coredns", "/CN=system:coredns", "clientAuth"),
    Leaf(
        "apiserver-kubelet-client",
        "/O=system:masters/CN=kube-apiserver-kubelet-client",
        "clientAuth",
    ),
]
# The clients that get a kubeconfig with their own certificate (admin's is DIR/kubeconfig).
CLIENTS = ["admin", "kube-controller-manager", "kube-scheduler", "kwok"]


def openssl(*args: str) -> None:
    run(["openssl", *args])


def leaf_extensions(leaf: Leaf) -> str:
    """The openssl extension file of one leaf certificate."""
    lines = [
        "basicConstraints=critical,CA:FALSE",
        "keyUsage=critical,digitalSignature,keyEncipherment",
        f"extendedKeyUsage={leaf.usage}",
    ]
    if leaf.san:
        lines.append(f"subjectAltName={leaf.san}")
    return "\n".join(lines) + "\n"


def make_ca(pki: Path) -> None:
    openssl(
        "req", "-x509", *EC_KEY,
        "-keyout", str(pki / "ca.key"), "-out", str(pki / "ca.crt"),
        "-days", "3650", "-subj", "/CN=diloco-local-cluster-ca",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
    )  # fmt: skip


def make_leaf(pki: Path, leaf: Leaf) -> None:
    csr = pki / f"{leaf.name}.csr"
    openssl(
        "req", "-new", *EC_KEY,
        "-keyout", str(pki / f"{leaf.name}.key"), "-out", str(csr), "-subj", leaf.subject,
    )  # fmt: skip
    ext = pki / f"{leaf.name}.ext"
    ext.write_text(leaf_extensions(leaf))
    openssl(
        "x509", "-req", "-in", str(csr),
        "-CA", str(pki / "ca.crt"), "-CAkey", str(pki / "ca.key"), "-CAcreateserial",
        "-days", "3650", "-sha256", "-extfile", str(ext), "-out", str(pki / f"{leaf.name}.crt"),
    )  # fmt: skip
    csr.unlink()
    ext.unlink()


def make_pki(pki: Path) -> None:
    if shutil.which("openssl") is None:
        raise ClusterError(
            "openssl is required to create the cluster certificates (apt-get install openssl)"
        )
    pki.mkdir(parents=True, exist_ok=True)
    os.chmod(pki, 0o700)
    make_ca(pki)
    for leaf in LEAVES:
        make_leaf(pki, leaf)
    # Service-account token signing key pair.
    openssl("genrsa", "-out", str(pki / "sa.key"), "2048")
    openssl("rsa", "-in", str(pki / "sa.key"), "-pubout", "-out", str(pki / "sa.pub"))
    for key in pki.glob("*.key"):
        os.chmod(key, 0o600)


def make_node_pki(pki: Path, node_ip: str) -> None:
    """The real node's client certificates, signed by the cluster CA made by make_pki, and the
    apiserver's serving certificate again with the node's IP (the `kubernetes` Service's
    endpoint once the apiserver advertises it)."""
    sans = ",".join([*APISERVER_SANS, f"IP:{node_ip}"])
    for leaf in [Leaf("apiserver", "/CN=kube-apiserver", "serverAuth", sans), *NODE_LEAVES]:
        make_leaf(pki, leaf)
        os.chmod(pki / f"{leaf.name}.key", 0o600)


def b64file(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def kubeconfig_yaml(
    name: str,
    server: str,
    ca: Path,
    user: str,
    *,
    cert: Path | None = None,
    key: Path | None = None,
    token: str | None = None,
    namespace: str | None = None,
) -> str:
    if token is not None:
        user_fields = f"    token: {token}\n"
    else:
        assert cert is not None and key is not None
        user_fields = (
            f"    client-certificate-data: {b64file(cert)}\n    client-key-data: {b64file(key)}\n"
        )
    ns = f"    namespace: {namespace}\n" if namespace else ""
    return (
        "apiVersion: v1\n"
        "kind: Config\n"
        "clusters:\n"
        f"- name: {name}\n"
        "  cluster:\n"
        f"    server: {server}\n"
        f"    certificate-authority-data: {b64file(ca)}\n"
        "users:\n"
        f"- name: {user}\n"
        "  user:\n"
        f"{user_fields}"
        "contexts:\n"
        f"- name: {name}\n"
        "  context:\n"
        f"    cluster: {name}\n"
        f"    user: {user}\n"
        f"{ns}"
        f"current-context: {name}\n"
    )
