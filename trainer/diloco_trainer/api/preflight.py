"""What a job's spec alone tells before any process starts (pure, torch-free): the schedule
(no stop condition, a warm-up longer than the run) and the memory of a learner's step and of
the syncer's evaluation of the built-in GPT against the pods' `resources.limits`.

`diloco check` (check/) adds what needs the data or torch (the corpus read as the learners will,
a user's `build`, this machine's memory); the operator runs `spec_findings` before it creates a
job's pods and posts the result as the job's `Checked` condition (operator/preflight.py).

The memory estimates are deliberately simple, per token of a batch and per parameter, and
measured against the real model (tests/unit/test_check_memory.py: within a factor of two of the
peak RSS of a step and of an evaluation):
- a learner's inner step keeps, per token, about 17 floats of width C per block for the
  backward pass (LayerNorms, qkv, attention output, MLP in and out, residuals) and the logits
  three times (logits, log-softmax, their gradient); attention itself is the fused kernel whose
  memory grows with T, not T²; the weights, gradients and AdamW's two moments are 16 bytes a
  parameter;
- the syncer's evaluation runs without gradients: per token the logits four times and a few
  widths C; the syncer holds about five fp32 copies of the weights (ARCHITECTURE.md, "The
  syncer's memory");
- every process pays PROCESS_BYTES for the interpreter and torch.
bf16/fp16 halve the activations; activation checkpointing keeps one block's instead of all.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from diloco_trainer.api.spec import JobSpec

FLOAT = 4
PROCESS_BYTES = 400 * 2**20  # python, torch and the corpus of one process
ACTIVATION_WIDTHS = 17  # floats of width C kept per token and block for the backward pass
SYNCER_COPIES = 5  # θ exact, momentum, pull bodies, the eval copy, θ published
# The built-in presets' (n_layer, n_embd), MLP ratio 4 and biases: models/model.PRESETS without
# torch (tests/unit/test_preflight.py keeps the two equal).
PRESET_SHAPES: dict[str, tuple[int, int]] = {
    "gpt-tiny": (2, 64),
    "gpt-mini": (4, 128),
    "gpt-small": (6, 384),
    "gpt-125m": (18, 768),
    "gpt-350m": (28, 1024),
    "gpt-1b": (20, 2048),
}
MLP_RATIO = 4
_QUANTITY = re.compile(r"^([0-9.]+)([KMGTPE]i?)?$")
_UNITS = {"K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}


@dataclass(frozen=True)
class MemoryNeed:
    """Estimated peak bytes of one learner rank (a step) and of the syncer (an evaluation)."""

    learner: int
    syncer: int
    parameters: int


@dataclass
class Findings:
    """What the spec alone says: warnings (it runs, probably not as meant) and errors (it
    cannot run as written), each naming the field."""

    warnings: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def gpt_parameters(preset: str, seq_len: int, vocab_size: int) -> int:
    """The built-in GPT's parameter count (models/model.gpt_parameters, from the preset)."""
    n_layer, c = PRESET_SHAPES[preset]
    r = MLP_RATIO
    block = 2 * 2 * c + (3 * c * c + 3 * c) + (c * c + c) + (2 * r * c * c + r * c + c)
    return n_layer * block + 2 * vocab_size * c + seq_len * c + 2 * c


def eval_rows(spec: JobSpec) -> int:
    """Sequences in the syncer's largest eval batch (models/data.eval_batches)."""
    windows = max(1, -(-spec.data.eval_tokens // spec.inner.seq_len))
    return min(windows, spec.inner.batch_size)


def estimate(spec: JobSpec, vocab_size: int) -> MemoryNeed:
    """The estimates of the module docstring for the built-in GPT of `spec`."""
    n_layer, c = PRESET_SHAPES[spec.model.preset]
    params = gpt_parameters(spec.model.preset, spec.inner.seq_len, vocab_size)
    v = vocab_size
    half = spec.inner.precision in ("bf16", "fp16")
    kept_blocks = 1 if spec.model.activation_checkpointing else n_layer
    per_token = (ACTIVATION_WIDTHS * c * kept_blocks + n_layer * c + 3 * v) * FLOAT
    if half:
        per_token //= 2
    step_tokens = spec.inner.batch_size * spec.inner.seq_len
    learner = PROCESS_BYTES + 16 * params + per_token * step_tokens
    eval_tokens = eval_rows(spec) * spec.inner.seq_len
    syncer = PROCESS_BYTES + SYNCER_COPIES * FLOAT * params + (4 * v + 8 * c) * FLOAT * eval_tokens
    return MemoryNeed(learner=learner, syncer=syncer, parameters=params)


def parse_quantity(value: object) -> int | None:
    """A Kubernetes memory quantity ('2Gi', '512M', 1e9) in bytes; None when unreadable."""
    text = str(value).strip()
    match = _QUANTITY.match(text)
    if match is None:
        return None
    number, unit = float(match.group(1)), match.group(2) or ""
    binary = unit.endswith("i")  # Ki, Mi, Gi: powers of 1024; K, M, G: of 1000
    scale = 1024 ** (list(_UNITS).index(unit[0]) + 1) if binary else _UNITS.get(unit, 1)
    return int(number * scale)


def gib(n: float) -> str:
    """Bytes as GiB with two significant decimals for people."""
    return f"{n / 2**30:.2f} GiB"


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
    """No stop condition; a warm-up longer than the run; a job of two whose quality guard
    cannot run."""
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
    islands = max(spec.islands.count, spec.islands.total_shards)
    if spec.syncer.shards > 1 and spec.syncer.quality_guard.enabled and islands < 3:
        # With one bad island of two no aggregator is robust: the guard is that job's defence
        # (docs/adversaries.md), and no shard holds the whole model to evaluate it.
        out.append(
            f"syncer.qualityGuard: a sharded syncer (syncer.shards {spec.syncer.shards}) "
            "evaluates nothing (no shard holds the whole model), so the quality guard is off; "
            f"with {islands} islands it is the job's only defence against a bad island: run "
            "one syncer (syncer.shards 1) or three islands or more"
        )
    return out


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


def model_vocab(spec: JobSpec) -> int | None:
    """The built-in GPT's vocabulary without reading the corpus: bytes, or a BPE's vocabSize
    (a tokenizer file's is unknown until it is read); None for a user's model."""
    if spec.model.entrypoint:
        return None
    kind = spec.data.tokenizer.type
    if kind == "bytes":
        return 256
    return spec.data.tokenizer.vocab_size if kind == "bpe" else None


def schedule_errors(spec: JobSpec) -> list[str]:
    """What the spec alone says cannot run as written: an overlap longer than a round."""
    out = []
    tau = spec.sync.overlap_steps or 0
    if tau > spec.inner.steps:
        out.append(
            f"sync.overlapSteps ({tau}) must be <= inner.steps ({spec.inner.steps}): a sync in "
            "flight for longer than a round makes each round the syncer counts hold more than "
            "inner.steps steps, and the job trains several times the tokens stopAfter "
            "announces; lower sync.overlapSteps or raise inner.steps"
        )
    return out


def spec_findings(spec: JobSpec) -> Findings:
    """The schedule's warnings and errors, and the memory estimates against the pods' limits
    when the model's size is known from the spec."""
    found = Findings(warnings=schedule_warnings(spec), errors=schedule_errors(spec))
    vocab = model_vocab(spec)
    if vocab is not None:
        found.errors += cluster_memory_errors(spec, estimate(spec, vocab))
    return found
