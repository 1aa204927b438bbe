"""The cluster path's two commands after `helm install` (README, "Run on Kubernetes"):

- `diloco submit JOB.yaml [--registry R] [--data DIR] [-n NS]`: the job checked as `diloco check
  --cluster` checks it (the same rules: what it refuses, it refuses with exit 2, before anything
  is created); the image placeholder (`ghcr.io/diloco-operator`, in the chart and the examples)
  replaced with the registry `make push-images` pushed to; the text of --data put into the one
  ConfigMap the job's pods mount (created, or replaced); the DiLoCoJob applied; then how to watch
  it and fetch the model.
- `diloco export --job NAME [-n NS] [-o DIR]`: waits for the job to succeed (--wait), exports the
  syncer's newest checkpoint inside the syncer pod (`diloco export` there, with the job's spec,
  so the file records the preset, seqLen and tokenizer, and a subword tokenizer is written
  beside it), and copies the file(s) into DIR (default NAME/), which `diloco sample` reads.

Both drive `kubectl` (the user's kubeconfig and context, as every other command of the path):
no Kubernetes client library is needed on the laptop, and what runs is what a user could type.
Torch-free (the check is imported lazily, as `diloco check` does).
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import yaml

from diloco_trainer.api.contract import CONFIG_KEY, CONFIG_MOUNT, STATE_MOUNT
from diloco_trainer.api.spec import ConfigError

PLACEHOLDER = "ghcr.io/diloco-operator"  # the image prefix of the chart and the examples
BAD_INPUT = 2
FAILED = 1
EXPORT_NAME = "model.safetensors"
EXPORT_DIR = f"{STATE_MOUNT}/export"  # in the syncer pod: beside its checkpoints
SYNCER_LABELS = "app.kubernetes.io/component=syncer"
KUBECTL_TIMEOUT_S = 120.0  # one kubectl call (an export of a large model included)


class Kubectl(Protocol):
    """How kubectl is run: ARGS, stdin, a limit in seconds (None: kubectl's own --timeout)."""

    def __call__(
        self, args: Sequence[str], stdin: bytes | None, timeout: float | None
    ) -> subprocess.CompletedProcess[bytes]: ...


class PathError(RuntimeError):
    """A step of the path failed; the message names the step and kubectl's answer."""


def run_kubectl(
    args: Sequence[str], stdin: bytes | None = None, timeout: float | None = KUBECTL_TIMEOUT_S
) -> subprocess.CompletedProcess[bytes]:
    """kubectl ARGS with the user's kubeconfig; stdout as bytes (an exported file is binary)."""
    return subprocess.run(
        ["kubectl", *args], input=stdin, capture_output=True, timeout=timeout, check=False
    )


def _checked(
    kubectl: Kubectl,
    args: Sequence[str],
    stdin: bytes | None = None,
    timeout: float | None = KUBECTL_TIMEOUT_S,
) -> bytes:
    try:
        result = kubectl(args, stdin, timeout)
    except subprocess.TimeoutExpired:
        raise PathError(f"kubectl {shlex.join(args)} gave no answer in {timeout:.0f} s") from None
    if result.returncode != 0:
        err = result.stderr.decode(errors="replace").strip()
        raise PathError(f"kubectl {shlex.join(args)} failed: {err}")
    return result.stdout


def _ns(namespace: str | None) -> list[str]:
    return ["-n", namespace] if namespace else []


# --- diloco submit -------------------------------------------------------------------------


def with_registry(doc: Any, registry: str) -> Any:
    """The manifest with every string that starts with the placeholder's prefix moved to the
    registry (spec.image, init containers' images); nothing else changes."""
    prefix = f"{PLACEHOLDER}/"
    if isinstance(doc, dict):
        return {k: with_registry(v, registry) for k, v in doc.items()}
    if isinstance(doc, list):
        return [with_registry(v, registry) for v in doc]
    if isinstance(doc, str) and doc.startswith(prefix):
        return f"{registry.rstrip('/')}/{doc.removeprefix(prefix)}"
    return doc


def _walk(doc: Any) -> Iterator[dict[str, Any]]:
    if isinstance(doc, dict):
        yield doc
        for v in doc.values():
            yield from _walk(v)
    elif isinstance(doc, list):
        for v in doc:
            yield from _walk(v)


def configmap_names(doc: Any) -> list[str]:
    """The ConfigMaps the job's pod templates mount as volumes (sorted, each once)."""
    names = {
        str(v["configMap"]["name"])
        for v in _walk(doc)
        if isinstance(v.get("configMap"), dict) and "name" in v["configMap"]
    }
    return sorted(names)


def placeholder_images(doc: Any) -> list[str]:
    """The images still naming the placeholder registry (a job that cannot be pulled)."""
    found = []
    for node in _walk(doc):
        for key in ("image",):
            value = node.get(key)
            if isinstance(value, str) and value.startswith(f"{PLACEHOLDER}/"):
                found.append(value)
    return found


def configmap_manifest(name: str, folder: Path, namespace: str | None) -> dict[str, Any]:
    """A ConfigMap of the folder's files, by name (as `kubectl create configmap --from-file`):
    text files in data, others in binaryData; subfolders are not read (a ConfigMap is flat)."""
    import base64

    data: dict[str, str] = {}
    binary: dict[str, str] = {}
    for path in sorted(p for p in folder.iterdir() if p.is_file()):
        raw = path.read_bytes()
        try:
            data[path.name] = raw.decode()
        except UnicodeDecodeError:
            binary[path.name] = base64.b64encode(raw).decode()
    if not data and not binary:
        raise ConfigError(f"--data: {folder} holds no files")
    meta: dict[str, Any] = {"name": name}
    if namespace:
        meta["namespace"] = namespace
    cm: dict[str, Any] = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data}
    if binary:
        cm["binaryData"] = binary
    return cm


