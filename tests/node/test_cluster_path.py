"""docs/cluster.md as written, on the real node (issue 24): the commands of its numbered steps are
read from the page itself and run in order by bash, so the page cannot drift from what works:
build and push the images, `helm install` the chart, hand the text to the pods, check and apply
the example job, watch it, wait for it to succeed, export the weights and copy them out; then
the page's Python block samples text from the copied file.

Nothing in the commands is changed. What the real node lacks is stood in for around them:
- `docker` (no daemon, no registry): tests/node/test_cluster_path_docker.py checks each
  `docker build` against the Dockerfile (the stage and the build arguments exist) and makes
  `docker push NAME` give the image hack/build-images.sh built from that Dockerfile the name
  NAME on the node, so the pods and the operator find `$REGISTRY/...:0.1.0` without a pull.
  `REGISTRY` keeps the page's value: nothing is pulled from it.
- the commands run in a copy of the repository (the copied-out model lands there, not in the
  working tree), with the repository's `.venv`, and a kubeconfig whose namespace is a fresh one
  (the page's commands use the current namespace).
- the page's pods tolerate no taint: for this module the real node's test taint is lifted and
  the fake (kwok) nodes are cordoned, so the pods run on the real node; both are put back after.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from safetensors import safe_open

from hack.localcluster.harness import ControlPlane
from hack.localcluster.nodeconfig import NodePaths
from hack.localcluster.settings import NODE_LABEL, NODE_NAME, NODE_TAINT_KEY

REPO_ROOT = Path(__file__).resolve().parents[2]
PAGE = REPO_ROOT / "docs" / "cluster.md"
DOCKER = Path(__file__).resolve().parent / "test_cluster_path_docker.py"
# The whole page: the job's pods start, 20 rounds of gpt-tiny, export and copy.
SCRIPT_TIMEOUT = float(os.environ.get("DILOCO_CLUSTER_PATH_TIMEOUT", "1500"))
JOB = "gpt-on-my-text"
OPERATOR_NS = "diloco-system"  # the page's `helm install -n`
HELM_HOMES = ("HELM_CONFIG_HOME", "HELM_CACHE_HOME", "HELM_DATA_HOME")  # not the user's


def page_steps(text: str) -> dict[int, dict[str, list[str]]]:
    """The fenced blocks of each numbered step (`## N. Title`), by language, in page order."""
    steps: dict[int, dict[str, list[str]]] = {}
    for section in re.split(r"^## ", text, flags=re.M)[1:]:
        number = re.match(r"(\d+)\. ", section)
        if number is None:
            continue
        blocks = steps.setdefault(int(number.group(1)), {})
        for lang, body in re.findall(r"^```(\w+)\n(.*?)^```", section, re.M | re.S):
            blocks.setdefault(lang, []).append(body)
    return steps


def page_script(steps: dict[int, dict[str, list[str]]]) -> str:
    """Every step's bash blocks as one script (variables carry from step to step, as in the
    reader's shell), each step announced on stdout."""
    lines = ["set -euo pipefail -x"]
    for number in sorted(steps):
        lines.append(f"echo '### step {number}'")
        lines.extend(steps[number].get("bash", []))
    return "\n".join(lines) + "\n"


def test_page_steps_are_read_in_order() -> None:
    """What the node test runs: steps 1..N with no gap, each with a command, and the sampling
    snippet in the last one (a renamed heading or a lost fence fails here, not on the node)."""
    steps = page_steps(PAGE.read_text())
    assert sorted(steps) == list(range(1, len(steps) + 1)) and len(steps) >= 7, sorted(steps)
    assert all(steps[n].get("bash") for n in range(1, len(steps))), steps
    assert len(steps[max(steps)]["python"]) == 1
    script = page_script(steps)
    for command in ("docker build", "docker push", "helm install", "kubectl apply",
                    "kubectl wait", "diloco export", "kubectl cp"):  # fmt: skip
        assert command in script, command


