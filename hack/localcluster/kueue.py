"""Kueue in a local control plane: its CRDs, RBAC and webhooks from the pinned module, and its
manager run as one more process of the cluster (stopped by `down`, like every component).

hack/build-binaries.sh builds `cmd/kueue` at KUEUE_VERSION and copies the module's
config/components/{crd,rbac,webhook} beside it (`--print-kueue-dir`). From those files:

- the CRDs, with the conversion webhooks Kueue's CRD kustomization patches in;
- the manager's ClusterRole and its Role for the certificate Secret (rbac/, named as Kueue's
  kustomization names them), bound to the user of the manager's client certificate (signed by
  the cluster CA, pki.py): how a process outside the cluster authenticates;
- the mutating and validating webhook configurations, each webhook's Service reference
  replaced by the URL the manager serves on loopback, and the namespace selectors Kueue's
  kustomization patches in. The API server calls them as it calls any webhook outside the
  cluster.

Kueue manages its webhook certificate itself (internal certificate management, its default:
with it off, the manager insists on metrics certificates under /etc). Its rotator keeps the
certificate of its Secret while that one is valid for the webhook Service's name, so the Secret
is made here with a certificate for that name and for 127.0.0.1, from a CA of Kueue's own, and
its files are written where the webhook server reads them (a pod would mount the Secret there);
the rotator fills in the caBundles, as in a cluster.

The manager runs with the pod and StatefulSet integrations (the operator's islands are
StatefulSets), leader election off (one process), metrics and the visibility API server off
(nothing here reads them), and manageJobsWithoutQueueName false: only labelled objects are
Kueue's. kwok's nodes give it capacity. Standard library only, like the rest of the package:
the cluster's own kubectl reads the manifests' YAML (`create --dry-run=client -o json`).
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ClusterError, info
from .pki import Leaf, kubeconfig_yaml, make_leaf, openssl
from .ports import pick_ports
from .processes import wait_for
from .settings import BUILD_SCRIPT
from .state import Cluster

NAMESPACE = "kueue-system"
NAME_PREFIX = "kueue-"  # Kueue's kustomization prefixes every object's name
MANAGER_USER = "kueue-controller-manager"
# Kueue's internal certificate management (its default): the Secret its rotator keeps, the
# Service name its certificate is for, and the CA name the rotator checks its CA against.
WEBHOOK_SERVICE = NAME_PREFIX + "webhook-service"
WEBHOOK_SECRET = NAME_PREFIX + "webhook-server-cert"
WEBHOOK_DNS = f"{WEBHOOK_SERVICE}.{NAMESPACE}.svc"
KUEUE_CA = "kueue-ca"
PROCESS = "kueue"
FRAMEWORKS = ["pod", "statefulset"]
# Kueue's own kustomization keeps these webhooks out of the system namespaces.
SYSTEM_NAMESPACES = ["kube-system", NAMESPACE]
SELECTED_WEBHOOKS = {
    "mpod.kb.io",
    "mdeployment.kb.io",
    "mstatefulset.kb.io",
    "vpod.kb.io",
    "vdeployment.kb.io",
    "vstatefulset.kb.io",
}
READY_TIMEOUT = 180.0
CRD_TIMEOUT = 120.0
CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
WEBHOOK_PATHS = {
    "MutatingWebhookConfiguration": (
        "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"
    ),
    "ValidatingWebhookConfiguration": (
        "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations"
    ),
}


@dataclass(frozen=True)
class KueueManager:
    """A running Kueue manager of one local cluster."""

    cluster_dir: Path
    version: str
    webhook_port: int
    health_port: int
    log: Path


def resolve_kueue_dir() -> Path:
    """Kueue's directory (bin/kueue and config/): DILOCO_KUEUE_DIR, else the one
    hack/build-binaries.sh names (it builds Kueue with the control plane)."""
    given = os.environ.get("DILOCO_KUEUE_DIR")
    if given:
        path = Path(given)
    else:
        out = subprocess.run(
            ["bash", str(BUILD_SCRIPT), "--print-kueue-dir"],
            capture_output=True,
            text=True,
            check=False,
        )
        if out.returncode != 0:
            raise ClusterError(f"hack/build-binaries.sh --print-kueue-dir failed: {out.stderr}")
        path = Path(out.stdout.strip())
    if not os.access(path / "bin" / "kueue", os.X_OK) or not (path / "config/.complete").exists():
        raise ClusterError(
            f"Kueue is not built in {path} (bin/kueue and config/): run hack/build-binaries.sh "
            "(make binaries), or point DILOCO_KUEUE_DIR at such a directory",
            "build",
        )
    return path


def documents(c: Cluster, path: Path) -> list[dict[str, Any]]:
    """The objects of a YAML manifest, as JSON, read by the cluster's own kubectl."""
    kubectl = Path(c.state["bin_dir"]) / "kubectl"
    argv = [str(kubectl), f"--kubeconfig={c.kubeconfig}", "create", "--dry-run=client"]
    out = subprocess.run(
        [*argv, "-o", "json", "-f", str(path)], capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise ClusterError(f"kubectl could not read {path}: {out.stderr.strip()}", PROCESS)
    return json_stream(out.stdout)


def json_stream(text: str) -> list[dict[str, Any]]:
    """The objects of kubectl's JSON output: one object per document, one after the other
    (a List's items taken out)."""
    decoder, docs, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        if at == len(text):
            return docs
        doc, at = decoder.raw_decode(text, at)
        docs.extend(doc["items"] if doc.get("kind") == "List" else [doc])


def listed_patches(kustomization: Path) -> list[str]:
    """The `- path: ...` entries of a kustomization's (uncommented) patches."""
    paths = []
    for line in kustomization.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("- path:"):
            paths.append(stripped.removeprefix("- path:").strip())
    return paths


RBAC_API = "rbac.authorization.k8s.io"


def user_binding(kind: str, name: str, role: str, namespace: str = "") -> dict[str, Any]:
    """A (Cluster)RoleBinding of `role` to the manager's client certificate's user."""
    meta = {"name": name, **({"namespace": namespace} if namespace else {})}
    return {
        "apiVersion": f"{RBAC_API}/v1",
        "kind": kind,
        "metadata": meta,
        "roleRef": {"apiGroup": RBAC_API, "kind": kind.removesuffix("Binding"), "name": role},
        "subjects": [{"apiGroup": RBAC_API, "kind": "User", "name": MANAGER_USER}],
    }


def manager_rbac(c: Cluster, kueue_dir: Path) -> list[dict[str, Any]]:
    """The manager's ClusterRole and its Role for the certificate Secret from the module, each
    bound to our client certificate's user (the module binds them to the ServiceAccount of an
    in-cluster Deployment), named and placed as Kueue's kustomization does."""
    rbac = kueue_dir / "config/rbac"
    (role,) = [d for d in documents(c, rbac / "role.yaml") if d["kind"] == "ClusterRole"]
    role["metadata"] = {"name": NAME_PREFIX + role["metadata"]["name"]}
    (secrets,) = documents(c, rbac / "manager_secrets_role.yaml")
    secrets["metadata"] = {
        "name": NAME_PREFIX + secrets["metadata"]["name"],
        "namespace": NAMESPACE,
    }
    return [
        role,
        user_binding(
            "ClusterRoleBinding", NAME_PREFIX + "manager-rolebinding", role["metadata"]["name"]
        ),
        secrets,
        user_binding(
            "RoleBinding",
            NAME_PREFIX + "manager-secrets-rolebinding",
            secrets["metadata"]["name"],
            NAMESPACE,
        ),
    ]


def rbac_collection(obj: dict[str, Any]) -> str:
    kind = obj["kind"].lower() + "s"
    ns = obj["metadata"].get("namespace")
    return f"/apis/{RBAC_API}/v1" + (f"/namespaces/{ns}" if ns else "") + f"/{kind}"


def webhook_configurations(
    c: Cluster, kueue_dir: Path, port: int, ca_bundle: str
) -> list[dict[str, Any]]:
    """The module's webhook configurations, pointed at the manager on 127.0.0.1:`port`."""
    out = []
    for doc in documents(c, kueue_dir / "config/webhook/manifests.yaml"):
        if doc["kind"] not in WEBHOOK_PATHS:
            continue
        doc["metadata"] = {"name": NAME_PREFIX + doc["metadata"]["name"]}
        for hook in doc.get("webhooks") or []:
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}", "caBundle": ca_bundle}
            if hook["name"] in SELECTED_WEBHOOKS:
                hook["namespaceSelector"] = {
                    "matchExpressions": [
                        {
                            "key": "kubernetes.io/metadata.name",
                            "operator": "NotIn",
                            "values": list(SYSTEM_NAMESPACES),
                        }
                    ]
                }
        out.append(doc)
    return out