def submit(args: argparse.Namespace, kubectl: Kubectl = run_kubectl) -> int:
    """`diloco submit JOB.yaml`: 0 once applied, 2 when the job or an option is refused (nothing
    was created), 1 when kubectl fails."""
    from diloco_trainer.check.checks import check_job
    from diloco_trainer.check.command import print_report
    from diloco_trainer.check.document import load_job_file, read_yaml

    prog = "diloco submit"
    where = str(args.config)
    try:
        job = load_job_file(args.config)
        doc = read_yaml(Path(args.config))
        if not isinstance(doc, dict) or doc.get("kind") != "DiLoCoJob":
            raise ConfigError(
                "kind: diloco submit applies a whole DiLoCoJob manifest (apiVersion, kind, "
                "metadata.name, spec), not a bare spec"
            )
        if args.registry:
            doc = with_registry(doc, args.registry)
        stale = placeholder_images(doc)
        if stale:
            raise ConfigError(
                f"spec.image: {stale[0]} names the placeholder registry {PLACEHOLDER}, from which "
                "nothing is pulled: pass --registry REGISTRY (where make push-images pushed)"
            )
        cm = None
        if args.data is not None:
            names = configmap_names(doc)
            if len(names) != 1:
                raise ConfigError(
                    f"--data: the job's pods mount {len(names)} ConfigMap volume(s) "
                    f"({', '.join(names) or 'none'}); --data fills exactly one (a volume with "
                    "configMap.name in islands.template and syncer.template)"
                )
            cm = configmap_manifest(names[0], Path(args.data), args.namespace)
            job.spec.data.source = str(Path(args.data).resolve())
    except (ConfigError, OSError) as err:
        print(f"{prog}: {where}: {err}", file=sys.stderr)
        return BAD_INPUT
    print(f"{prog}: {where}: job {job.name}, checked for a cluster's pods")
    report = check_job(job.spec, cluster=True)
    print_report(report, prog=prog, where=where, out=sys.stdout, err=sys.stderr)
    if not report.ok:
        return BAD_INPUT
    try:
        if cm is not None:
            _checked(kubectl, ["apply", *_ns(args.namespace), "-f", "-"], json.dumps(cm).encode())
            print(f"configmap/{cm['metadata']['name']}: the files of {args.data}")
        out = _checked(
            kubectl, ["apply", *_ns(args.namespace), "-f", "-"], yaml.safe_dump(doc).encode()
        )
    except PathError as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return FAILED
    print(out.decode().strip())
    ns = f" -n {args.namespace}" if args.namespace else ""
    print(
        f"watch it:  kubectl get dj {job.name}{ns} -w   (PROGRESS, ETA, EVAL LOSS)\n"
        f"the model: diloco export --job {job.name}{ns}   (waits for it; into {job.name}/)\n"
        f"then:      diloco sample {job.name}/"
    )
    return 0


