"""One inner step of a learner: micro-batches, precision, clipping and the AdamW step.

The loop (loop.py) owns the schedule and the syncer; this module owns what happens between two
optimizer steps, so the benchmark (bench/learner_step.py) times exactly the learner's step.

- Gradient accumulation (inner.microBatches = m): m micro-batches of inner.batchSize sequences,
  each loss divided by m before backward, so the gradient is the mean over the step's tokens, as
  one batch of m x batchSize would give. Data-parallel gradient sync runs on the last micro-batch
  only (DDP `no_sync`, FSDP `set_requires_gradient_sync`): accumulating locally and reducing once
  gives the same mean.
- Precision (inner.precision): the weights, their gradients, AdamW's state and so every
  pseudo-gradient stay fp32 ("master weights"); bf16 and fp16 only run the forward and the loss
  under autocast. fp16's narrow exponent needs a loss scale (GradScaler, CUDA only); bf16 has
  fp32's exponent and needs none.
- inner.compile: the model the loss calls is torch.compile'd; parameters and their names are the
  original module's, so pushes, pulls and the optimizer are unaffected.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from diloco_trainer.api.spec import ConfigError, JobSpec
from diloco_trainer.models.data import Batch
from diloco_trainer.models.parts import LossFn, TrainStream

AUTOCAST_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_precision(precision: str, device: str) -> None:
    """ConfigError, naming inner.precision, when this device cannot run it."""
    kind = device.split(":", 1)[0]
    if precision == "fp16" and kind != "cuda":
        raise ConfigError(
            f"inner.precision fp16 needs a CUDA device (its loss scaler is CUDA-only) and this "
            f"learner runs on {device}: use bf16 or fp32"
        )
    if precision == "bf16" and kind == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            "inner.precision bf16: this GPU has no bf16 support (before Ampere): use fp16 or fp32"
        )


def autocast_for(precision: str, device: str) -> contextlib.AbstractContextManager[Any]:
    """The forward's autocast context for inner.precision (none for fp32)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.split(":", 1)[0], dtype=AUTOCAST_DTYPES[precision])


def compiled(module: nn.Module, enabled: bool) -> nn.Module:
    """torch.compile(module) when inner.compile is set; the module itself otherwise."""
    if not enabled:
        return module
    # torch.compile returns an OptimizedModule wrapping `module` (typed as a callable).
    return torch.compile(module)  # type: ignore[return-value]


def _no_grad_sync(
    train_model: nn.Module,
) -> Callable[[bool], contextlib.AbstractContextManager[Any]]:
    """A context factory: sync(False) skips the data-parallel gradient reduction of a
    micro-batch (DDP's no_sync, FSDP2's set_requires_gradient_sync); sync(True) reduces."""
    inner = getattr(train_model, "_orig_mod", train_model)  # under torch.compile
    if isinstance(inner, nn.parallel.DistributedDataParallel):
        ddp = inner

        def ddp_sync(sync: bool) -> contextlib.AbstractContextManager[Any]:
            return contextlib.nullcontext() if sync else ddp.no_sync()

        return ddp_sync
    setter = getattr(inner, "set_requires_gradient_sync", None)
    if setter is not None:  # an FSDP2 module

        @contextlib.contextmanager
        def fsdp_sync(sync: bool) -> Iterator[None]:
            setter(sync)
            yield

        return fsdp_sync
    return lambda _sync: contextlib.nullcontext()


class InnerStep:
    """What one inner step does, built once per learner from the spec."""

    def __init__(
        self,
        spec: JobSpec,
        *,
        params: list[nn.Parameter],
        train_model: nn.Module,
        loss_fn: LossFn,
        optimizer: torch.optim.Optimizer,
        device: str,
        clip: Callable[[list[nn.Parameter], float], Tensor] | None = None,
    ) -> None:
        check_precision(spec.inner.precision, device)
        self.params = params
        self.micro_batches = spec.inner.micro_batches
        self.precision = spec.inner.precision
        self.device = device
        self.grad_clip = spec.inner.grad_clip
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.train_model = compiled(train_model, spec.inner.compile)
        self._sync = _no_grad_sync(train_model)
        # fp16 only: scale the loss so small gradients survive fp16, unscale before clipping.
        self.scaler = torch.amp.GradScaler("cuda") if self.precision == "fp16" else None
        self.clip = clip or (lambda ps, c: nn.utils.clip_grad_norm_(ps, c))

    def run(
        self, stream: TrainStream, before_backward: Callable[[], None] | None = None
    ) -> tuple[float, int]:
        """One optimizer step over microBatches batches of the stream; (mean loss, tokens of
        this rank). `before_backward`: called once, just before the first backward pass, which
        runs without the interpreter lock (the learner starts its deferred pushes there:
        SyncerLink.submit_later)."""
        self.optimizer.zero_grad(set_to_none=True)
        total: Tensor | None = None
        tokens = 0
        for i in range(self.micro_batches):
            batch: Batch = stream.next_batch()
            with self._sync(i == self.micro_batches - 1):
                with autocast_for(self.precision, self.device):
                    loss = self.loss_fn(self.train_model, batch) / self.micro_batches
                if i == 0 and before_backward is not None:
                    before_backward()
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            total = loss.detach() if total is None else total + loss.detach()
            tokens += batch.tokens
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if self.grad_clip > 0:
            self.clip(self.params, self.grad_clip)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)  # skipped when a gradient is inf/nan
            self.scaler.update()
        else:
            self.optimizer.step()
        assert total is not None  # micro_batches >= 1
        return float(total.item()), tokens
