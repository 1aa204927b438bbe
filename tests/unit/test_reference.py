"""The synchronous data-parallel baseline and its byte estimate."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from diloco_trainer.api.spec import parse_spec
from diloco_trainer.models.parts import (
    build_parts,
    evaluate,
    inner_lr,
    make_inner_optimizer,
    set_lr,
)
from diloco_trainer.models.reference import bytes_per_worker, train_synchronous

SPEC = {
    "model": {"preset": "gpt-tiny", "seed": 3},
    "inner": {"batchSize": 4, "seqLen": 32, "lr": 3e-3, "warmupSteps": 2},
    "data": {"evalTokens": 1024},
}


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """One intra-op thread: on a shared, loaded CPU a thread pool makes tiny models slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_bytes_per_worker_is_ring_all_reduce() -> None:
    assert bytes_per_worker(1000, 1, 10) == 0
    assert bytes_per_worker(1000, 2, 10) == 2 * 1 / 2 * 4 * 1000 * 10
    assert bytes_per_worker(1000, 4, 1) == 6000
    with pytest.raises(ValueError):
        bytes_per_worker(1000, 0, 1)


def test_train_synchronous_reports_tokens_bytes_and_improves() -> None:
    spec = parse_spec(SPEC)
    out = train_synchronous(spec, num_workers=2, total_steps=6)
    assert out["tokens"] == 6 * 2 * 4 * 32
    assert out["bytes_per_worker"] == bytes_per_worker(out["num_params"], 2, 6)
    assert out["eval_loss"] < out["initial_eval_loss"]
    assert out["initial_eval_loss"] == pytest.approx(5.55, abs=0.1)  # ~ln(256) at init


def test_train_synchronous_equals_one_big_batch_over_the_shards() -> None:
    """M workers' averaged gradients = one step on the concatenation of their batches."""
    spec = parse_spec(SPEC)
    steps, workers = 3, 2
    out = train_synchronous(spec, num_workers=workers, total_steps=steps)

    parts = [build_parts(spec, shard_index=w, num_shards=workers) for w in range(workers)]
    model = parts[0].model
    opt = make_inner_optimizer(spec, model)
    for step in range(steps):
        set_lr(opt, inner_lr(spec, step))
        batches = [p.train.next_batch() for p in parts if p.train is not None]
        x = torch.cat([b.inputs for b in batches])
        y = torch.cat([b.targets for b in batches])
        opt.zero_grad()
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.inner.grad_clip)
        opt.step()
    assert out["eval_loss"] == pytest.approx(evaluate(parts[0]), rel=1e-4)


def test_train_synchronous_rejects_bad_arguments() -> None:
    spec = parse_spec(SPEC)
    with pytest.raises(ValueError, match="num_workers"):
        train_synchronous(spec, num_workers=0, total_steps=1)
    with pytest.raises(ValueError, match="total_steps"):
        train_synchronous(spec, num_workers=1, total_steps=-1)


def test_train_synchronous_accumulates_micro_batches_like_the_learners() -> None:
    """batchSize 2 x microBatches 2 reads the same windows as batchSize 4: same tokens, same
    loss (up to summation order)."""
    whole = train_synchronous(parse_spec(SPEC), num_workers=2, total_steps=3)
    halves_doc = {**SPEC, "inner": {**SPEC["inner"], "batchSize": 2, "microBatches": 2}}
    halves = train_synchronous(parse_spec(halves_doc), num_workers=2, total_steps=3)
    assert halves["tokens"] == whole["tokens"] == 3 * 2 * 2 * 2 * 32
    assert halves["eval_loss"] == pytest.approx(whole["eval_loss"], rel=1e-4)
