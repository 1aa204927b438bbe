"""The built-in GPT's presets (exact parameter counts, derived by hand) and activation
checkpointing (the same loss and gradients, recomputed)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from diloco_trainer.models.model import (
    GPT,
    PRESETS,
    VOCAB_SIZE,
    build_model,
    count_parameters,
    gpt_parameters,
)

# Per block: 12·C² + 13·C (LayerNorms 4C, qkv 3C²+3C, proj C²+C, MLP 8C²+5C); plus
# 2·V·C (token embedding, head) + T·C (positions) + 2C (final LayerNorm), V = T = 256.
EXACT = {
    "gpt-tiny": 2 * (12 * 64**2 + 13 * 64) + 3 * 256 * 64 + 2 * 64,  # 149,248
    "gpt-mini": 4 * (12 * 128**2 + 13 * 128) + 3 * 256 * 128 + 2 * 128,  # 891,648
    "gpt-small": 6 * (12 * 384**2 + 13 * 384) + 3 * 256 * 384 + 2 * 384,  # 10,942,464
    "gpt-125m": 18 * (12 * 768**2 + 13 * 768) + 3 * 256 * 768 + 2 * 768,  # 128,173,056
    "gpt-350m": 28 * (12 * 1024**2 + 13 * 1024) + 3 * 256 * 1024 + 2 * 1024,  # 353,482,752
    "gpt-1b": 20 * (12 * 2048**2 + 13 * 2048) + 3 * 256 * 2048 + 2 * 2048,  # 1,008,742,400
}


def test_exact_counts_are_the_hand_derived_values() -> None:
    assert EXACT["gpt-125m"] == 128_173_056
    assert EXACT["gpt-350m"] == 353_482_752
    assert EXACT["gpt-1b"] == 1_008_742_400
    assert set(EXACT) == set(PRESETS)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_parameter_count_is_exact(preset: str) -> None:
    # Built on the meta device: the shapes without allocating (gpt-1b would be 4 GB of fp32).
    with torch.device("meta"):
        model = build_model(preset, 256, VOCAB_SIZE)
    assert count_parameters(model) == EXACT[preset]
    assert gpt_parameters(model.config) == EXACT[preset]


def test_preset_heads_divide_the_width() -> None:
    for cfg in PRESETS.values():
        assert cfg.n_embd % cfg.n_head == 0
    assert PRESETS["gpt-350m"].n_embd // PRESETS["gpt-350m"].n_head == 64
    assert PRESETS["gpt-1b"].n_embd // PRESETS["gpt-1b"].n_head == 128


def _loss_and_grads(checkpointing: bool) -> tuple[float, dict[str, torch.Tensor]]:
    torch.manual_seed(3)
    model = build_model("gpt-tiny", 16, activation_checkpointing=checkpointing)
    idx = torch.randint(0, VOCAB_SIZE, (2, 17), generator=torch.Generator().manual_seed(4))
    logits = model(idx[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten())
    loss.backward()
    return float(loss.detach()), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


def test_activation_checkpointing_gives_the_same_loss_and_gradients() -> None:
    loss_plain, grads_plain = _loss_and_grads(False)
    loss_ckpt, grads_ckpt = _loss_and_grads(True)
    assert loss_ckpt == pytest.approx(loss_plain, rel=1e-6)
    assert set(grads_ckpt) == set(grads_plain) and len(grads_plain) == count_parameters_tensors()
    for name, g in grads_plain.items():
        torch.testing.assert_close(grads_ckpt[name], g, rtol=1e-5, atol=1e-7)


def count_parameters_tensors() -> int:
    return len(list(build_model("gpt-tiny", 16).parameters()))


def _attention_calls(model: GPT) -> int:
    """How often block 0's attention runs in one forward and backward. (Counted inside the
    block: checkpoint's recompute does not fire the block's own forward hooks.)"""
    attn = model.blocks[0].attn
    calls = [0]
    original = attn.forward

    def counted(x: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        return original(x)

    attn.forward = counted  # type: ignore[method-assign]  # an instance-level spy
    model(torch.randint(0, VOCAB_SIZE, (1, 8))).sum().backward()
    return calls[0]


def test_activation_checkpointing_recomputes_blocks_in_backward() -> None:
    # With checkpointing the block runs twice per step (forward, then recomputed in backward).
    assert _attention_calls(build_model("gpt-tiny", 8)) == 1
    assert _attention_calls(build_model("gpt-tiny", 8, activation_checkpointing=True)) == 2


def test_activation_checkpointing_is_off_in_eval() -> None:
    # The syncer evaluates with the same model: nothing is recomputed outside training.
    model = build_model("gpt-tiny", 8, activation_checkpointing=True).eval()
    assert _attention_calls(model) == 1