# --- diloco export --job -------------------------------------------------------------------


def syncer_pod(kubectl: Kubectl, job: str, namespace: str | None) -> str:
    """The name of the job's syncer pod (shard 0's when the syncer is sharded)."""
    selector = f"diloco.dev/job={job},{SYNCER_LABELS}"
    out = _checked(kubectl, ["get", "pods", *_ns(namespace), "-l", selector, "-o", "json"], None)
    pods = [
        p
        for p in json.loads(out)["items"]
        if p.get("status", {}).get("phase") == "Running"
        and not p["metadata"].get("deletionTimestamp")
    ]
    if not pods:
        raise PathError(
            f"job {job} has no running syncer pod (kubectl get pods -l {selector}); its "
            "checkpoints went with it unless syncer.checkpoint.claimName keeps them"
        )
    return str(sorted(p["metadata"]["name"] for p in pods)[0])


def export_job(args: argparse.Namespace, kubectl: Kubectl = run_kubectl) -> int:
    """`diloco export --job NAME`: 0 with the files in the output folder; 1 when the job, its
    pod or kubectl fails; 2 on a bad option."""
    prog = "diloco export"
    job, ns = args.job, args.namespace
    out_dir = Path(args.output or job)
    if out_dir.suffix == ".safetensors":
        print(f"{prog}: --job writes a folder (-o DIR): {out_dir} names a file", file=sys.stderr)
        return BAD_INPUT
    try:
        _checked(kubectl, ["get", "dj", job, *_ns(ns), "-o", "name"], None)
        if args.wait not in ("", "0", "0s"):
            print(f"waiting for job {job} to succeed (--wait {args.wait})", flush=True)
            # No limit of ours: kubectl wait's --timeout is the user's --wait.
            wait = ["wait", f"dj/{job}", *_ns(ns), "--for=jsonpath={.status.phase}=Succeeded"]
            _checked(kubectl, [*wait, f"--timeout={args.wait}"], None, timeout=None)
        pod = syncer_pod(kubectl, job, ns)
        config = f"{CONFIG_MOUNT}/{CONFIG_KEY}"
        remote = f"{EXPORT_DIR}/{EXPORT_NAME}"
        exec_ = ["exec", *_ns(ns), pod, "-c", "syncer", "--"]
        # In the pod: its state dir (the newest checkpoint) and its spec, so the file records the
        # preset, seqLen and tokenizer (and a subword tokenizer is written beside it).
        _checked(kubectl, [*exec_, "rm", "-rf", EXPORT_DIR], None)  # an earlier export's files
        said = _checked(
            kubectl,
            [
                *exec_,
                "diloco",
                "export",
                STATE_MOUNT,
                "--config",
                config,
                "-o",
                remote,
                "--dtype",
                args.dtype,
            ],
            None,
        )
        listing = _checked(kubectl, [*exec_, "ls", EXPORT_DIR], None).decode().split()
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in sorted(listing):
            body = _checked(kubectl, [*exec_, "cat", f"{EXPORT_DIR}/{name}"], None)
            (out_dir / name).write_bytes(body)
    except PathError as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return FAILED
    print(said.decode().strip())
    print(f"copied into {out_dir}/: {', '.join(sorted(listing))}")
    print(f"sample it: diloco sample {out_dir}")
    return 0


def kubectl_missing(prog: str) -> bool:
    """Whether kubectl is absent (said on stderr): the path needs it on PATH."""
    if shutil.which("kubectl") is None:
        print(f"{prog}: kubectl is not on PATH (the cluster path drives it)", file=sys.stderr)
        return True
    return False
