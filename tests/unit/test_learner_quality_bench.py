"""bench/learner_quality.py's pure parts: the two jobs differ only in parallelism and precision,
and the comparison pairs seeds at equal tokens and applies the 2% rule."""

from __future__ import annotations

import pytest
from diloco_trainer.api.spec import parse_spec

from bench import learner_quality as lq


def outcome(kind: tuple[str, str], seed: int, loss: float, tokens: int = 1000) -> lq.Outcome:
    return lq.Outcome(kind[0], kind[1], seed, tokens, loss, 5.5, 1.0)


def test_the_two_jobs_differ_only_in_parallelism_and_precision() -> None:
    args = lq.parser().parse_args(["--seeds", "3", "--rounds", "4", "--micro-batches", "2"])
    base = lq.job_manifest(args, "ddp", "fp32", 3)
    cand = lq.job_manifest(args, "fsdp", "bf16", 3)
    assert base["islands"].pop("parallelism") == "ddp"
    assert cand["islands"].pop("parallelism") == "fsdp"
    assert base["inner"].pop("precision") == "fp32"
    assert cand["inner"].pop("precision") == "bf16"
    assert base == cand
    spec = parse_spec(lq.job_manifest(args, "fsdp", "bf16", 3))
    assert (spec.model.seed, spec.data.seed) == (3, 3)
    assert (spec.islands.count, spec.islands.replicas) == (2, 2)
    assert spec.sync.quorum == 2  # K = M: both jobs merge every island's work
    assert spec.inner.micro_batches == 2
    assert spec.stop_after.outer_steps == 4


def test_compare_pairs_each_seed_and_applies_the_two_percent_rule() -> None:
    pairs = lq.compare(
        [
            outcome(lq.CANDIDATE, 1, 2.05),
            outcome(lq.BASELINE, 0, 2.0),
            outcome(lq.CANDIDATE, 0, 2.03),
            outcome(lq.BASELINE, 1, 2.0),
            outcome(lq.BASELINE, 2, 2.0),
            outcome(lq.CANDIDATE, 2, 1.95),
        ]
    )
    assert [c.seed for c in pairs] == [0, 1, 2]
    # 2.03 / 2.0 = 1.015 (within 2%); 2.05 / 2.0 = 1.025 and 1.95 / 2.0 = 0.975 (outside).
    assert [c.ratio for c in pairs] == pytest.approx([1.015, 1.025, 0.975])
    assert [c.met for c in pairs] == [True, False, False]


def test_compare_refuses_unequal_tokens_and_a_missing_kind() -> None:
    with pytest.raises(ValueError, match="unequal tokens, 1000 and 999"):
        lq.compare([outcome(lq.BASELINE, 0, 2.0), outcome(lq.CANDIDATE, 0, 2.0, tokens=999)])
    with pytest.raises(ValueError, match="seed 4: needs both"):
        lq.compare([outcome(lq.BASELINE, 4, 2.0)])


def test_outcome_of_reads_the_status_and_refuses_one_without_eval_loss() -> None:
    status = {"finished": True, "tokens": 71680, "evalLoss": 2.8, "initialEvalLoss": 5.6}
    out = lq.outcome_of(status, lq.CANDIDATE, 0, 12.5)
    assert (out.parallelism, out.precision) == ("fsdp", "bf16")
    assert (out.tokens, out.eval_loss, out.initial_eval_loss) == (71680, 2.8, 5.6)
    with pytest.raises(RuntimeError, match="no eval loss"):
        lq.outcome_of({**status, "evalLoss": None}, lq.BASELINE, 0, 1.0)
