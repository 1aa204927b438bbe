"""Helpers for the chart, RBAC and multi-region cluster tests (their fixtures live in conftest.py).

- `ChartRelease`: the chart installed with the pinned helm into a local control plane, and what
  it created (listed by the chart's labels).
- `ChartOperator`: `diloco operator` as a local process with the arguments of the chart's
  Deployment and the credentials of a ServiceAccount (never the admin's): kwok pods have no
  containers, so the chart's operator pod cannot run the operator itself.
- `LocalPod`: a pod template of a workload the operator created (syncer Deployment, island
  StatefulSet) turned into a local process: its environment read from the template, its mounted
  ConfigMaps/Secrets written to local files, and only what cannot be local (ports, cluster DNS)
  overridden by the caller.
- `self_signed_tls`: a certificate for the syncer, made with the openssl CLI.

Every process started here runs in its own process group and is stopped by its owner.
"""

from __future__ import annotations

import base64
import json
import re
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart.helm_tool import CHART, Helm
from diloco_trainer.local import (
    Proc,
    start_process,
)

from hack.localcluster.harness import ControlPlane

from .operator_helpers import OperatorProcess

# Kinds a chart release may create, namespaced and cluster-scoped (for "nothing left behind").
NAMESPACED_CHART_KINDS = (
    "serviceaccounts",
    "deployments",
    "replicasets",
    "pods",
    "services",
    "configmaps",
    "secrets",
    "roles",
    "rolebindings",
)
CLUSTER_CHART_KINDS = ("clusterroles", "clusterrolebindings")
# kubectl's name for each kind the chart renders (for comparing a manifest with a listing).
KIND_PLURALS = {
    "ServiceAccount": "serviceaccounts",
    "Deployment": "deployments",
    "Service": "services",
    "ConfigMap": "configmaps",
    "Secret": "secrets",
    "Role": "roles",
    "RoleBinding": "rolebindings",
    "ClusterRole": "clusterroles",
    "ClusterRoleBinding": "clusterrolebindings",
}
# An RBAC denial as the API server words it (also inside JSON bodies, where quotes are escaped).
DENIAL = re.compile(r'cannot (\w+) resource \\*"([a-z./]+)\\*"')


def helm_for(cp: ControlPlane, home: Path) -> Helm:
    """The pinned helm, talking to `cp` with the admin kubeconfig."""
    try:
        return Helm.located(home, env=cp.env)
    except RuntimeError as err:
        pytest.fail(f"helm is needed and could not be located or built: {err}")


def render_chart(helm: Helm, release: str, namespace: str, values: Mapping[str, Any]) -> list[dict]:
    """`helm template` of the chart with these values, parsed."""
    args = ["template", release, str(CHART), "--namespace", namespace]
    for key, value in _flatten_values(values):
        args += ["--set-json", f"{key}={json.dumps(value)}"]
    result = helm.run(*args)
    assert result.returncode == 0, f"helm template failed:\n{result.stderr}"
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def _flatten_values(values: Mapping[str, Any], prefix: str = "") -> Iterable[tuple[str, Any]]:
    for key, value in values.items():
        path = f"{prefix}.{key}" if prefix else key
        if isinstance(value, Mapping) and value:
            yield from _flatten_values(value, path)
        else:
            yield path, value


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    """The single rendered document of this kind (and name)."""
    found = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"want one {kind} {name or ''}, got {[d['kind'] for d in docs]}"
    return found[0]


def operator_args(docs: list[dict]) -> list[str]:
    """The arguments of `diloco` in the chart's operator Deployment."""
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    (container,) = [c for c in pod["containers"] if c["name"] == "operator"]
    return [str(a) for a in container["args"]]


