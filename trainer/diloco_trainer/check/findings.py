"""What `diloco check` finds in a job, as pure functions of the spec and the figures read.

Each returns the lines to show; the caller decides which are errors (the job cannot work) and
which are warnings (it works, probably not as meant).
"""

from __future__ import annotations

from dataclasses import dataclass

from diloco_trainer.api.spec import JobSpec
from diloco_trainer.check.memory import MemoryNeed, gib, parse_quantity


@dataclass(frozen=True)
class TokenFigures:
    """A corpus as the learners will see it."""

    train: int
    eval: int


def round_tokens(spec: JobSpec) -> int:
    """Tokens of one round of work: every island's ranks take inner.steps steps."""
    ranks = sum(spec.islands.replicas_of(i) for i in range(spec.islands.count))
    return ranks * spec.inner.tokens_per_step * spec.inner.steps


def run_tokens(spec: JobSpec) -> int | None:
    """Tokens the whole run merges (the nearer stop condition), None when it never stops."""
    limits = []
    if spec.stop_after.outer_steps:
        limits.append(spec.stop_after.outer_steps * round_tokens(spec))
    if spec.stop_after.tokens:
        limits.append(spec.stop_after.tokens)
    return min(limits) if limits else None


def schedule_warnings(spec: JobSpec) -> list[str]:
    """No stop condition; a warm-up longer than the run."""
    out = []
    if not spec.stop_after.outer_steps and not spec.stop_after.tokens:
        out.append(
            "stopAfter: neither outerSteps nor tokens is set: the job runs until it is stopped "
            "(Ctrl-C, or deleting the DiLoCoJob)"
        )
    if spec.stop_after.outer_steps:
        inner_total = spec.stop_after.outer_steps * spec.inner.steps
        if spec.inner.warmup_steps > inner_total:
            out.append(
                f"inner.warmupSteps ({spec.inner.warmup_steps}) is longer than the whole run "
                f"({spec.stop_after.outer_steps} outer steps x inner.steps {spec.inner.steps} = "
                f"{inner_total} inner steps): the learning rate never reaches inner.lr"
            )
    return out


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


def _limit(resources: dict[str, object]) -> int | None:
    limits = resources.get("limits")
    if not isinstance(limits, dict) or "memory" not in limits:
        return None
    return parse_quantity(limits["memory"])


def cluster_memory_errors(spec: JobSpec, need: MemoryNeed) -> list[str]:
    """The estimates against the memory limits the pods get (a learner with a GPU is skipped:
    its activations are on the GPU)."""
    out = []
    for i in range(spec.islands.count):
        resources = spec.islands.resources_of(i)
        limit = _limit(resources)
        gpu = any("gpu" in str(k) for k in (resources.get("limits") or {}))
        if limit is not None and not gpu and need.learner > limit:
            out.append(
                f"islands.resources.limits.memory ({gib(limit)}): a learner step needs about "
                f"{gib(need.learner)} (inner.seqLen x inner.batchSize)"
            )
            break
    limit = _limit(spec.syncer.resources)
    if limit is not None and need.syncer > limit:
        out.append(
            f"syncer.resources.limits.memory ({gib(limit)}): the syncer's evaluation needs about "
            f"{gib(need.syncer)} (inner.seqLen x inner.batchSize, data.evalTokens)"
        )
    return out