def test_docker_stand_in_refuses_what_docker_would(tmp_path: Path) -> None:
    """The stand-in fails a `docker build` naming a stage or build argument the Dockerfile lacks,
    and a push of what was not built, as Docker would (so the page's commands are checked)."""
    env = {**os.environ, "DILOCO_SHIM_DIR": str(tmp_path)}

    def docker(*args: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, str(DOCKER), *args]
        return subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True)

    bad_stage = docker("build", "--target", "trainr", "-t", "r/x:1", ".")
    assert bad_stage.returncode == 1 and "has no stage trainr" in bad_stage.stderr
    bad_arg = docker("build", "--target", "trainer", "--build-arg", "TORCH=cpu", "-t", "r/x:1", ".")
    assert bad_arg.returncode == 1 and "has no ARG TORCH" in bad_arg.stderr
    unbuilt = docker("push", "r/x:1")
    assert unbuilt.returncode == 1 and "was not built here" in unbuilt.stderr
    built = docker(
        "build", "--target", "trainer", "--build-arg", "TORCH_VARIANT=cpu", "-t", "r/x:1", "."
    )
    assert built.returncode == 0, built.stderr
    assert json.loads((tmp_path / "built.json").read_text()) == {"r/x:1": "trainer"}


def copy_repository(dest: Path) -> Path:
    """The repository's files (tracked and new, not ignored) under dest, and its `.venv`."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=REPO_ROOT, capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, listed):
        source = REPO_ROOT / name
        if source.is_file():  # listed but deleted in the working tree: skipped
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    (dest / ".venv").symlink_to(REPO_ROOT / ".venv")
    return dest


@contextmanager
def pods_on_real_node(cp: ControlPlane) -> Iterator[None]:
    """Pods that tolerate nothing land on the real node: its taint lifted, the fake nodes
    cordoned; both put back afterwards."""
    nodes = cp.kubectl_json("get", "nodes")["items"]
    fake = [n["metadata"]["name"] for n in nodes if NODE_LABEL not in n["metadata"]["labels"]]
    for name in fake:
        cp.kubectl("cordon", name)
    cp.kubectl("taint", "nodes", NODE_NAME, f"{NODE_TAINT_KEY}-")
    try:
        yield
    finally:
        cp.kubectl("taint", "nodes", NODE_NAME, f"{NODE_TAINT_KEY}=true:NoSchedule", "--overwrite")
        for name in fake:
            cp.kubectl("uncordon", name)


@dataclass
class PathRun:
    cp: ControlPlane
    workdir: Path
    shim_dir: Path
    env: dict[str, str]
    ns: str
    images: dict[str, str]

    def run(self, argv: list[str], timeout: float, **kw: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            argv, cwd=self.workdir, env=self.env, capture_output=True, text=True,
            timeout=timeout, check=False, **kw,
        )  # fmt: skip

    def diagnosis(self) -> str:
        """The page's pods, the job's status and the operator's and syncer's logs."""
        parts = []
        for args in (
            ["get", "pods", "-A", "-o", "wide"],
            ["get", "dj", JOB, "-o", "jsonpath={.status}"],
            ["get", "events", "--sort-by=.lastTimestamp"],
            [
                "logs",
                "-n",
                OPERATOR_NS,
                "-l",
                "app.kubernetes.io/name=diloco-operator",
                "--tail=40",
            ],
            ["logs", f"deploy/{JOB}-syncer", "-c", "syncer", "--tail=40"],
        ):
            got = self.run(["kubectl", *args], timeout=60)
            parts.append(f"$ kubectl {' '.join(args)}\n{got.stdout}{got.stderr}")
        return "\n".join(parts)


@pytest.fixture(scope="module")
def path_run(
    node_cluster: ControlPlane,
    node_images: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[PathRun]:
    base = tmp_path_factory.mktemp("cluster-path")
    workdir = copy_repository(base / "repo")
    shim_dir = base / "bin"
    shim_dir.mkdir()
    docker = shim_dir / "docker"
    docker.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{DOCKER}" "$@"\n')
    docker.chmod(0o755)
    kubeconfig = base / "kubeconfig"
    shutil.copy(node_cluster.kubeconfig, kubeconfig)
    ctr = [
        str(Path(os.environ["DILOCO_NODE_BIN_DIR"]) / "ctr"),
        "--address", str(NodePaths(node_cluster.dir / "node").socket), "--namespace", "k8s.io",
    ]  # fmt: skip
    env = {
        **node_cluster.env,
        "KUBECONFIG": str(kubeconfig),
        "PATH": f"{shim_dir}{os.pathsep}{node_cluster.env['PATH']}",
        "DILOCO_SHIM_DIR": str(shim_dir),
        "DILOCO_SHIM_CTR": json.dumps(ctr),
        "DILOCO_SHIM_IMAGE_operator": node_images["operator"],
        "DILOCO_SHIM_IMAGE_trainer": node_images["trainer"],
        **{key: str(base / key.lower()) for key in HELM_HOMES},
    }
    ns = node_cluster.create_namespace("cluster-path")
    run = PathRun(node_cluster, workdir, shim_dir, env, ns, node_images)
    run.run(["kubectl", "config", "set-context", "--current", f"--namespace={ns}"], timeout=30)
    with pods_on_real_node(node_cluster):
        yield run
        run.run(["helm", "uninstall", "diloco", "-n", OPERATOR_NS, "--wait"], timeout=240)
        node_cluster.delete_namespace(ns, wait=True)
        node_cluster.delete_namespace(OPERATOR_NS, wait=True)


@pytest.fixture(scope="module")
def page_result(path_run: PathRun) -> subprocess.CompletedProcess[str]:
    script = page_script(page_steps(PAGE.read_text()))
    try:
        result = path_run.run(["bash", "-c", script], timeout=SCRIPT_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(
            f"docs/cluster.md's commands ran past {SCRIPT_TIMEOUT:.0f} s\n"
            f"{(e.stderr or b'')[-4000:]!r}\n{path_run.diagnosis()}"
        ) from e
    assert result.returncode == 0, (
        f"docs/cluster.md's commands failed (exit {result.returncode}):\n"
        f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}\n{path_run.diagnosis()}"
    )
    return result


def test_page_commands_build_install_train_and_export(
    path_run: PathRun, page_result: subprocess.CompletedProcess[str]
) -> None:
    cp, out = path_run.cp, page_result.stdout
    # The images the page built and pushed are the ones the operator and the job run.
    built = json.loads((path_run.shim_dir / "built.json").read_text())
    assert sorted(built.values()) == ["operator", "trainer"], built
    operator_image = next(name for name, target in built.items() if target == "operator")
    trainer_image = next(name for name, target in built.items() if target == "trainer")
    pods = cp.kubectl_json("get", "pods", "-n", OPERATOR_NS)["items"]
    assert [p["spec"]["containers"][0]["image"] for p in pods] == [operator_image]
    job = cp.kubectl_json("get", "dj", JOB, "-n", path_run.ns)
    assert job["spec"]["image"] == trainer_image
    assert job["status"]["phase"] == "Succeeded", job["status"]
    assert job["status"]["outerStep"] == job["spec"]["stopAfter"]["outerSteps"]
    # Step 4's check passed; step 5's table has the columns the page names.
    assert f"diloco check: examples/{JOB}/job.yaml: ok" in page_result.stderr + out
    header = next(line for line in out.splitlines() if line.split()[:2] == ["NAME", "PHASE"])
    for column in ("PHASE", "ISLANDS", "OUTER STEP", "PROGRESS", "ETA", "EVAL LOSS"):
        assert column in header, header
    # The syncer read the ConfigMap's files, copied into /data by the init step (the learners'
    # pods are gone: a finished job's islands are scaled to zero).
    files = len(list((REPO_ROOT / "examples/byo/sample-corpus").iterdir()))
    log = cp.kubectl("logs", f"deploy/{JOB}-syncer", "-c", "syncer", "-n", path_run.ns).stdout
    assert f"data.source /data: read {files} file(s)" in log, log[-2000:]
    # Step 6 copied the exported weights out: the model's parameters by name.
    model = path_run.workdir / "model.safetensors"
    with safe_open(str(model), "pt") as f:
        names = set(f.keys())
    assert {"tok_emb.weight", "pos_emb.weight"} <= names, sorted(names)


def test_page_snippet_samples_text_from_the_copied_model(
    path_run: PathRun, page_result: subprocess.CompletedProcess[str]
) -> None:
    steps = page_steps(PAGE.read_text())
    (snippet,) = steps[max(steps)]["python"]
    result = path_run.run([str(REPO_ROOT / ".venv" / "bin" / "python"), "-c", snippet], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("The island "), result.stdout
    assert len(result.stdout.encode()) >= len("The island ") + 150, result.stdout
