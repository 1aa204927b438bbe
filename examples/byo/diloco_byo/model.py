"""The team's model: a small character-level GRU language model (not a transformer on purpose:
diloco-operator trains any torch module that maps token ids to next-token logits)."""

from __future__ import annotations

from torch import Tensor, nn

VOCAB = 256  # bytes


class CharGRU(nn.Module):
    """forward(idx (B, T) long) -> logits (B, T, VOCAB)."""

    def __init__(self, embed: int = 48, hidden: int = 128, layers: int = 1) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, embed)
        self.rnn = nn.GRU(embed, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, VOCAB)

    def forward(self, idx: Tensor) -> Tensor:
        out, _ = self.rnn(self.embed(idx))  # (B, T, hidden)
        return self.head(out)