def manager_config(directory: Path, webhook_port: int, health_port: int) -> dict[str, Any]:
    """Kueue's Configuration for a manager outside the cluster (see the module docstring)."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": NAMESPACE,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": "0"},
        "webhook": {
            "port": webhook_port,
            "host": "127.0.0.1",
            "certDir": str(directory / "certs"),
        },
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {
            "enable": True,
            "webhookServiceName": WEBHOOK_SERVICE,
            "webhookSecretName": WEBHOOK_SECRET,
        },
        "manageJobsWithoutQueueName": False,
        "integrations": {"frameworks": list(FRAMEWORKS)},
        "featureGates": {"VisibilityOnDemand": False},
    }


def create_or_replace(c: Cluster, collection: str, obj: dict[str, Any]) -> None:
    """POST the object; if it exists, PUT it over the stored one (its resourceVersion kept)."""
    name = obj["metadata"]["name"]
    try:
        c.api("POST", collection, obj, timeout=60)
    except urllib.error.HTTPError as e:
        if e.code != 409:
            detail = e.read()[:300]
            raise ClusterError(f"creating {obj['kind']} {name}: HTTP {e.code} {detail!r}") from e
        version = c.api("GET", f"{collection}/{name}")["metadata"]["resourceVersion"]
        obj = {**obj, "metadata": {**obj["metadata"], "resourceVersion": version}}
        c.api("PUT", f"{collection}/{name}", obj, timeout=60)


def crds_established(c: Cluster, names: list[str]) -> bool:
    for name in names:
        conditions = c.api("GET", f"{CRD_PATH}/{name}").get("status", {}).get("conditions") or []
        if not any(x["type"] == "Established" and x["status"] == "True" for x in conditions):
            return False
    return True


def conversions(
    c: Cluster, kueue_dir: Path, port: int, ca_bundle: str
) -> dict[str, dict[str, Any]]:
    """{CRD name: spec.conversion}: the conversion webhooks Kueue's CRD kustomization patches
    in (patches/webhook_in_*.yaml it lists), served by the manager on 127.0.0.1:`port`."""
    crd_dir = kueue_dir / "config/crd"
    out = {}
    for path in listed_patches(crd_dir / "kustomization.yaml"):
        if not path.startswith("patches/webhook_in_"):
            continue
        for patch in documents(c, crd_dir / path):
            conversion = patch["spec"]["conversion"]
            hook = conversion["webhook"]
            url = f"https://127.0.0.1:{port}{hook['clientConfig']['service']['path']}"
            hook["clientConfig"] = {"url": url, "caBundle": ca_bundle}
            out[patch["metadata"]["name"]] = conversion
    return out


def install_api(c: Cluster, kueue_dir: Path, webhook_port: int, bundle: str) -> None:
    """The namespace, the CRDs (with their conversion webhooks; Established), the manager's
    RBAC; the CA of its webhooks is `bundle` (base64)."""
    create_or_replace(
        c,
        "/api/v1/namespaces",
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
    )
    names = []
    converted = conversions(c, kueue_dir, webhook_port, bundle)
    for path in sorted((kueue_dir / "config/crd/bases").glob("*.yaml")):
        for crd in documents(c, path):
            if crd["metadata"]["name"] in converted:
                crd["spec"]["conversion"] = converted[crd["metadata"]["name"]]
            create_or_replace(c, CRD_PATH, crd)
            names.append(crd["metadata"]["name"])
    wait_for(
        f"{len(names)} Kueue CRDs Established", lambda: crds_established(c, names), CRD_TIMEOUT
    )
    for obj in manager_rbac(c, kueue_dir):
        create_or_replace(c, rbac_collection(obj), obj)


def webhook_pki(directory: Path) -> Path:
    """A CA of Kueue's own and its webhook's serving certificate, in the form Kueue's
    certificate rotator accepts as valid (so it keeps them rather than making its own): the CA
    valid for the name `kueue-ca`, the certificate for the webhook Service's DNS name, and for
    127.0.0.1, where the API server reaches it. The directory."""
    pki = directory / "pki"
    pki.mkdir(parents=True, exist_ok=True)
    os.chmod(pki, 0o700)
    # The rotator reads the CA key as PKCS#1 RSA ("RSA PRIVATE KEY") only.
    openssl("genrsa", "-traditional", "-out", str(pki / "ca.key"), "2048")
    openssl(
        "req", "-x509", "-key", str(pki / "ca.key"), "-out", str(pki / "ca.crt"),
        "-days", "3650", "-subj", f"/O=kueue/CN={KUEUE_CA}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
        "-addext", f"subjectAltName=DNS:{KUEUE_CA}",
    )  # fmt: skip
    make_leaf(
        pki, Leaf("tls", f"/CN={WEBHOOK_DNS}", "serverAuth", f"DNS:{WEBHOOK_DNS},IP:127.0.0.1")
    )
    for key in pki.glob("*.key"):
        os.chmod(key, 0o600)
    return pki


def webhook_secret(pki: Path) -> dict[str, Any]:
    """The rotator's Secret, holding our CA and certificate (see webhook_pki)."""
    data = {
        name: base64.b64encode((pki / name).read_bytes()).decode()
        for name in ("ca.crt", "ca.key", "tls.crt", "tls.key")
    }
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": WEBHOOK_SECRET, "namespace": NAMESPACE},
        "type": "Opaque",
        "data": data,
    }


