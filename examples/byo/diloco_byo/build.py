"""The entrypoint: `model.entrypoint: "diloco_byo.build:build"`."""

from __future__ import annotations

from diloco_trainer.api.spec import JobSpec
from diloco_trainer.parts import TrainingParts, lm_loss

from diloco_byo.data import RandomWindows, eval_set, part_of, read_text
from diloco_byo.model import CharGRU


def build(
    spec: JobSpec,
    *,
    shard_index: int,
    num_shards: int,
    rank: int,
    world_size: int,
    device: str,
    with_train: bool,
) -> TrainingParts:
    """The model, this rank's train stream, the eval batches and the loss.

    Called by every learner rank (with_train=True) and by the syncer (with_train=False: it only
    evaluates, so it never reads data.source). torch's global RNG is already seeded with
    spec.model.seed, so CharGRU() starts from the same weights in every process.
    """
    model = CharGRU().to(device)
    stream = None
    if with_train:
        shard = part_of(read_text(spec.data.source), shard_index, num_shards)
        stream = RandomWindows(
            part_of(shard, rank, world_size),
            batch_size=spec.inner.batch_size,
            seq_len=spec.inner.seq_len,
            # Distinct per island and rank, the same on every restart of them.
            seed=spec.data.seed * 1_000_003 + shard_index * 1009 + rank,
            device=device,
        )
    evals = eval_set(
        tokens=spec.data.eval_tokens,
        batch_size=spec.inner.batch_size,
        seq_len=spec.inner.seq_len,
        device=device,
    )
    return TrainingParts(
        model=model,
        train=stream,
        eval_batches=evals,
        loss_fn=lm_loss,
        plain_merge_names=frozenset({"embed.weight"}),
    )