@dataclass
class ChartRelease:
    """One `helm install` of charts/diloco-operator into a control plane."""

    helm: Helm
    cp: ControlPlane
    name: str
    namespace: str
    values: dict[str, Any] = field(default_factory=dict)

    def install(self, timeout: str = "300s") -> subprocess.CompletedProcess[str]:
        """`helm install --wait` (the chart's pods are kwok fakes: Ready without containers)."""
        args = ["install", self.name, str(CHART), "--namespace", self.namespace, "--wait"]
        for key, value in _flatten_values(self.values):
            args += ["--set-json", f"{key}={json.dumps(value)}"]
        result = self.helm.run(*args, "--timeout", timeout, timeout=420)
        assert result.returncode == 0, f"helm install failed:\n{result.stderr}"
        return result

    def uninstall(self) -> subprocess.CompletedProcess[str]:
        """`helm uninstall --wait`; returns its result (the caller asserts)."""
        return self.helm.run(
            "uninstall", self.name, "--namespace", self.namespace, "--wait", timeout=300
        )

    def manifest(self) -> list[dict]:
        """What helm installed (`helm get manifest`), parsed."""
        result = self.helm.run("get", "manifest", self.name, "--namespace", self.namespace)
        assert result.returncode == 0, result.stderr
        return [d for d in yaml.safe_load_all(result.stdout) if d]

    @property
    def selector(self) -> str:
        """Label selector matching everything the release created."""
        return f"app.kubernetes.io/instance={self.name},app.kubernetes.io/part-of=diloco-operator"

    def labelled_objects(self) -> set[str]:
        """`kind/name` of every object carrying the release's labels (namespace + cluster)."""
        found: set[str] = set()
        for kinds, scope in (
            (NAMESPACED_CHART_KINDS, ["-n", self.namespace]),
            (CLUSTER_CHART_KINDS, []),
        ):
            out = self.cp.kubectl("get", ",".join(kinds), *scope, "-l", self.selector, "-o", "json")
            for item in json.loads(out.stdout)["items"]:
                kind = KIND_PLURALS.get(item["kind"], item["kind"].lower() + "s")
                found.add(f"{kind}/{item['metadata']['name']}")
        return found

    def service_account(self) -> str:
        """Name of the ServiceAccount the chart's operator runs as."""
        return one(self.manifest(), "ServiceAccount")["metadata"]["name"]


def chart_object_names(docs: list[dict]) -> set[str]:
    """`kind/name` of the rendered or installed documents (comparable with labelled_objects)."""
    return {f"{KIND_PLURALS[d['kind']]}/{d['metadata']['name']}" for d in docs}


@dataclass
class ChartOperator(OperatorProcess):
    """`diloco operator` with the chart's Deployment arguments, as a local process.

    Only the health and metrics ports are changed (to free local ports); every other argument
    (cluster-wide or --namespace, --standalone) is the chart's.
    """

    def argv(self) -> list[str]:
        """The chart's arguments with the local ports (the chart must have both port flags)."""
        for flag in ("--health-port", "--metrics-port"):
            assert flag in self.args, f"the chart's operator args have no {flag}: {self.args}"
        return super().argv()

    def denials(self) -> list[tuple[str, str]]:
        """(verb, resource) of every RBAC denial the operator logged."""
        return [(m.group(1), m.group(2)) for m in DENIAL.finditer(self.log_text())]


def start_chart_operator(
    cp: ControlPlane,
    *,
    args: list[str],
    namespace: str,
    serviceaccount: str,
    workdir: Path,
) -> ChartOperator:
    """Run the operator as `namespace/serviceaccount` with the chart's arguments."""
    workdir.mkdir(parents=True, exist_ok=True)
    kubeconfig = cp.kubeconfig_for_sa(namespace, serviceaccount, workdir / "sa.kubeconfig")
    env = {**cp.env_with_kubeconfig(kubeconfig), "PYTHONUNBUFFERED": "1"}
    op = ChartOperator(env=env, namespace=namespace, log_file=workdir / "operator.log", args=args)
    op.start()
    return op


# ------------------------------------------------------------------------------ pods -> processes


def _secret_files(cp: ControlPlane, namespace: str, name: str) -> dict[str, bytes]:
    data = cp.kubectl_json("get", "secret", name, "-n", namespace).get("data") or {}
    return {k: base64.b64decode(v) for k, v in data.items()}


def _config_map_files(cp: ControlPlane, namespace: str, name: str) -> dict[str, bytes]:
    data = cp.kubectl_json("get", "configmap", name, "-n", namespace).get("data") or {}
    return {k: v.encode() for k, v in data.items()}


def _pick_items(files: dict[str, bytes], items: list[dict[str, str]] | None) -> dict[str, bytes]:
    if not items:
        return files
    missing = [i["key"] for i in items if i["key"] not in files]
    assert not missing, f"volume items name keys the object lacks: {missing}"
    return {i["path"]: files[i["key"]] for i in items}


def _field_ref(path: str, pod: Mapping[str, Any]) -> str:
    label = re.fullmatch(r"metadata\.labels\['([^']+)'\]", path)
    if label:
        return str(pod["metadata"]["labels"][label.group(1)])
    if path in ("metadata.name", "metadata.namespace"):
        return str(pod["metadata"][path.split(".")[1]])
    raise AssertionError(f"fieldRef {path} is not resolvable locally")