def manager_files(c: Cluster, directory: Path, webhook_port: int, health_port: int) -> Path:
    """The manager's client certificate (signed by the cluster CA), kubeconfig and config
    file; the config's path."""
    directory.mkdir(parents=True, exist_ok=True)
    make_leaf(c.pki, Leaf("kueue", f"/CN={MANAGER_USER}", "clientAuth"))
    os.chmod(c.pki / "kueue.key", 0o600)
    # The Secret's files where the webhook server reads them, as a pod's Secret volume would
    # hold them (the rotator waits for them there).
    certs = directory / "certs"
    certs.mkdir(exist_ok=True)
    for name in ("ca.crt", "tls.crt", "tls.key"):
        (certs / name).write_bytes((directory / "pki" / name).read_bytes())
    os.chmod(certs / "tls.key", 0o600)
    kubeconfig = directory / "kubeconfig"
    kubeconfig.write_text(
        kubeconfig_yaml(
            c.state.get("name", "local"),
            c.server,
            c.pki / "ca.crt",
            MANAGER_USER,
            cert=c.pki / "kueue.crt",
            key=c.pki / "kueue.key",
        )
    )
    os.chmod(kubeconfig, 0o600)
    config = directory / "config.yaml"  # JSON is YAML: Kueue reads it as it is
    config.write_text(json.dumps(manager_config(directory, webhook_port, health_port), indent=1))
    return config


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=3) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def webhook_serving(port: int, ca: Path) -> bool:
    """The manager's webhook server answers TLS with a certificate the cluster CA signed."""
    ctx = ssl.create_default_context(cafile=str(ca))
    try:
        with urllib.request.urlopen(f"https://127.0.0.1:{port}/healthz", context=ctx, timeout=3):
            return True
    except urllib.error.HTTPError:
        return True  # an answer over verified TLS: serving
    except (urllib.error.URLError, OSError, ssl.SSLError):
        return False


