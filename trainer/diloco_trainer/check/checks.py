"""All of a job's checks in one call: what `diloco check` prints and `diloco run` does first."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from diloco_trainer.api.contract import DEVICE
from diloco_trainer.api.preflight import model_vocab
from diloco_trainer.api.spec import ConfigError, JobSpec
from diloco_trainer.check.findings import (
    TokenFigures,
    cluster_memory_errors,
    local_memory_error,
    schedule_warnings,
    token_lines,
)
from diloco_trainer.check.memory_estimate import available_bytes, estimate, gib
from diloco_trainer.check.start_rules import (
    builtin_tensor_sizes,
    cluster_device_warnings,
    device_problems,
    fragment_problem,
    spec_problems,
)


@dataclass
class Report:
    """What the checks found: lines to show, warnings, and errors (the job cannot run)."""

    info: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    parameters: int | None = None  # the model's, when known (the summary's bytes against DDP)
    tokenizer: str | None = None  # how the corpus was tokenized (the plot's unit)

    @property
    def ok(self) -> bool:
        return not self.errors


def _corpus(spec: JobSpec, report: Report) -> int | None:
    """Read the corpus as a learner will; its vocabulary size (None when it cannot be read)."""
    from diloco_trainer.models.data import corpus_for

    try:
        corpus = corpus_for(spec.data)
    except ConfigError as err:
        report.errors.append(str(err))
        return None
    report.info.append(corpus.brief or corpus.report)
    report.tokenizer = corpus.tokenizer.describe()
    report.info.append(f"tokenizer: {report.tokenizer}")
    figures = TokenFigures(train=corpus.train.numel(), eval=corpus.eval.numel())
    info, warnings, errors = token_lines(spec, figures)
    report.info += info
    report.warnings += warnings
    report.errors += errors
    return corpus.vocab_size


def _memory(spec: JobSpec, vocab_size: int, report: Report, *, cluster: bool) -> None:
    need = estimate(spec, vocab_size)
    report.parameters = need.parameters
    report.info.append(
        f"model: {spec.model.preset}, {need.parameters:,} parameters; memory: a learner step "
        f"about {gib(need.learner)}, the syncer's evaluation about {gib(need.syncer)}"
    )
    if cluster:
        report.errors += cluster_memory_errors(spec, need)
        return
    available = available_bytes()
    if available is None:
        report.warnings.append("memory: cannot tell how much this machine has; not checked")
        return
    cuda = local_device().startswith("cuda")
    problem = local_memory_error(spec, need, available, cuda)
    if problem is not None:
        report.errors.append(problem)


def local_device() -> str:
    """The learners' device in a local run: DILOCO_DEVICE of this environment, cpu when unset
    (local/run.py gives the learners the same)."""
    return os.environ.get(DEVICE) or "cpu"


def check_job(spec: JobSpec, *, cluster: bool = False) -> Report:
    """Every check of one job: what its processes refuse at start (start_rules.py), its
    schedule, its data (read as the learners will), the memory of the built-in GPT against this
    machine (or with `cluster`, the pods' limits), and an entrypoint's build called once."""
    report = Report(warnings=schedule_warnings(spec), errors=spec_problems(spec))
    if cluster:
        report.warnings += cluster_device_warnings(spec)
    else:
        report.errors += device_problems(spec, local_device())
        if spec.syncer.remote:
            report.errors.append(
                "syncer.endpoint (or syncer.shardEndpoints) is set: a local run (diloco run) "
                "starts its own syncer; remove it, or check the job with --cluster"
            )
    if spec.model.entrypoint:
        from diloco_trainer.check.build import build_once

        try:
            elements = build_once(spec)
        except ConfigError as err:
            report.errors.append(str(err))
            return report
        params = sum(elements.values())
        report.parameters = params
        report.info.append(f"model: {spec.model.entrypoint} built, {params:,} parameters")
        _fragments(spec, {n: 4 * e for n, e in elements.items()}, report)
        return report
    if cluster and not _readable_here(spec):
        report.warnings.append(
            f"data.source {spec.data.source}: a path in the pods, not on this machine: not read "
            "(--data DIR reads a local copy of it)"
        )
        vocab_size = model_vocab(spec)
    else:
        vocab_size = _corpus(spec, report)
    # The tensors (not their sizes) are the same whatever the vocabulary: bytes' when unknown.
    _fragments(spec, builtin_tensor_sizes(spec, vocab_size or 256), report)
    if vocab_size is not None and report.ok:
        _memory(spec, vocab_size, report, cluster=cluster)
    return report


def _fragments(spec: JobSpec, sizes: dict[str, int], report: Report) -> None:
    problem = fragment_problem(sizes, spec)
    if problem is not None:
        report.errors.append(problem)


def _readable_here(spec: JobSpec) -> bool:
    return spec.data.source.startswith("builtin:") or Path(spec.data.source).exists()
