"""A small, readable byte-level GPT (decoder-only transformer) with named size presets.

Byte-level means the vocabulary is the 256 byte values, so no tokenizer ships with the trainer and
every island tokenizes identically. The layout follows the usual pre-norm GPT-2 block: LayerNorm ->
causal self-attention -> residual, LayerNorm -> MLP -> residual.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

VOCAB_SIZE = 256  # one token per byte value


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT. Defaults are the gpt-tiny preset."""

    block_size: int = 256  # longest sequence (number of learned positions)
    vocab_size: int = VOCAB_SIZE  # byte-level
    n_layer: int = 2  # transformer blocks
    n_head: int = 2  # attention heads per block
    n_embd: int = 64  # residual stream width
    mlp_ratio: int = 4  # hidden width of the MLP = mlp_ratio * n_embd
    dropout: float = 0.0  # off: pseudo-gradients should not depend on dropout masks
    bias: bool = True  # biases in Linear layers and LayerNorms
    # Not a shape: recompute each block's activations in the backward pass instead of keeping
    # them (model.activationCheckpointing); the weights and their names are the same either way.
    activation_checkpointing: bool = False


# Sizes are counted for block_size 256 and the 256-byte vocabulary (gpt_parameters gives the exact
# count). The larger presets keep GPT-2's widths and head size (64, 128 for gpt-1b) and add depth
# where the byte-level vocabulary leaves the embeddings small.
PRESETS: dict[str, GPTConfig] = {
    "gpt-tiny": GPTConfig(n_layer=2, n_head=2, n_embd=64),  # ~0.14M: CPU unit/e2e tests
    "gpt-mini": GPTConfig(n_layer=4, n_head=4, n_embd=128),  # ~0.9M: CPU demos
    "gpt-small": GPTConfig(n_layer=6, n_head=6, n_embd=384),  # ~11M: one GPU or a fast CPU
    "gpt-125m": GPTConfig(n_layer=18, n_head=12, n_embd=768),  # ~128M: GPUs
    "gpt-350m": GPTConfig(n_layer=28, n_head=16, n_embd=1024),  # ~353M: GPUs, bf16
    "gpt-1b": GPTConfig(n_layer=20, n_head=16, n_embd=2048),  # ~1009M: GPUs, bf16 + fsdp
}


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t only sees positions <= t."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0, "n_embd must be divisible by n_head"
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)  # q, k, v in one matmul
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 x (B, T, C)
        # (B, T, C) -> (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.proj(y)


class MLP(nn.Module):
    """Position-wise feed-forward network."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, cfg.mlp_ratio * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))  # (B, T, C)


class Block(nn.Module):
    """One pre-norm transformer block."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Byte-level GPT: forward(idx (B, T) long) -> logits (B, T, vocab_size).

    The output head is NOT tied to the token embedding: tied weights appear twice in a
    state_dict, which safetensors refuses and which would make pseudo-gradient names ambiguous.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)
        # GPT-2: scale the projections into the residual stream so its variance does not grow
        # with depth.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: Tensor) -> Tensor:
        seq_len = idx.shape[1]  # idx: (B, T)
        if seq_len > self.config.block_size:
            raise ValueError(
                f"sequence length {seq_len} exceeds the model's block_size {self.config.block_size}"
            )
        pos = torch.arange(seq_len, device=idx.device)  # (T,)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))  # (B, T, C)
        for block in self.blocks:
            if self.config.activation_checkpointing and self.training and torch.is_grad_enabled():
                # Non-reentrant: works with autocast, DDP/FSDP hooks and inputs without grads.
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(self.ln_f(x))  # (B, T, V)

    def embedding_names(self) -> frozenset[str]:
        """Names of the embedding tables (merged with a plain mean under RDA)."""
        return frozenset({"tok_emb.weight", "pos_emb.weight"})


def build_model(
    preset: str,
    seq_len: int,
    vocab_size: int = VOCAB_SIZE,
    *,
    activation_checkpointing: bool = False,
) -> GPT:
    """A freshly initialised GPT of a named preset whose block_size fits seq_len and whose
    vocabulary is the tokenizer's (256 bytes by default).

    Initial weights come from torch's global RNG: seed it (torch.manual_seed) first for weights
    that are identical in every process.
    """
    if preset not in PRESETS:
        raise ValueError(f"model.preset {preset!r} is unknown; choose one of {sorted(PRESETS)}")
    if seq_len < 1:
        raise ValueError(f"inner.seqLen must be >= 1, got {seq_len}")
    cfg = replace(
        PRESETS[preset],
        block_size=seq_len,
        vocab_size=vocab_size,
        activation_checkpointing=activation_checkpointing,
    )
    return GPT(cfg)


def gpt_parameters(cfg: GPTConfig) -> int:
    """The GPT's parameter count from its shape (with biases): per block two LayerNorms (2C
    each), qkv (3C² + 3C), the attention projection (C² + C) and the MLP (2·r·C² + r·C + C);
    then the token and position embeddings (V·C, T·C), the final LayerNorm (2C) and the untied
    head (V·C)."""
    c, r = cfg.n_embd, cfg.mlp_ratio
    assert cfg.bias, "the count is for the presets' layout (with biases)"
    block = 2 * 2 * c + (3 * c * c + 3 * c) + (c * c + c) + (2 * r * c * c + r * c + c)
    return cfg.n_layer * block + 2 * cfg.vocab_size * c + cfg.block_size * c + 2 * c


def count_parameters(model: nn.Module) -> int:
    """Number of scalar parameters (each shared tensor counted once)."""
    return sum(p.numel() for p in model.parameters())
