"""A small decoder-only transformer for byte-level language modelling (GPT-style).

Token and position embeddings, ``depth`` pre-norm blocks (causal multi-head self-attention with
``q``, ``k``, ``v`` and output projections as separate ``nn.Linear`` layers, then a two-layer
MLP of width ``4·width`` with GELU), a final LayerNorm and an untied output head. K-FAC
preconditions every Linear layer (their rows are the batch's tokens), and with
``kfac.embeddings`` both embeddings (the positions' ids carry the batch's dimension for that);
the LayerNorms are left to the optimizer.

The logits come out as ``(batch, vocabulary, positions)``, the layout ``F.cross_entropy`` and
``argmax(dim=1)`` read as a classification per position, so the training loop treats a language
model like any classifier (its "accuracy" is next-byte accuracy, its loss the mean over tokens).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CharTransformer"]


class _Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.query = nn.Linear(width, width)
        self.key = nn.Linear(width, width)
        self.value = nn.Linear(width, width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, positions, width = x.shape

        def split(t: torch.Tensor) -> torch.Tensor:  # (B, T, D) -> (B, H, T, D/H)
            return t.view(batch, positions, self.heads, width // self.heads).transpose(1, 2)

        mixed = F.scaled_dot_product_attention(
            split(self.query(x)), split(self.key(x)), split(self.value(x)), is_causal=True
        )
        out: torch.Tensor = self.out(mixed.transpose(1, 2).reshape(batch, positions, width))
        return out


class _Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attention = _Attention(width, heads)
        self.norm2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        out: torch.Tensor = x + self.down(F.gelu(self.up(self.norm2(x))))
        return out


class CharTransformer(nn.Module):
    """A decoder-only transformer over bytes.

    Args:
        vocabulary: number of token values (256 for bytes).
        context: the longest sequence it reads.
        width: model width (divisible by ``heads``).
        depth: number of blocks.
        heads: attention heads.
    """

    def __init__(
        self,
        vocabulary: int = 256,
        context: int = 64,
        width: int = 64,
        depth: int = 2,
        heads: int = 4,
    ) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width={width} must be divisible by heads={heads}")
        self.context = context
        self.tokens = nn.Embedding(vocabulary, width)
        self.positions = nn.Embedding(context, width)
        self.blocks = nn.Sequential(*(_Block(width, heads) for _ in range(depth)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocabulary)
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def example_input(self, batch_size: int) -> torch.Tensor:
        """A batch of full-context token ids (on the parameters' device), for planning."""
        device = self.head.weight.device
        return torch.zeros(batch_size, self.context, dtype=torch.long, device=device)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Maps token ids ``(batch, positions)`` to logits ``(batch, vocabulary, positions)``."""
        positions = tokens.shape[-1]
        if positions > self.context:
            raise ValueError(
                f"a sequence of {positions} tokens is longer than the model's context "
                f"{self.context}; raise model.params.context"
            )
        # the positions' ids with the tokens' leading dimensions: each example a row of its own
        # (K-FAC's ``embeddings`` option reads the first dimension as the examples)
        index = torch.arange(positions, device=tokens.device).expand_as(tokens)
        x = self.tokens(tokens) + self.positions(index)
        logits: torch.Tensor = self.head(self.norm(self.blocks(x)))
        return logits.transpose(1, 2)
