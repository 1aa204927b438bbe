"""`diloco check`'s pure parts: the document rules, the findings and the memory estimate's
arithmetic (tests/e2e/test_bad_input.py runs the command on each bad input of issue 24)."""

from __future__ import annotations

from pathlib import Path

import pytest
from diloco_trainer.api.spec import ConfigError, parse_spec
from diloco_trainer.check.document import load_job_file, quorum_problem, spec_document
from diloco_trainer.check.findings import (
    TokenFigures,
    cluster_memory_errors,
    local_memory_error,
    round_tokens,
    run_tokens,
    schedule_warnings,
    token_lines,
)
from diloco_trainer.check.memory_estimate import estimate, parse_quantity
from diloco_trainer.local.job import DEFAULT_SPEC

GIB = 2**30


def test_check_document_bare_spec_and_manifest() -> None:
    path = Path("jobs/my-job.yaml")
    assert spec_document(path, {"islands": {"count": 2}}) == ("my-job", {"islands": {"count": 2}})
    manifest = {
        "apiVersion": "diloco.dev/v1alpha1",
        "kind": "DiLoCoJob",
        "metadata": {"name": "named"},
        "spec": {"inner": {"steps": 3}},
    }
    assert spec_document(path, manifest) == ("named", {"inner": {"steps": 3}})


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        (None, "jobs/x.yaml: the file is empty"),
        ([1, 2], "jobs/x.yaml: expected a DiLoCoJob manifest (a mapping), got a list"),
        ({"kind": "Deployment", "spec": {}}, "jobs/x.yaml: kind: 'Deployment' is not a DiLoCoJob"),
        ({"apiVersion": "v1", "spec": {}}, "jobs/x.yaml: kind: missing is not a DiLoCoJob"),
        ({"apiVersion": "v2", "kind": "DiLoCoJob", "spec": {}}, "apiVersion: 'v2' is not"),
        ({"apiVersion": "diloco.dev/v1alpha1", "kind": "DiLoCoJob"}, "spec: missing"),
    ],
)
def test_check_document_refusals_name_the_file_and_field(doc: object, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        spec_document(Path("jobs/x.yaml"), doc)
    assert message in str(err.value)


def test_check_quorum_names_the_fields_the_user_set() -> None:
    problem = quorum_problem({"islands": {"count": 3}, "sync": {"quorum": 5}})
    assert problem is not None and problem.startswith(
        "sync.quorum (5) must be <= islands.count (3)"
    )
    assert quorum_problem({"sync": {"quorum": 3}}) is not None  # islands.count's default: 2
    assert quorum_problem({"islands": {"count": 3}, "sync": {"quorum": 3}}) is None
    # Multi-region: the model's own check (which knows totalShards) applies.
    assert (
        quorum_problem({"islands": {"count": 1, "totalShards": 4}, "sync": {"quorum": 3}}) is None
    )


def test_check_relative_paths_are_the_config_folders(tmp_path: Path) -> None:
    folder = tmp_path / "project"
    folder.mkdir()
    config = folder / "job.yaml"
    config.write_text(
        "data:\n  source: corpus/\n  tokenizer: {type: file, path: tok/tokenizer.json}\n"
    )
    job = load_job_file(config)
    assert job.spec.data.source == str(folder / "corpus")
    assert job.spec.data.tokenizer.path == str(folder / "tok" / "tokenizer.json")
    config.write_text("data: {source: builtin:stdlib-text}\n")
    assert load_job_file(config).spec.data.source == "builtin:stdlib-text"


def test_check_schedule_warnings() -> None:
    assert any("stopAfter" in w for w in schedule_warnings(parse_spec({})))
    long_warmup = parse_spec(
        {"inner": {"warmupSteps": 1001, "steps": 50}, "stopAfter": {"outerSteps": 20}}
    )
    (warning,) = schedule_warnings(long_warmup)
    assert warning.startswith("inner.warmupSteps (1001) is longer than the whole run")
    assert "1000 inner steps" in warning
    fine = parse_spec(
        {"inner": {"warmupSteps": 1000, "steps": 50}, "stopAfter": {"outerSteps": 20}}
    )
    assert schedule_warnings(fine) == []


def test_check_warns_a_sharded_job_of_two_has_no_quality_guard() -> None:
    stop = {"stopAfter": {"outerSteps": 20}}
    two = parse_spec(
        {**stop, "islands": {"count": 2}, "sync": {"fragments": 2}, "syncer": {"shards": 2}}
    )
    (warning,) = schedule_warnings(two)
    assert warning.startswith("syncer.qualityGuard: a sharded syncer (syncer.shards 2)")
    assert "with 2 islands" in warning
    # Three islands (robust aggregation), one syncer, or the guard turned off: no warning.
    three = parse_spec(
        {**stop, "islands": {"count": 3}, "sync": {"fragments": 2}, "syncer": {"shards": 2}}
    )
    one = parse_spec({**stop, "islands": {"count": 2}})
    off = parse_spec(
        {**stop, "islands": {"count": 2}, "sync": {"fragments": 2},
         "syncer": {"shards": 2, "qualityGuard": {"patience": 0}}}
    )  # fmt: skip
    assert schedule_warnings(three) == schedule_warnings(one) == schedule_warnings(off) == []


def test_check_token_counts_against_eval_tokens_and_a_round() -> None:
    spec = parse_spec(DEFAULT_SPEC)
    # 3 islands x 50 steps x 8 x 64 tokens.
    assert round_tokens(spec) == 76_800 and run_tokens(spec) == 20 * 76_800
    info, warnings, errors = token_lines(spec, TokenFigures(train=10_000_000, eval=1_758))
    assert info[0].startswith("tokens: 10,000,000 train, 1,758 eval (data.evalTokens 8,192)")
    assert warnings == [
        "data.evalTokens: the eval split has 1,758 tokens, fewer than 8,192: every evaluation "
        "reads windows of those again"
    ]
    assert errors == []
    _, warnings, errors = token_lines(spec, TokenFigures(train=150, eval=10))
    assert any("smaller than one round of work (76,800)" in w for w in warnings)
    assert any("too few for 3 shard(s)" in e for e in errors)
    assert any("eval split has 10 tokens, fewer than inner.seqLen+1 = 65" in e for e in errors)


def test_check_demo_at_the_largest_seq_len_does_not_fit_24_gib() -> None:
    # Issue 24: seqLen 131072 in the demo ran out of memory on a 24 GiB machine after ~50 s.
    spec = parse_spec({**DEFAULT_SPEC, "inner": {**DEFAULT_SPEC["inner"], "seqLen": 131072}})
    need = estimate(spec, 256)
    problem = local_memory_error(spec, need, 24 * GIB, cuda=False)
    assert problem is not None and problem.startswith(
        "inner.seqLen (131,072) x inner.batchSize (8): 3 learner step(s) and the syncer's eval"
    )
    demo = parse_spec(DEFAULT_SPEC)
    assert local_memory_error(demo, estimate(demo, 256), 4 * GIB, cuda=False) is None


def test_check_memory_against_the_pods_limits() -> None:
    spec = parse_spec(
        {
            "inner": {"seqLen": 8192, "batchSize": 64},
            "islands": {"resources": {"limits": {"memory": "2Gi"}}},
            "syncer": {"resources": {"limits": {"memory": "100Mi"}}},
        }
    )
    errors = cluster_memory_errors(spec, estimate(spec, 256))
    assert errors[0].startswith("islands.resources.limits.memory (2.00 GiB): a learner step")
    assert errors[1].startswith("syncer.resources.limits.memory (0.10 GiB)")
    assert parse_quantity("2Gi") == 2 * GIB and parse_quantity("1.5G") == 1_500_000_000
    assert parse_quantity("512Mi") == 512 * 2**20 and parse_quantity("lots") is None


def test_check_refuses_bad_round_limits_naming_the_fields(tmp_path: Path) -> None:
    """Issue 47's knobs: what `diloco check` and `diloco run` read (load_job_file) names each
    bad field: a minSteps above inner.steps, a pinned innerSteps of 0."""
    job = tmp_path / "job.yaml"
    job.write_text(
        "inner: {steps: 30, stepsPerIsland: auto, minSteps: 40}\n"
        "islands: {overrides: [{islands: [0], innerSteps: 0}]}\n"
    )
    with pytest.raises(ConfigError) as err:
        load_job_file(job)
    text = str(err.value)
    assert "spec.islands.overrides.0.innerSteps" in text
    assert "inner.minSteps (40) must be <= inner.steps (30)" in text
