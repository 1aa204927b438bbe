"""What `diloco check` passes, the processes `diloco run` starts accept (issue 48).

A seeded generator writes a few hundred DiLoCoJob manifests around the edges the audit found
(precision, fragments against the model's tensors, overlap against inner steps, preset with an
entrypoint, huge stopAfter.tokens, names, quorum, shards). Each goes through `diloco check`'s own
path (load_job_file, check_job: the function `diloco run` calls before it starts anything); every
one it passes then goes through what the learner and the syncer do at start, with their own
functions: the spec read back from spec.json (api/spec.load_spec), the device and precision
(learner/device.pick_device, learner/inner_step.check_precision), the global model split into
fragments (syncer/merging/global_model.GlobalModel), a shard's scope and the round policy. Every
refusal names a field and is a ConfigError, never another exception.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from diloco_trainer.api.spec import ConfigError, JobSpec, load_spec
from diloco_trainer.check import check_job, load_job_file
from diloco_trainer.check.document import bare_spec_name, name_problem
from diloco_trainer.check.start_rules import cluster_device_warnings, device_problems
from diloco_trainer.learner.device import pick_device
from diloco_trainer.learner.inner_step import check_precision
from diloco_trainer.models.model import build_model
from diloco_trainer.syncer.edge.shard_scope import ShardScope
from diloco_trainer.syncer.merging.global_model import GlobalModel
from diloco_trainer.syncer.state.records import round_policy

CONFIGS = 240
FIELDS = (
    "inner.precision",
    "sync.fragments",
    "sync.overlapSteps",
    "model.preset",
    "model.entrypoint",
    "stopAfter.tokens",
    "metadata.name",
    "sync.quorum",
    "syncer.shards",
    "inner.steps",
)


def _corpus(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    text = "".join(f"line {i}: the islands train and the syncer merges.\n" for i in range(600))
    (folder / "text.txt").write_text(text)
    return folder


def generated(rng: random.Random) -> dict[str, Any]:
    """One manifest, its fields drawn around the edges (valid or not)."""
    steps = rng.choice([1, 2, 4, 8, 30])
    count = rng.randint(1, 3)
    spec: dict[str, Any] = {
        "model": {"preset": rng.choice(["gpt-tiny", "gpt-mini"])},
        "data": {"source": "corpus", "evalTokens": 1024},
        "islands": {"count": count},
        "inner": {
            "steps": steps,
            "batchSize": 2,
            "seqLen": rng.choice([16, 32]),
            "precision": rng.choice(["fp32", "fp32", "fp32", "bf16", "fp16"]),
        },
        "sync": {
            "quorum": rng.randint(1, count + (rng.random() < 0.1)),
            "fragments": rng.choice([1, 2, 2, 4, 28, 29, 30, 53, 54, 55, 200]),
        },
        "stopAfter": {"outerSteps": rng.randint(1, 5)},
    }
    if rng.random() < 0.6:
        spec["sync"]["overlapSteps"] = rng.choice([0, 1, steps, steps, steps + 1, 50])
    if rng.random() < 0.2:
        spec["stopAfter"]["tokens"] = rng.choice([1, 10**6, 10**18, 10**18 + 1, 10**25, 1e300])
    if rng.random() < 0.2:
        spec["syncer"] = {"shards": rng.randint(1, 4)}
    if rng.random() < 0.05:
        spec["model"] = {"entrypoint": "no_such_module:build", "preset": "gpt-tiny"}
    name = rng.choice(["demo"] * 6 + ["a-b-1", "Bad_Name!", "-x", "x" * 45, None])
    doc: dict[str, Any] = {"apiVersion": "diloco.dev/v1alpha1", "kind": "DiLoCoJob", "spec": spec}
    if name is not None:
        doc["metadata"] = {"name": name}
    return doc


def process_starts(spec: JobSpec, folder: Path) -> None:
    """What a learner and the syncer do with this spec before they train, with their own
    functions; raises what they would."""
    config = folder / "spec.json"
    config.write_text(spec.to_json())
    read = load_spec(config)  # every process reads spec.json
    check_precision(read.inner.precision, pick_device("cpu"))  # learner/loop.main
    torch.manual_seed(read.model.seed)
    model = build_model(read.model.preset, read.inner.seq_len, 256)
    n = read.sync.fragments  # syncer/service/startup.build
    scopes = [ShardScope.of(read, s, n) for s in range(read.syncer.shards)]
    owned = None if read.syncer.shards == 1 else scopes[0].owned
    GlobalModel(read, model, model.embedding_names(), owned=owned)
    round_policy(read, n)


def test_what_check_passes_the_processes_start(tmp_path: Path) -> None:
    _corpus(tmp_path / "corpus")
    rng = random.Random(48)
    passed = refused = 0
    for i in range(CONFIGS):
        doc = generated(rng)
        path = tmp_path / f"job-{i}.yaml"
        path.write_text(yaml.safe_dump(doc))
        try:
            job = load_job_file(path)
            report = check_job(job.spec)
        except ConfigError as err:
            assert any(f in str(err) for f in FIELDS), (doc, str(err))
            refused += 1
            continue
        if not report.ok:
            problems = "\n".join(report.errors)
            assert any(f in problems for f in FIELDS), (doc, problems)
            refused += 1
            continue
        passed += 1
        process_starts(job.spec, tmp_path)  # raises if a process would refuse the job
    # Both sides are exercised: a generator that passes nothing (or everything) proves nothing.
    assert passed >= 40 and refused >= 80, (passed, refused)


def test_the_audits_configs_fail_in_the_processes_without_the_check(tmp_path: Path) -> None:
    """The rules check applies are the processes' own: without them, these would fail there."""
    fp16 = JobSpec.model_validate({"inner": {"precision": "fp16"}})
    with pytest.raises(ConfigError, match=r"inner\.precision fp16"):
        process_starts(fp16, tmp_path)
    assert device_problems(fp16, "cpu") and not device_problems(JobSpec(), "cpu")
    many = JobSpec.model_validate({"sync": {"fragments": 200}})
    with pytest.raises(ValueError, match=r"sync.fragments \(200\) is more than the model's 29"):
        process_starts(many, tmp_path)


def test_fp16_in_a_cluster_warns_unless_the_islands_ask_for_a_gpu() -> None:
    spec = JobSpec.model_validate({"inner": {"precision": "fp16"}})
    assert "needs CUDA" in cluster_device_warnings(spec)[0]
    gpu = {"limits": {"nvidia.com/gpu": 1}}
    spec = JobSpec.model_validate({"inner": {"precision": "fp16"}, "islands": {"resources": gpu}})
    assert cluster_device_warnings(spec) == []


@pytest.mark.parametrize(
    ("name", "ok"),
    [("demo", True), ("a-1", True), ("Bad_Name!", False), ("-a", False), ("a-", False),
     ("1a", False), ("x" * 41, True), ("x" * 42, False)],
)  # fmt: skip
def test_job_names_follow_the_crds_rule(name: str, ok: bool) -> None:
    assert (name_problem(name, {}) is None) == ok
    assert name_problem("x" * 39, {"islands": {"namePrefix": "eu"}}) is not None


def test_a_bare_specs_name_is_its_file_made_a_valid_name() -> None:
    assert bare_spec_name(Path("jobs/My_Job.yaml")) == "my-job"
    assert bare_spec_name(Path("2024 run!.yaml")) == "run"
    assert bare_spec_name(Path("___.yaml")) == "job"
    assert name_problem(bare_spec_name(Path("a" * 80 + ".yaml")), {}) is None
