"""The outer optimizer: SGD with (Nesterov) momentum on the syncer's fp32 CPU copy of the weights.

The merged pseudo-gradient Δ = θ_global − θ_local plays the role of a gradient, so the update is
exactly torch.optim.SGD's (which this wraps): buf ← μ·buf + Δ; θ ← θ − lr·(Δ + μ·buf) with
Nesterov, θ ← θ − lr·buf without. Fragments are stepped independently: a step touches only the
tensors it is given, and the other tensors' momentum waits for their own fragment's merge.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor


class OuterOptimizer:
    """Nesterov/heavy-ball SGD that updates the given fp32 tensors in place, by name."""

    def __init__(
        self, params: dict[str, Tensor], *, lr: float, momentum: float, nesterov: bool
    ) -> None:
        for name, p in params.items():
            if p.dtype != torch.float32:
                raise ValueError(f"outer parameter {name!r} must be float32, got {p.dtype}")
            if p.requires_grad:
                raise ValueError(f"outer parameter {name!r} must not require grad")
        self.params = params
        # torch refuses nesterov without momentum; with momentum 0 both are plain SGD anyway.
        self._sgd = torch.optim.SGD(
            list(params.values()),
            lr=lr,
            momentum=momentum,
            nesterov=nesterov and momentum > 0,
        )

    @property
    def lr(self) -> float:
        """The outer learning rate."""
        return float(self._sgd.param_groups[0]["lr"])

    @lr.setter
    def lr(self, value: float) -> None:
        self._sgd.param_groups[0]["lr"] = value

    @torch.no_grad()
    def step(self, grads: Mapping[str, Tensor]) -> None:
        """Apply one outer step to exactly the named tensors (one fragment)."""
        for name, g in grads.items():
            p = self.params.get(name)
            if p is None:
                raise ValueError(f"outer step for unknown tensor {name!r}")
            if g.shape != p.shape:
                raise ValueError(
                    f"outer gradient {name!r} has shape {tuple(g.shape)}, expected {tuple(p.shape)}"
                )
        try:
            for name, g in grads.items():
                self.params[name].grad = g.detach().to(torch.float32).contiguous()
            self._sgd.step()  # tensors without .grad (other fragments) are skipped
        finally:
            for name in grads:
                self.params[name].grad = None

    def state_tensors(self) -> dict[str, Tensor]:
        """Momentum buffers by parameter name (only tensors that have been stepped)."""
        out: dict[str, Tensor] = {}
        for name, p in self.params.items():
            buf = self._sgd.state.get(p, {}).get("momentum_buffer")
            if buf is not None:
                out[name] = buf.detach().contiguous()
        return out

    def load_state_tensors(self, state: Mapping[str, Tensor]) -> None:
        """Restore momentum buffers saved by state_tensors() (names must be parameters)."""
        for name, buf in state.items():
            p = self.params.get(name)
            if p is None:
                raise ValueError(f"outer optimizer state for unknown tensor {name!r}")
            if buf.shape != p.shape:
                raise ValueError(
                    f"outer optimizer state {name!r} has shape {tuple(buf.shape)}, "
                    f"expected {tuple(p.shape)}"
                )
        for name, buf in state.items():
            p = self.params[name]
            self._sgd.state[p]["momentum_buffer"] = buf.detach().to(torch.float32).clone()
