"""What `diloco check` finds in a job, as pure functions of the spec and the figures read.

Each returns the lines to show; the caller decides which are errors (the job cannot work) and
which are warnings (it works, probably not as meant).
"""

from __future__ import annotations

from dataclasses import dataclass

from diloco_trainer.api.preflight import (
    MemoryNeed,
    cluster_memory_errors,
    gib,
    round_tokens,
    run_tokens,
    schedule_warnings,
)
from diloco_trainer.api.spec import JobSpec

# The spec-only rules live in api/preflight.py (the operator runs them too); named here as well
# because `diloco check` reads them as its findings.
__all__ = [
    "TokenFigures",
    "cluster_memory_errors",
    "local_memory_error",
    "round_tokens",
    "run_tokens",
    "schedule_warnings",
    "token_lines",
]


@dataclass(frozen=True)
class TokenFigures:
    """A corpus as the learners will see it."""

    train: int
    eval: int


def token_lines(spec: JobSpec, figures: TokenFigures) -> tuple[list[str], list[str], list[str]]:
    """(info, warnings, errors) of the corpus's token counts against what the job reads."""
    info, warnings, errors = [], [], []
    need = round_tokens(spec)
    line = (
        f"tokens: {figures.train:,} train, {figures.eval:,} eval (data.evalTokens "
        f"{spec.data.eval_tokens:,}); one round of work reads {need:,}"
    )
    total = run_tokens(spec)
    if total is not None:
        line += f", the run {total:,} ({total / max(1, figures.train):.2f} epochs)"
    info.append(line)
    if figures.eval < spec.data.eval_tokens:
        warnings.append(
            f"data.evalTokens: the eval split has {figures.eval:,} tokens, fewer than "
            f"{spec.data.eval_tokens:,}: every evaluation reads windows of those again"
        )
    if figures.train < need:
        warnings.append(
            f"data.source: the train split ({figures.train:,} tokens) is smaller than one round "
            f"of work ({need:,}): every round reads it more than once"
        )
    seq = spec.inner.seq_len
    parts = spec.total_shards() * max(
        spec.islands.replicas_of(i) for i in range(spec.islands.count)
    )
    if figures.train // parts < seq + 1:
        errors.append(
            f"data.source: the train split has {figures.train:,} tokens, too few for {parts} "
            f"shard(s) of at least inner.seqLen+1 = {seq + 1:,} tokens"
        )
    if figures.eval < seq + 1:
        errors.append(
            f"data.source: the eval split has {figures.eval:,} tokens, fewer than "
            f"inner.seqLen+1 = {seq + 1:,}"
        )
    return info, warnings, errors


def local_memory_error(spec: JobSpec, need: MemoryNeed, available: int, cuda: bool) -> str | None:
    """Whether a local run's processes fit this machine (learners on the GPU with cuda)."""
    ranks = sum(spec.islands.replicas_of(i) for i in range(spec.islands.count))
    total = need.syncer + (0 if cuda else ranks * need.learner)
    if total <= available:
        return None
    who = "the syncer's evaluation" if cuda else f"{ranks} learner step(s) and the syncer's eval"
    return (
        f"inner.seqLen ({spec.inner.seq_len:,}) x inner.batchSize ({spec.inner.batch_size}): "
        f"{who} need about {gib(total)}, and this machine has {gib(available)} available: "
        "lower inner.seqLen or inner.batchSize (or data.evalTokens)"
    )
