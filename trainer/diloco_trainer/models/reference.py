"""The synchronous data-parallel baseline that DiLoCo is measured against.

One process simulates num_workers data-parallel workers exactly: every step each worker draws one
batch from its own shard (the same shards the DiLoCo islands use), the gradients are averaged (as
an all-reduce would), and one inner optimizer step is taken, with the same initial weights,
optimizer, schedule and clipping as the islands. DiLoCo with M islands of S inner steps each at
batch B consumes M*S*B sequences; this baseline consumes the same with S steps of M*B.
"""

from __future__ import annotations

from typing import Any

import torch

from diloco_trainer.api.spec import JobSpec
from diloco_trainer.models.model import count_parameters
from diloco_trainer.models.parts import (
    build_parts,
    evaluate,
    inner_lr,
    make_inner_optimizer,
    set_lr,
)

FP32_BYTES = 4


def bytes_per_worker(num_params: int, num_workers: int, steps: int) -> int:
    """Bytes each worker sends in `steps` ring all-reduces of fp32 gradients: 2(M-1)/M * 4 * P.

    A ring all-reduce (reduce-scatter then all-gather) sends 2(M-1)/M of the buffer per worker.
    """
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    per_step = 2 * (num_workers - 1) * FP32_BYTES * num_params / num_workers
    return round(per_step * steps)


def train_synchronous(spec: JobSpec, *, num_workers: int, total_steps: int) -> dict[str, Any]:
    """Train the spec's model with synchronous data parallelism over num_workers simulated workers.

    Returns {"eval_loss", "initial_eval_loss", "tokens", "bytes_per_worker", "steps",
    "num_workers", "num_params"}.
    """
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    if total_steps < 0:
        raise ValueError(f"total_steps must be >= 0, got {total_steps}")
    parts = [build_parts(spec, shard_index=w, num_shards=num_workers) for w in range(num_workers)]
    lead = parts[0]  # its model is the one trained; the others contribute only their streams
    model = lead.model
    model.train()
    optimizer = make_inner_optimizer(spec, model)
    initial = evaluate(lead)
    tokens = 0
    for step in range(total_steps):
        set_lr(optimizer, inner_lr(spec, step))
        optimizer.zero_grad(set_to_none=True)
        micro = spec.inner.micro_batches
        for p in parts:
            assert p.train is not None
            for _ in range(micro):  # inner.microBatches, as the learners accumulate them
                batch = p.train.next_batch()
                # Mean over workers of per-worker mean losses = the all-reduced gradient.
                (lead.loss_fn(model, batch) / (num_workers * micro)).backward()
                tokens += batch.tokens
        if spec.inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec.inner.grad_clip)
        optimizer.step()
    num_params = count_parameters(model)
    return {
        "eval_loss": evaluate(lead),
        "initial_eval_loss": initial,
        "tokens": tokens,
        "bytes_per_worker": bytes_per_worker(num_params, num_workers, total_steps),
        "steps": total_steps,
        "num_workers": num_workers,
        "num_params": num_params,
    }
