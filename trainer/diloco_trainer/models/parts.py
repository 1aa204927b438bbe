"""What a training process needs, built from the job spec: model, data, loss, eval set.

`build_parts` is the one place that turns a JobSpec into torch objects, for learners, the syncer
(which only needs the model shapes and eval batches) and the synchronous baseline alike. A job can
bring its own model with `model.entrypoint: "pkg.mod:fn"`: fn receives the same keyword arguments as
build_parts and returns TrainingParts.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from diloco_trainer.api.spec import ConfigError, JobSpec
from diloco_trainer.models.data import Batch, TokenStream, corpus_for, eval_batches
from diloco_trainer.models.model import GPT, build_model

LossFn = Callable[[nn.Module, Batch], Tensor]

# Cosine schedules (only used when the run length is known) decay to this share of the peak lr.
MIN_LR_RATIO = 0.1
ADAMW_BETAS = (0.9, 0.95)  # the usual choice for transformer LMs (GPT-3, nanoGPT)


class TrainStream(Protocol):
    """What a learner asks of its train stream: the next batch, on every inner step (forever:
    a stream that runs out of data starts another epoch itself). TokenStream is one."""

    def next_batch(self) -> Batch: ...


@dataclass
class TrainingParts:
    """Everything model-specific that the learner, syncer and baseline need."""

    model: nn.Module
    train: TrainStream | None  # None when built with with_train=False (e.g. the syncer)
    eval_batches: list[Batch]
    loss_fn: LossFn
    # Parameters that RDA merges with the plain weighted mean (embedding tables).
    plain_merge_names: frozenset[str]


def lm_loss(model: nn.Module, batch: Batch) -> Tensor:
    """Mean next-token cross-entropy of a batch (moved to the model's device if needed)."""
    device = next(model.parameters()).device
    logits = model(batch.inputs.to(device))  # (B, T, V)
    return F.cross_entropy(logits.flatten(0, 1), batch.targets.to(device).flatten())


def _load_entrypoint(entrypoint: str) -> Callable[..., TrainingParts]:
    module_name, _, fn_name = entrypoint.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(
            f"model.entrypoint {entrypoint!r}: cannot import module {module_name!r}: {err}"
        ) from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ConfigError(
            f"model.entrypoint {entrypoint!r}: module {module_name!r} has no callable {fn_name!r}"
        )
    return fn


def build_parts(
    spec: JobSpec,
    *,
    shard_index: int,
    num_shards: int,
    rank: int = 0,
    world_size: int = 1,
    device: str = "cpu",
    with_train: bool = True,
) -> TrainingParts:
    """Model (identical initial weights everywhere), this rank's train stream, eval batches, loss.

    The global RNG is seeded with spec.model.seed right before the model is built, so the initial
    weights are a pure function of the seed in every process, for the built-in GPT and for an
    entrypoint alike. The built-in GPT's vocabulary is the tokenizer's (data.tokenizer).
    """
    if spec.model.entrypoint:
        torch.manual_seed(spec.model.seed)
        fn = _load_entrypoint(spec.model.entrypoint)
        parts = fn(
            spec,
            shard_index=shard_index,
            num_shards=num_shards,
            rank=rank,
            world_size=world_size,
            device=device,
            with_train=with_train,
        )
        if not isinstance(parts, TrainingParts):
            raise ConfigError(
                f"model.entrypoint {spec.model.entrypoint!r} returned "
                f"{type(parts).__name__}, expected diloco_trainer.parts.TrainingParts"
            )
        return parts

    corpus = corpus_for(spec.data)
    torch.manual_seed(spec.model.seed)
    model: GPT = build_model(
        spec.model.preset,
        spec.inner.seq_len,
        corpus.vocab_size,
        activation_checkpointing=spec.model.activation_checkpointing,
    ).to(device)
    train = None
    if with_train:
        train = TokenStream(
            corpus.train,
            shard_index=shard_index,
            num_shards=num_shards,
            rank=rank,
            world_size=world_size,
            batch_size=spec.inner.batch_size,
            seq_len=spec.inner.seq_len,
            seed=spec.data.seed,
            device=device,
        )
    evals = eval_batches(
        corpus.eval,
        eval_tokens=spec.data.eval_tokens,
        batch_size=spec.inner.batch_size,
        seq_len=spec.inner.seq_len,
        device=device,
    )
    return TrainingParts(
        model=model,
        train=train,
        eval_batches=evals,
        loss_fn=lm_loss,
        plain_merge_names=model.embedding_names(),
    )


@torch.no_grad()
def evaluate(parts: TrainingParts, model: nn.Module | None = None) -> float:
    """Mean loss over the eval batches (token-weighted), without gradients.

    `model` defaults to parts.model; pass another module of the same architecture (e.g. the
    syncer's global weights) to evaluate that instead. The training/eval mode is restored.
    """
    model = parts.model if model is None else model
    was_training = model.training
    model.eval()
    try:
        total, tokens = 0.0, 0
        for batch in parts.eval_batches:
            total += float(parts.loss_fn(model, batch)) * batch.tokens
            tokens += batch.tokens
    finally:
        model.train(was_training)
    if tokens == 0:
        raise ValueError("no eval batches: data.evalTokens must be > 0")
    return total / tokens


def inner_lr(spec: JobSpec, step: int) -> float:
    """Inner learning rate for the inner step with 0-based index `step` (counted over all rounds).

    Linear warm-up over inner.warmupSteps, then:
    - constant at inner.lr when the run length is open (no stopAfter.outerSteps). A decoupled run
      has no known total step count (islands join, leave and run at different speeds, and
      stopAfter.tokens does not fix a step count), and a cosine needs one;
    - when stopAfter.outerSteps is set, a cosine from inner.lr down to MIN_LR_RATIO * inner.lr over
      outerSteps * inner.steps steps, then flat at that floor (a fast island may run past it).
    """
    peak = spec.inner.lr
    warmup = spec.inner.warmup_steps
    if step < warmup:
        return peak * (step + 1) / warmup
    if spec.stop_after.outer_steps is None:
        return peak
    total = spec.stop_after.outer_steps * spec.inner.steps
    if total <= warmup:
        return peak
    progress = min(1.0, (step - warmup) / (total - warmup))
    floor = MIN_LR_RATIO * peak
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))


def make_inner_optimizer(spec: JobSpec, model: nn.Module) -> torch.optim.AdamW:
    """The inner AdamW (decay on matrices only, as GPT-2 does), shared by learners and baseline."""
    named: Iterable[tuple[str, nn.Parameter]] = (
        (n, p) for n, p in model.named_parameters() if p.requires_grad
    )
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for _, p in named:
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": spec.inner.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=inner_lr(spec, 0), betas=ADAMW_BETAS)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate of every parameter group."""
    for group in optimizer.param_groups:
        group["lr"] = lr
