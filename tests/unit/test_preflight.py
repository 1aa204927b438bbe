"""api/preflight.py: the checks the spec alone answers (the operator's before it creates pods,
and part of `diloco check`), with hand-derived figures."""

from __future__ import annotations

from dataclasses import replace

import pytest
from diloco_trainer.api.preflight import (
    PRESET_SHAPES,
    PROCESS_BYTES,
    estimate,
    gpt_parameters,
    model_vocab,
    spec_findings,
)
from diloco_trainer.api.spec import parse_spec
from diloco_trainer.models import model as gpt

MIB = 2**20


def test_preset_shapes_are_the_models() -> None:
    assert set(PRESET_SHAPES) == set(gpt.PRESETS)
    for name, cfg in gpt.PRESETS.items():
        assert PRESET_SHAPES[name] == (cfg.n_layer, cfg.n_embd), name
        assert cfg.mlp_ratio == 4 and cfg.bias, name
        full = replace(cfg, block_size=128, vocab_size=300)
        assert gpt_parameters(name, 128, 300) == gpt.gpt_parameters(full), name


def test_gpt_tiny_parameters_by_hand() -> None:
    # C=64, r=4: a block is 2 LayerNorms 4C + qkv 3C²+3C + proj C²+C + MLP 2rC²+rC+C = 49,984;
    # two blocks, token embedding and head 2·256·C, positions 64·C, final LayerNorm 2C.
    assert gpt_parameters("gpt-tiny", 64, 256) == 2 * 49_984 + 32_768 + 4_096 + 128 == 136_960


def tiny(**spec: object) -> dict[str, object]:
    base: dict[str, object] = {
        "model": {"preset": "gpt-tiny"},
        "inner": {"seqLen": 64, "batchSize": 8, "steps": 50, "warmupSteps": 20},
        "stopAfter": {"outerSteps": 20},
    }
    return {**base, **spec}


def test_learner_estimate_by_hand() -> None:
    need = estimate(parse_spec(tiny()), 256)
    # per token (17·C·2 blocks + 2 blocks·C + 3·V) floats = 3,072 floats = 12,288 bytes; a step
    # is 8 x 64 tokens; the weights, gradients and AdamW moments 16 bytes a parameter.
    assert need.learner == PROCESS_BYTES + 16 * 136_960 + 12_288 * 512 == 427_913_216


def test_findings_memory_against_the_pods_limits() -> None:
    fits = tiny(islands={"resources": {"limits": {"memory": "1Gi"}}})
    assert spec_findings(parse_spec(fits)).errors == []
    small = tiny(
        islands={"resources": {"limits": {"memory": "256Mi"}}},
        syncer={"resources": {"limits": {"memory": "300Mi"}}},
    )
    errors = spec_findings(parse_spec(small)).errors
    assert errors == [
        "islands.resources.limits.memory (0.25 GiB): a learner step needs about 0.40 GiB "
        "(inner.seqLen x inner.batchSize)",
        "syncer.resources.limits.memory (0.29 GiB): the syncer's evaluation needs about "
        "0.40 GiB (inner.seqLen x inner.batchSize, data.evalTokens)",
    ]
    # A user's model: its size is unknown until its build runs; nothing is claimed.
    byo = tiny(model={"entrypoint": "my_pkg.model:build"}, islands=small["islands"])
    assert spec_findings(parse_spec(byo)).errors == []


@pytest.mark.parametrize(
    ("spec", "starts"),
    [
        ({"stopAfter": {}}, "stopAfter: neither outerSteps nor tokens is set"),
        (
            {"stopAfter": {"outerSteps": 2}, "inner": {"steps": 5, "warmupSteps": 20}},
            "inner.warmupSteps (20) is longer than the whole run (2 outer steps x inner.steps 5 "
            "= 10 inner steps)",
        ),
    ],
)
def test_findings_schedule_warnings(spec: dict[str, object], starts: str) -> None:
    (warning,) = spec_findings(parse_spec(tiny(**spec))).warnings
    assert warning.startswith(starts), warning
    assert spec_findings(parse_spec(tiny())).warnings == []


def test_model_vocab_from_the_spec() -> None:
    assert model_vocab(parse_spec(tiny())) == 256
    bpe = tiny(data={"tokenizer": {"type": "bpe", "vocabSize": 4096}})
    assert model_vocab(parse_spec(bpe)) == 4096
