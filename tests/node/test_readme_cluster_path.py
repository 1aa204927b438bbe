"""The README's cluster path as written, on the real node (issue 48): its "Run on Kubernetes"
block is read from the README and run by bash: `make push-images`, `helm install`, then three
commands: `diloco submit` (checked, the text's ConfigMap, applied), `diloco export --job` (waits
for the job, exports in the syncer pod, copies the model out) and `diloco sample`.

Nothing in the commands is changed. Around them, as in test_cluster_path.py (whose fixture this
module shares: a copy of the repository, a fresh namespace, the real node's taint lifted):
- there is no registry: LOAD=node (the README's documented alternative to a push) makes
  `make push-images` import the images into the real node under the names a push would give
  them (DILOCO_CLUSTER_DIR: the node tier's cluster), so nothing is pulled;
- REGISTRY keeps the README's value.
"""

from __future__ import annotations

import re
import subprocess

import pytest
from safetensors import safe_open

from tests.node.test_cluster_path import (  # noqa: F401 (path_run: a fixture used by name)
    OPERATOR_NS,
    REPO_ROOT,
    SCRIPT_TIMEOUT,
    PathRun,
    path_run,
)

README = REPO_ROOT / "README.md"
JOB = "gpt-on-my-text"
REGISTRY = "registry.example.com/you"


def readme_block() -> str:
    """The first bash block of the README's "Run on Kubernetes" section."""
    section = README.read_text().split("## Run on Kubernetes", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"^```bash\n(.*?)^```", section, re.M | re.S)
    assert match is not None, "README's Run on Kubernetes has no bash block"
    return match.group(1)


def commands(block: str) -> list[str]:
    """The block's commands, continuation lines joined, comments and assignments left out."""
    joined = re.sub(r"\\\n\s*", " ", block)
    lines = [line.split("  #")[0].strip() for line in joined.splitlines()]
    return [line for line in lines if line and not re.match(r"^[A-Z_]+=\S+$", line.split()[0])]


def test_readme_path_is_three_commands_after_helm_install() -> None:
    cmds = commands(readme_block())
    helm = next(i for i, c in enumerate(cmds) if c.startswith("helm install"))
    after = [c.split()[1] for c in cmds[helm + 1 :]]
    assert after == ["submit", "export", "sample"], cmds
    assert cmds[0].startswith("make push-images REGISTRY=$REGISTRY"), cmds


@pytest.fixture(scope="module")
def readme_result(path_run: PathRun) -> subprocess.CompletedProcess[str]:  # noqa: F811
    script = f"set -euo pipefail -x\n{readme_block()}"
    env = {**path_run.env, "LOAD": "node", "DILOCO_CLUSTER_DIR": str(path_run.cp.dir)}
    try:
        result = subprocess.run(
            ["bash", "-c", script], cwd=path_run.workdir, env=env, capture_output=True,
            text=True, timeout=SCRIPT_TIMEOUT, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired as e:
        raise AssertionError(
            f"the README's commands ran past {SCRIPT_TIMEOUT:.0f} s\n"
            f"{(e.stderr or b'')[-4000:]!r}\n{path_run.diagnosis()}"
        ) from e
    assert result.returncode == 0, (
        f"the README's commands failed (exit {result.returncode}):\n"
        f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}\n{path_run.diagnosis()}"
    )
    return result


def test_readme_commands_train_export_and_sample(
    path_run: PathRun,  # noqa: F811
    readme_result: subprocess.CompletedProcess[str],
) -> None:
    cp, out = path_run.cp, readme_result.stdout
    # The images make push-images named are the ones the operator and the job run.
    pods = cp.kubectl_json("get", "pods", "-n", OPERATOR_NS)["items"]
    images = [p["spec"]["containers"][0]["image"] for p in pods]
    assert images == [f"{REGISTRY}/diloco-operator:0.1.0"], images
    job = cp.kubectl_json("get", "dj", JOB, "-n", path_run.ns)
    assert job["spec"]["image"] == f"{REGISTRY}/diloco-trainer:0.1.0"
    assert job["status"]["phase"] == "Succeeded", job["status"]
    # submit created the ConfigMap from --data and said how to watch.
    cm = cp.kubectl_json("get", "configmap", "my-text", "-n", path_run.ns)
    corpus = REPO_ROOT / "examples" / "byo" / "sample-corpus"
    assert sorted(cm["data"]) == sorted(p.name for p in corpus.iterdir())
    assert f"kubectl get dj {JOB} -w" in out
    # export --job copied the model with what loading it needs.
    model = path_run.workdir / JOB / "model.safetensors"
    with safe_open(str(model), "pt") as f:
        meta = f.metadata()
    assert (meta["preset"], meta["seqLen"], meta["tokenizer"]) == ("gpt-tiny", "64", "bytes")
    # sample continued the prompt.
    text = out[out.index("The island ") :]
    assert len(text.encode()) >= len("The island ") + 150, out[-2000:]