@dataclass
class LocalPod:
    """One container of a pod template, made runnable on this machine.

    `env` is the container's environment with mount paths replaced by the local copies of the
    mounted ConfigMaps/Secrets (and local dirs for emptyDir/PVC); `command` is the container's
    `diloco` subcommand.
    """

    env: dict[str, str]
    command: str
    mounts: dict[str, Path]

    @classmethod
    def from_template(
        cls,
        cp: ControlPlane,
        namespace: str,
        template: Mapping[str, Any],
        container_name: str,
        workdir: Path,
        *,
        pod_name: str,
        pod_labels: Mapping[str, str] | None = None,
    ) -> LocalPod:
        """Resolve `template`'s container `container_name` against the cluster into workdir."""
        spec = template["spec"]
        (container,) = [c for c in spec["containers"] if c["name"] == container_name]
        command = container.get("command") or []
        assert command[:1] == ["diloco"] and len(command) == 2, f"not a diloco command: {command}"
        volumes = {v["name"]: v for v in spec.get("volumes") or []}
        mounts: dict[str, Path] = {}
        for mount in container.get("volumeMounts") or []:
            local = workdir / "mounts" / mount["name"]
            local.mkdir(parents=True, exist_ok=True)
            volume = volumes[mount["name"]]
            files: dict[str, bytes] = {}
            if "secret" in volume:
                src = volume["secret"]
                files = _pick_items(
                    _secret_files(cp, namespace, src["secretName"]), src.get("items")
                )
            elif "configMap" in volume:
                src = volume["configMap"]
                files = _pick_items(_config_map_files(cp, namespace, src["name"]), src.get("items"))
            else:
                assert {"emptyDir", "persistentVolumeClaim"} & set(volume), volume
            for rel, content in files.items():
                path = local / rel
                path.write_bytes(content)
                path.chmod(0o600)
            mounts[mount["mountPath"]] = local
        labels = {**(template.get("metadata", {}).get("labels") or {}), **(pod_labels or {})}
        pod = {"metadata": {"name": pod_name, "namespace": namespace, "labels": labels}}
        env: dict[str, str] = {}
        for item in container.get("env") or []:
            if "value" in item:
                env[item["name"]] = _localize(str(item["value"]), mounts)
            else:
                # The operator uses fieldRef only (RANK from the pod-index label).
                ref = item["valueFrom"]
                assert set(ref) == {"fieldRef"}, f"cannot resolve {item['name']} locally: {ref}"
                env[item["name"]] = _field_ref(ref["fieldRef"]["fieldPath"], pod)
        return cls(env=env, command=command[1], mounts=mounts)

    def start(self, name: str, log_file: Path, overrides: Mapping[str, str] | None = None) -> Proc:
        """Start `diloco COMMAND` with this environment, `overrides` applied last."""
        env = {**self.env, **(overrides or {}), "OMP_NUM_THREADS": "1"}
        return start_process(name, self.command, env, log_file=log_file)


def _localize(value: str, mounts: Mapping[str, Path]) -> str:
    """A path inside a mount becomes the same path inside the mount's local copy."""
    for mount_path in sorted(mounts, key=len, reverse=True):
        if value == mount_path or value.startswith(mount_path.rstrip("/") + "/"):
            return str(mounts[mount_path]) + value[len(mount_path.rstrip("/")) :]
    return value


def workload_template(cp: ControlPlane, namespace: str, kind: str, name: str) -> dict[str, Any]:
    """The pod template of a Deployment or StatefulSet, as the operator wrote it."""
    return cp.kubectl_json("get", kind, name, "-n", namespace)["spec"]["template"]


# ------------------------------------------------------------------------------ TLS


@dataclass(frozen=True)
class TLSMaterial:
    """A self-signed serving certificate (it is its own CA)."""

    cert: Path
    key: Path

    def create_secrets(
        self, cp: ControlPlane, namespace: str, *, tls: str = "", ca: str = ""
    ) -> None:
        """`kubectl create secret` as the README says: a TLS Secret with ca.crt, a CA Secret."""
        if tls:
            cp.kubectl(
                "create", "secret", "generic", tls, "-n", namespace, "--type=kubernetes.io/tls",
                f"--from-file=tls.crt={self.cert}", f"--from-file=tls.key={self.key}",
                f"--from-file=ca.crt={self.cert}",
            )  # fmt: skip
        if ca:
            cp.kubectl(
                "create", "secret", "generic", ca, "-n", namespace,
                f"--from-file=ca.crt={self.cert}",
            )  # fmt: skip


def self_signed_tls(
    workdir: Path, *, ips: Iterable[str] = (), dns: Iterable[str] = ()
) -> TLSMaterial:
    """A fresh self-signed certificate for these IPs and DNS names (openssl CLI)."""
    workdir.mkdir(parents=True, exist_ok=True)
    cert, key = workdir / "tls.crt", workdir / "tls.key"
    names = [f"IP:{ip}" for ip in ips] + [f"DNS:{d}" for d in dns]
    assert names, "a certificate needs at least one name"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-days", "1", "-keyout", str(key), "-out", str(cert),
            "-subj", "/CN=diloco-syncer", "-addext", "subjectAltName=" + ",".join(names),
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return TLSMaterial(cert=cert, key=key)
