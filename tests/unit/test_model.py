"""The built-in GPT: shapes, causality, presets, determinism."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from diloco_trainer.models.model import (
    GPT,
    PRESETS,
    VOCAB_SIZE,
    GPTConfig,
    build_model,
    count_parameters,
)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """One intra-op thread: on a shared, loaded CPU a thread pool makes tiny models slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_build_model_forward_returns_logits_over_bytes() -> None:
    model = build_model("gpt-tiny", 32)
    idx = torch.randint(0, VOCAB_SIZE, (3, 32))
    logits = model(idx)
    assert logits.shape == (3, 32, VOCAB_SIZE)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_gpt_is_causal() -> None:
    torch.manual_seed(0)
    model = build_model("gpt-tiny", 16).eval()
    idx = torch.randint(0, VOCAB_SIZE, (1, 16))
    changed = idx.clone()
    changed[0, 10] = (changed[0, 10] + 1) % VOCAB_SIZE
    a, b = model(idx), model(changed)
    # Positions before the change cannot see it; the changed position's output does change.
    assert torch.allclose(a[:, :10], b[:, :10], atol=1e-6)
    assert not torch.allclose(a[:, 10], b[:, 10])


def test_build_model_same_seed_same_weights() -> None:
    torch.manual_seed(7)
    a = build_model("gpt-tiny", 32)
    torch.manual_seed(7)
    b = build_model("gpt-tiny", 32)
    torch.manual_seed(8)
    c = build_model("gpt-tiny", 32)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_presets_grow_in_size() -> None:
    # Count from the configs (no 128M allocation): 12*C^2 per block plus embeddings and head.
    def approx(cfg: GPTConfig) -> int:
        c = cfg.n_embd
        return cfg.n_layer * 12 * c * c + 2 * cfg.vocab_size * c + cfg.block_size * c

    sizes = [approx(PRESETS[p]) for p in ("gpt-tiny", "gpt-mini", "gpt-small", "gpt-125m")]
    assert sizes == sorted(sizes)
    assert 0.1e6 <= sizes[0] <= 0.3e6
    assert 0.5e6 <= sizes[1] <= 2e6
    assert 5e6 <= sizes[2] <= 20e6
    assert 100e6 <= sizes[3] <= 150e6


def test_count_parameters_matches_named_parameters() -> None:
    model = build_model("gpt-tiny", 64)
    n = count_parameters(model)
    assert n == sum(p.numel() for _, p in model.named_parameters())
    assert 100_000 < n < 300_000


def test_gpt_state_dict_has_no_shared_tensors() -> None:
    # safetensors refuses tensors that share memory, and pseudo-gradient names must be unique.
    model = build_model("gpt-tiny", 16)
    ptrs = [t.data_ptr() for t in model.state_dict().values()]
    assert len(ptrs) == len(set(ptrs))
    assert set(model.state_dict()) == {n for n, _ in model.named_parameters()}


def test_gpt_embedding_names_are_parameters() -> None:
    model = build_model("gpt-tiny", 16)
    names = {n for n, _ in model.named_parameters()}
    assert model.embedding_names() <= names
    assert model.embedding_names()


def test_gpt_rejects_too_long_sequence() -> None:
    model = build_model("gpt-tiny", 8)
    with pytest.raises(ValueError, match="block_size 8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_build_model_unknown_preset_names_field() -> None:
    with pytest.raises(ValueError, match=r"model.preset 'gpt-huge'"):
        build_model("gpt-huge", 8)


def test_gpt_learns_a_repeated_pattern() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=8, n_layer=1, n_head=2, n_embd=32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    seq = torch.tensor([list(range(9))] * 2)  # 0 1 2 ... 8: next byte = this byte + 1
    x, y = seq[:, :-1], seq[:, 1:]

    def loss() -> torch.Tensor:
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten())

    first = loss().item()
    for _ in range(25):
        opt.zero_grad()
        loss().backward()
        opt.step()
    assert loss().item() < 0.2 * first
