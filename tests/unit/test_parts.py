"""build_parts, evaluate, inner_lr and the inner optimizer."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from diloco_trainer.api.spec import ConfigError, parse_spec
from diloco_trainer.models.parts import (
    TrainingParts,
    build_parts,
    evaluate,
    inner_lr,
    make_inner_optimizer,
)

SPEC = {"inner": {"batchSize": 4, "seqLen": 32}, "data": {"evalTokens": 1024}}


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """One intra-op thread: on a shared, loaded CPU a thread pool makes tiny models slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_build_parts_same_weights_in_every_process_role() -> None:
    spec = parse_spec(SPEC)
    a = build_parts(spec, shard_index=0, num_shards=3)
    torch.randn(100)  # disturb the global RNG: build_parts must reseed
    b = build_parts(spec, shard_index=2, num_shards=3, rank=1, world_size=2, with_train=False)
    assert b.train is None and a.train is not None
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    other = build_parts(parse_spec({**SPEC, "model": {"seed": 1}}), shard_index=0, num_shards=3)
    assert not torch.equal(other.model.state_dict()["head.weight"], sa["head.weight"])


def test_build_parts_streams_differ_by_shard_and_eval_is_shared() -> None:
    spec = parse_spec(SPEC)
    a = build_parts(spec, shard_index=0, num_shards=2)
    b = build_parts(spec, shard_index=1, num_shards=2)
    assert a.train is not None and b.train is not None
    assert not torch.equal(a.train.next_batch().inputs, b.train.next_batch().inputs)
    assert len(a.eval_batches) == len(b.eval_batches) == 8  # 1024 tokens / 32 = 32 windows / 4
    assert all(
        torch.equal(x.inputs, y.inputs) for x, y in zip(a.eval_batches, b.eval_batches, strict=True)
    )
    assert a.plain_merge_names == frozenset({"tok_emb.weight", "pos_emb.weight"})


def test_evaluate_is_deterministic_and_restores_mode() -> None:
    parts = build_parts(parse_spec(SPEC), shard_index=0, num_shards=1, with_train=False)
    parts.model.train()
    first = evaluate(parts)
    assert parts.model.training
    assert evaluate(parts) == first
    assert first == pytest.approx(math.log(256), abs=0.1)
    # Another model of the same shape can be evaluated with the same eval set.
    other = build_parts(parse_spec({**SPEC, "model": {"seed": 5}}), shard_index=0, num_shards=1)
    assert evaluate(parts, other.model) != first


def test_build_parts_entrypoint_is_called_with_same_arguments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "my_byo_model.py").write_text(
        "import torch\n"
        "from diloco_trainer.parts import TrainingParts, lm_loss\n"
        "CALLS = []\n"
        "def build(spec, **kw):\n"
        "    CALLS.append(kw)\n"
        "    model = torch.nn.Linear(2, 2)\n"
        "    return TrainingParts(model, None, [], lm_loss, frozenset())\n"
        "def not_parts(spec, **kw):\n"
        "    return 42\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = parse_spec({**SPEC, "model": {"entrypoint": "my_byo_model:build", "seed": 9}})
    a = build_parts(spec, shard_index=1, num_shards=2, rank=0, world_size=1)
    b = build_parts(spec, shard_index=0, num_shards=2, with_train=False)
    assert isinstance(a, TrainingParts)
    assert torch.equal(a.model.weight, b.model.weight)  # seeded before the entrypoint runs
    import my_byo_model  # type: ignore[import-not-found]

    assert my_byo_model.CALLS[0] == {
        "shard_index": 1,
        "num_shards": 2,
        "rank": 0,
        "world_size": 1,
        "device": "cpu",
        "with_train": True,
    }
    bad = parse_spec({**SPEC, "model": {"entrypoint": "my_byo_model:not_parts"}})
    with pytest.raises(ConfigError, match=r"model\.entrypoint .* returned int"):
        build_parts(bad, shard_index=0, num_shards=1)


@pytest.mark.parametrize(
    ("entrypoint", "message"),
    [
        ("no_such_module_xyz:build", "cannot import module 'no_such_module_xyz'"),
        ("diloco_trainer.models.parts:no_such_fn", "has no callable 'no_such_fn'"),
    ],
)
def test_build_parts_bad_entrypoint_names_field(entrypoint: str, message: str) -> None:
    spec = parse_spec({**SPEC, "model": {"entrypoint": entrypoint}})
    with pytest.raises(ConfigError, match=r"model\.entrypoint") as err:
        build_parts(spec, shard_index=0, num_shards=1)
    assert message in str(err.value)


def test_build_parts_missing_source_names_data_source(tmp_path: Path) -> None:
    spec = parse_spec({**SPEC, "data": {"source": str(tmp_path / "none")}})
    with pytest.raises(ConfigError, match=r"data\.source"):
        build_parts(spec, shard_index=0, num_shards=1)


def test_inner_lr_warmup_then_constant_for_open_ended_runs() -> None:
    spec = parse_spec({"inner": {"lr": 1e-3, "warmupSteps": 4}})
    assert [inner_lr(spec, s) for s in range(5)] == pytest.approx(
        [2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3]
    )
    assert inner_lr(spec, 10**6) == 1e-3
    assert inner_lr(parse_spec({"inner": {"lr": 1e-3}}), 0) == 1e-3


def test_inner_lr_cosine_to_floor_when_outer_steps_known() -> None:
    spec = parse_spec(
        {"inner": {"lr": 1e-3, "warmupSteps": 10, "steps": 10}, "stopAfter": {"outerSteps": 11}}
    )
    total = 110
    assert inner_lr(spec, 9) == pytest.approx(1e-3)  # end of warm-up
    assert inner_lr(spec, 10) == pytest.approx(1e-3)  # cosine starts at the peak
    assert inner_lr(spec, 60) == pytest.approx(0.55e-3)  # half way: mean of peak and floor
    assert inner_lr(spec, total) == pytest.approx(1e-4)
    assert inner_lr(spec, 5 * total) == pytest.approx(1e-4)  # islands running past the end
    lrs = [inner_lr(spec, s) for s in range(10, total)]
    assert lrs == sorted(lrs, reverse=True)


def test_make_inner_optimizer_decays_only_matrices() -> None:
    spec = parse_spec({**SPEC, "inner": {**SPEC["inner"], "weightDecay": 0.3}})
    parts = build_parts(spec, shard_index=0, num_shards=1, with_train=False)
    opt = make_inner_optimizer(spec, parts.model)
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] == 0.3 for p in g["params"]}
    for name, p in parts.model.named_parameters():
        assert (id(p) in decayed) == (p.dim() >= 2), name
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(parts.model.parameters()))
