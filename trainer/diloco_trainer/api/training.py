"""The training sections of the job spec: which model (`model`), how each island trains it between
syncs (`inner`: optimizer, batch, gradient accumulation, precision, compilation) and the outer
optimizer the syncer applies (`outer`). Torch-free; spec.py assembles the whole spec and
re-exports these.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from diloco_trainer.api.base import SpecModel

Preset = Literal["gpt-tiny", "gpt-mini", "gpt-small", "gpt-125m", "gpt-350m", "gpt-1b"]
Precision = Literal["fp32", "bf16", "fp16"]


class ModelSpec(SpecModel):
    """Which model to train."""

    preset: Preset = Field(
        "gpt-tiny",
        description="Built-in GPT size: gpt-tiny (~0.14M params, CPU tests), gpt-mini (~0.9M), "
        "gpt-small (~11M), gpt-125m (~128M), gpt-350m (~353M), gpt-1b (~1009M). Ignored when "
        "entrypoint is set.",
    )
    entrypoint: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
        description="Bring your own model: 'package.module:function'. The function receives the "
        "job spec and the data shard and returns the model, the data streams and the loss.",
    )
    seed: int = Field(0, ge=0, description="Seed for the initial global weights.")
    activation_checkpointing: bool = Field(
        False,
        description="Built-in GPT: keep only each transformer block's input in the forward pass "
        "and recompute the rest in the backward pass (activation memory of one block instead of "
        "all, about a third more compute). Ignored when entrypoint is set.",
    )


class InnerSpec(SpecModel):
    """The inner optimizer each island runs between syncs."""

    optimizer: Literal["adamw"] = Field("adamw", description="Inner optimizer.")
    lr: float = Field(4e-4, gt=0, le=10, description="Peak inner learning rate.")
    weight_decay: float = Field(0.1, ge=0, le=10, description="AdamW weight decay.")
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up, in inner steps.")
    steps: int = Field(500, ge=1, le=1_000_000, description="H: inner steps per outer round.")
    steps_per_island: Literal["auto", "fixed"] = Field(
        "auto",
        description="Each island's round: fixed (every island takes inner.steps between pushes "
        "of a fragment) or auto (the syncer sizes island i's round H_i from its measured step "
        "time, so that islands of different speeds push at about the same wall time: H_i = "
        "floor(inner.steps x t_ref / t_i), t_ref the lower median of the islands' step times, "
        "within inner.minSteps..inner.maxSteps; the first from a learner's first steps in a "
        "job of three or more islands, judged only against peers' step times taken since it "
        "joined (a peer's once it has stepped 10 steps since, or while it waits for a merge; "
        "held back at most one round of the reference's; at K = M not when it reads 4x or "
        "more against all of them): at once when two show it at least "
        "twice as slow (each "
        "beyond 1.4x), or when two and the next two both show it more than 1.4x slower; every "
        "other change only after two readings in a row whose step time is more than 40% off "
        "what its round assumes, or at K = M that show a shortened round taking more than 90% "
        "of the others' (a change at K = M leaves that 10% room, and a slow island's learner "
        "fills what its round leaves of a merge wait with steps counted in its next push, as "
        "does an island at inner.steps whose merge waits for a late peer, up to a fifth of "
        "inner.steps such fill steps a push); at K = M each island keeps its 1/M share of "
        "stopAfter.tokens in rounds while every round is inner.steps, as with fixed (fill "
        "steps' tokens come on top of the shares, every one merged: fixed takes none, and "
        "meets it exactly); "
        "docs/algorithm.md). islands.overrides[].innerSteps pins an island's.",
    )
    min_steps: int | None = Field(
        None,
        ge=1,
        le=1_000_000,
        description="With stepsPerIsland auto: the fewest inner steps an island's round is given "
        "(unset: inner.steps / 8, rounded up). At most inner.steps.",
    )
    max_steps: int | None = Field(
        None,
        ge=1,
        le=1_000_000,
        description="With stepsPerIsland auto: the most inner steps an island's round is given "
        "(unset: inner.steps, so only islands slower than the reference get shorter rounds). "
        "At least inner.steps.",
    )
    batch_size: int = Field(32, ge=1, le=65536, description="Sequences per rank per micro-batch.")
    micro_batches: int = Field(
        1,
        ge=1,
        le=4096,
        description="Gradient accumulation: micro-batches of batchSize sequences per inner step "
        "(one optimizer step). An inner step's tokens per rank are batchSize x microBatches x "
        "seqLen; token counts, the syncer's work bounds and the learning-rate schedule (per "
        "inner step) follow.",
    )
    seq_len: int = Field(256, ge=8, le=131072, description="Tokens per sequence.")
    grad_clip: float = Field(1.0, ge=0, description="Gradient-norm clip; 0 disables.")
    precision: Precision = Field(
        "fp32",
        description="fp32; bf16: forward and loss under bf16 autocast, with fp32 weights, "
        "gradients, optimizer state and pseudo-gradients; fp16: the same in fp16 with a dynamic "
        "loss scale (CUDA only: a learner on another device refuses it).",
    )
    compile: bool = Field(
        False,
        description="Run the model's forward and backward through torch.compile (the first "
        "steps are slower while it compiles; needs a C++ compiler, and Triton on CUDA).",
    )

    @model_validator(mode="after")
    def _round_limits(self) -> InnerSpec:
        if self.min_steps is not None and self.min_steps > self.steps:
            raise ValueError(
                f"inner.minSteps ({self.min_steps}) must be <= inner.steps ({self.steps})"
            )
        if self.max_steps is not None and self.max_steps < self.steps:
            raise ValueError(
                f"inner.maxSteps ({self.max_steps}) must be >= inner.steps ({self.steps})"
            )
        return self

    @property
    def min_steps_resolved(self) -> int:
        """The floor of an island's round: minSteps, else ceil(H / 8)."""
        return self.min_steps if self.min_steps is not None else max(1, -(-self.steps // 8))

    @property
    def max_steps_resolved(self) -> int:
        """The ceiling of an island's round: maxSteps, else H."""
        return self.max_steps if self.max_steps is not None else self.steps

    @property
    def tokens_per_step(self) -> int:
        """Tokens one rank processes per inner step: batchSize x microBatches x seqLen."""
        return self.batch_size * self.micro_batches * self.seq_len


class OuterSpec(SpecModel):
    """The outer optimizer the syncer applies to merged pseudo-gradients."""

    lr: float = Field(0.7, gt=0, le=10, description="Outer learning rate.")
    momentum: float = Field(0.9, ge=0, lt=1, description="Outer momentum.")
    nesterov: bool = Field(True, description="Nesterov momentum.")