def start_kueue(cluster_dir: Path, kueue_dir: Path | None = None) -> KueueManager:
    """Install Kueue into the running cluster of `cluster_dir` and start its manager (once:
    a manager already recorded there and running is returned as it is)."""
    kueue_dir = kueue_dir or resolve_kueue_dir()
    c = Cluster(cluster_dir)
    lock = c.lock()
    try:
        if not c.load():
            raise ClusterError(f"no cluster in {cluster_dir}")
        recorded = c.state.get("kueue")
        if recorded and c.running(PROCESS):
            return KueueManager(
                c.dir,
                recorded["version"],
                recorded["webhook_port"],
                recorded["health_port"],
                Path(recorded["log"]),
            )
        return _start(c, kueue_dir)
    finally:
        os.close(lock)


def _start(c: Cluster, kueue_dir: Path) -> KueueManager:
    t0 = time.monotonic()
    version = kueue_dir.name.removeprefix("kueue-")
    webhook_port, health_port = pick_ports(2, set(c.state["ports"].values()))
    directory = c.dir / "kueue"
    # Everything Kueue's own installation has before its manager starts: its certificate
    # rotator checks the Secret and fills in the webhooks' caBundle before anything else.
    pki = webhook_pki(directory)
    bundle = base64.b64encode((pki / "ca.crt").read_bytes()).decode()
    install_api(c, kueue_dir, webhook_port, bundle)
    create_or_replace(c, f"/api/v1/namespaces/{NAMESPACE}/secrets", webhook_secret(pki))
    for hooks in webhook_configurations(c, kueue_dir, webhook_port, bundle):
        create_or_replace(c, WEBHOOK_PATHS[hooks["kind"]], hooks)
    config = manager_files(c, directory, webhook_port, health_port)
    info(f"starting Kueue {version}...")
    argv = [str(kueue_dir / "bin" / "kueue"), f"--config={config}", "--zap-log-level=2"]
    c.start(PROCESS, argv, env={**os.environ, "KUBECONFIG": str(directory / "kubeconfig")})

    def alive() -> None:
        if not c.running(PROCESS):
            raise ClusterError(f"Kueue's manager exited; see {c.logs / 'kueue.log'}", PROCESS)

    wait_for(
        "Kueue's manager /readyz",
        lambda: http_ok(f"http://127.0.0.1:{health_port}/readyz"),
        READY_TIMEOUT,
        component=PROCESS,
        alive=alive,
    )
    ca = pki / "ca.crt"
    wait_for("Kueue's webhook server", lambda: webhook_serving(webhook_port, ca), READY_TIMEOUT)
    record = {"version": version, "webhook_port": webhook_port, "health_port": health_port}
    record["log"] = str(c.logs / f"{PROCESS}.log")
    c.state["kueue"] = record
    c.save()
    info(f"Kueue {version} is up in {time.monotonic() - t0:.1f}s (webhooks on :{webhook_port})")
    return KueueManager(c.dir, version, webhook_port, health_port, Path(record["log"]))
