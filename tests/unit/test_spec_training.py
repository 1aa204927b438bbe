"""The training sections of the spec (api/training.py): gradient accumulation, precision,
compilation and activation checkpointing; defaults, refusals naming the field, and the work
bound the syncer derives from them."""

from __future__ import annotations

import pytest
from diloco_trainer.api import protocol
from diloco_trainer.api.spec import ConfigError, InnerSpec, ModelSpec, parse_spec
from diloco_trainer.api.training import InnerSpec as TrainingInnerSpec
from diloco_trainer.syncer.intake.guards import ContributionRefused, WorkBounds


def test_training_fields_default_to_todays_behaviour() -> None:
    spec = parse_spec({})
    assert spec.inner.micro_batches == 1
    assert spec.inner.precision == "fp32"
    assert spec.inner.compile is False
    assert spec.model.activation_checkpointing is False


def test_spec_module_re_exports_the_training_sections() -> None:
    assert InnerSpec is TrainingInnerSpec
    assert ModelSpec.model_fields["activation_checkpointing"].description


def test_tokens_per_step_is_batch_times_micro_batches_times_seq_len() -> None:
    spec = parse_spec({"inner": {"batchSize": 4, "microBatches": 3, "seqLen": 16}})
    assert spec.inner.tokens_per_step == 4 * 3 * 16 == 192


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        ({"inner": {"microBatches": 0}}, "spec.inner.microBatches"),
        ({"inner": {"microBatches": 5000}}, "spec.inner.microBatches"),
        ({"inner": {"precision": "fp8"}}, "spec.inner.precision"),
        ({"inner": {"compile": "sometimes"}}, "spec.inner.compile"),
        (
            {"model": {"activationCheckpointing": "yes please"}},
            "spec.model.activationCheckpointing",
        ),
        ({"model": {"preset": "gpt-7b"}}, "spec.model.preset"),
    ],
)
def test_training_fields_refused_with_their_names(doc: dict, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_spec(doc)
    assert str(err.value).startswith(field + ":"), str(err.value)


def test_work_bound_counts_micro_batches() -> None:
    # 1 step of 2 sequences x 4 micro-batches x 16 tokens x 2 replicas = 256 tokens at most.
    spec = parse_spec({"inner": {"steps": 10, "batchSize": 2, "microBatches": 4, "seqLen": 16}})
    bounds = WorkBounds.from_spec(spec)
    assert bounds.tokens_per_step == 128
    bounds.check(tokens=256, steps=1, replicas=2)
    with pytest.raises(ContributionRefused) as err:
        bounds.check(tokens=257, steps=1, replicas=2)
    assert err.value.code == protocol.ERROR_TOKENS_RANGE
    assert "inner.microBatches" in str(err.value)
