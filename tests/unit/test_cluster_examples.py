"""The cluster path's examples as the operator reads them: the built-in GPT on the user's text
(examples/gpt-on-my-text) and the BYO job, whose pods fill their data volume in an init step,
and one image name (one registry) across the examples, chart and docs."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from diloco_operator.api import parse_job_spec
from diloco_operator.resources import JobRef, build_learner_pod_template, build_syncer_pod_template

ROOT = Path(__file__).resolve().parents[2]
REGISTRY = "ghcr.io/diloco-operator"  # the placeholder every command replaces with $REGISTRY
MY_TEXT = ROOT / "examples/gpt-on-my-text/job.yaml"
BYO = ROOT / "examples/byo/job.yaml"


def _job(path: Path) -> dict[str, Any]:
    return next(d for d in yaml.safe_load_all(path.read_text()) if d["kind"] == "DiLoCoJob")


def _filled_before_start(pod: dict[str, Any], container: str, source: str) -> None:
    """The pod's init step writes the data volume that `container` then reads at `source`."""
    (main,) = [c for c in pod["containers"] if c["name"] == container]
    (read,) = [m for m in main["volumeMounts"] if m["name"] == "corpus"]
    assert read["readOnly"] and source.startswith(read["mountPath"])
    (init,) = pod["initContainers"]
    (write,) = [m for m in init["volumeMounts"] if m["name"] == "corpus"]
    assert not write.get("readOnly") and write["mountPath"] == read["mountPath"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "corpus"]
    assert "emptyDir" in volume  # any cluster: no shared claim to create or fill
    (text,) = [v for v in pod["volumes"] if v["name"] == "my-text"]
    assert text["configMap"]["name"] == "my-text"


@pytest.mark.parametrize("path", [MY_TEXT, BYO], ids=["gpt-on-my-text", "byo"])
def test_cluster_example_learners_fill_their_data_in_an_init_step(path: Path) -> None:
    job = _job(path)
    spec = parse_job_spec(job["spec"])
    ref = JobRef(name=job["metadata"]["name"], namespace="team", uid="u-1")
    for index in range(spec.islands.count):
        pod = build_learner_pod_template(ref, spec, index)["spec"]
        _filled_before_start(pod, "learner", spec.data.source)


def test_cluster_example_syncer_reads_the_same_text() -> None:
    job = _job(MY_TEXT)
    spec = parse_job_spec(job["spec"])
    ref = JobRef(name=job["metadata"]["name"], namespace="team", uid="u-1")
    pod = build_syncer_pod_template(ref, spec)["spec"]
    _filled_before_start(pod, "syncer", spec.data.source)


# $REGISTRY or localhost and the image, or a registry host (with a dot) and a namespace before
# the image (so the bare placeholder `ghcr.io/diloco-operator` in prose is not an image).
IMAGE = re.compile(
    r"(?:\$REGISTRY|localhost|[\w-]+\.[\w.-]+(?:/[\w.-]+)+)/diloco-(?:operator|trainer|byo)\b"
)
NAMED = [
    "README.md",
    "docs/cluster.md",
    "docs/byo.md",
    "charts/diloco-operator/values.yaml",
    "charts/diloco-operator/README.md",
    "examples/job.yaml",
    "examples/local.yaml",
    "examples/gpt-on-my-text/job.yaml",
    "examples/byo/job.yaml",
    "examples/byo/Dockerfile",
    "examples/multi-region/README.md",
    "examples/multi-region/region-a.yaml",
    "examples/multi-region/region-b.yaml",
]


def test_images_are_named_with_one_registry_everywhere() -> None:
    found: dict[str, set[str]] = {}
    for name in NAMED:
        for image in IMAGE.findall((ROOT / name).read_text()):
            found.setdefault(image.rsplit("/", 1)[0], set()).add(name)
    # $REGISTRY in commands, the placeholder in files; localhost/ for the images built here.
    assert set(found) <= {REGISTRY, "$REGISTRY", "localhost"}, found
    values = yaml.safe_load((ROOT / "charts/diloco-operator/values.yaml").read_text())
    assert values["image"]["repository"] == f"{REGISTRY}/diloco-operator"
