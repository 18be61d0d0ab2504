"""The models KAISA was built for, written here: ResNet-50 (ImageNet) and BERT-Large.

Both follow the layer names and shapes of the implementations KAISA's authors trained
(torchvision's ResNet-50 v1.5, NVIDIA's BERT as in gpauloski/BERT-PyTorch), so a K-FAC
``skip_layers`` written for those applies here. They train like any registered model, and
they are what ``kaisa-ray plan`` prices: built on PyTorch's meta device
(``with torch.device("meta"): ResNet50()``), they hold shapes and no memory.

Shapes (``N`` samples, ``S`` tokens):

- ResNet50: images ``(N, in_channels, image_size, image_size)`` to logits ``(N, num_classes)``;
  53 Conv2d (bias-free) and the Linear classifier, the largest K-FAC factor 4608 wide (the
  3×3 convolutions of the last stage: 512 channels × 9).
- BertLarge: token ids ``(N, S)`` to masked-LM logits ``(N, S, vocab_size)`` and
  next-sentence logits ``(N, 2)``; 24 layers of six Linear each (query, key, value, attention
  output 1024→1024, intermediate 1024→4096, output 4096→1024), the pooler and both heads.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["BertLarge", "ResNet50"]


class _Bottleneck(nn.Module):
    """1×1 → 3×3 (with the stride, v1.5) → 1×1 ×4 channels, BatchNorm after each; a projected
    shortcut where the shape changes (He et al. 2016, torchvision's layout)."""

    expansion = 4

    def __init__(self, in_channels: int, width: int, stride: int) -> None:
        super().__init__()
        out_channels = width * self.expansion
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        shortcut = x if self.downsample is None else self.downsample(x)
        return F.relu(out + shortcut)


class ResNet50(nn.Module):
    """ResNet-50 v1.5 for ImageNet: stem 7×7/2 and max-pool, stages of 3, 4, 6 and 3
    bottlenecks (widths 64, 128, 256, 512), global average pool, Linear 2048 → classes.

    Args:
        in_channels: image channels (3 for ImageNet).
        num_classes: logits (1000 for ImageNet).
        image_size: the side of the square images it is planned for (224); any size ≥ 32
            runs, the pooling is global.

    Example:
        >>> with torch.device("meta"):
        ...     model = ResNet50()
        >>> sum(p.numel() for p in model.parameters())
        25557032
    """

    def __init__(
        self, in_channels: int = 3, num_classes: int = 1000, image_size: int = 224
    ) -> None:
        super().__init__()
        if image_size < 32:
            raise ValueError(f"image_size={image_size}: ResNet-50 needs images of at least 32x32")
        self.in_channels = in_channels
        self.image_size = image_size
        self.conv1 = nn.Conv2d(in_channels, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        channels = 64
        stages: list[nn.Sequential] = []
        for index, (width, blocks) in enumerate(((64, 3), (128, 4), (256, 6), (512, 3))):
            stride = 1 if index == 0 else 2
            stage = []
            for block in range(blocks):
                stage.append(_Bottleneck(channels, width, stride if block == 0 else 1))
                channels = width * _Bottleneck.expansion
            stages.append(nn.Sequential(*stage))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.fc = nn.Linear(channels, num_classes)

    def example_input(self, batch_size: int) -> torch.Tensor:
        """A batch of the images it is planned for (on the parameters' device)."""
        side = self.image_size
        return torch.empty(batch_size, self.in_channels, side, side, device=self.fc.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Maps images ``(N, C, H, W)`` to logits ``(N, num_classes)``."""
        x = self.maxpool(F.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        logits: torch.Tensor = self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
        return logits


class _SelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        n, s, hidden = x.shape
        split = (n, s, self.heads, hidden // self.heads)
        q, k, v = (
            part(x).view(split).transpose(1, 2) for part in (self.query, self.key, self.value)
        )
        scores = q @ k.transpose(-1, -2) / math.sqrt(hidden // self.heads)
        if mask is not None:
            scores = scores + mask
        context: torch.Tensor = F.softmax(scores, dim=-1) @ v
        return context.transpose(1, 2).reshape(n, s, hidden)


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.self = _SelfAttention(hidden, heads)
        self.output = _Projection(hidden, hidden)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        out: torch.Tensor = self.output(self.self(x, mask), x)
        return out


class _Projection(nn.Module):
    """Dense, dropout, residual, LayerNorm (BERT's ``*Output`` blocks)."""

    def __init__(self, in_features: int, hidden: int) -> None:
        super().__init__()
        self.dense = nn.Linear(in_features, hidden)
        self.dropout = nn.Dropout(0.1)
        self.LayerNorm = nn.LayerNorm(hidden, eps=1e-12)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.LayerNorm(self.dropout(self.dense(x)) + residual)
        return out


class _Intermediate(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(x))


class _Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, intermediate: int) -> None:
        super().__init__()
        self.attention = _Attention(hidden, heads)
        self.intermediate = _Intermediate(hidden, intermediate)
        self.output = _Projection(intermediate, hidden)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        attended = self.attention(x, mask)
        out: torch.Tensor = self.output(self.intermediate(attended), attended)
        return out


class _Embeddings(nn.Module):
    def __init__(self, vocab: int, hidden: int, positions: int, types: int) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden)
        self.position_embeddings = nn.Embedding(positions, hidden)
        self.token_type_embeddings = nn.Embedding(types, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=1e-12)
        self.dropout = nn.Dropout(0.1)

    def forward(self, ids: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        x = self.word_embeddings(ids) + self.position_embeddings(positions)
        out: torch.Tensor = self.dropout(self.LayerNorm(x + self.token_type_embeddings(types)))
        return out


class _Transform(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=1e-12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.LayerNorm(F.gelu(self.dense(x)))
        return out


class _Pooler(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(x[:, 0]))


class _PredictionHead(nn.Module):
    """Masked-LM head: dense, GELU, LayerNorm, then the decoder tied to the word embeddings."""

    def __init__(self, hidden: int, word_embeddings: nn.Embedding) -> None:
        super().__init__()
        self.transform = _Transform(hidden)
        vocab = word_embeddings.num_embeddings
        self.decoder = nn.Linear(hidden, vocab, bias=False)
        self.decoder.weight = word_embeddings.weight
        self.bias = nn.Parameter(torch.zeros(vocab))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.decoder(self.transform(x)) + self.bias
        return out


class _Heads(nn.Module):
    def __init__(self, hidden: int, word_embeddings: nn.Embedding) -> None:
        super().__init__()
        self.predictions = _PredictionHead(hidden, word_embeddings)
        self.seq_relationship = nn.Linear(hidden, 2)


class BertLarge(nn.Module):
    """BERT for pre-training (Devlin et al. 2019), Large by default: 24 layers, hidden 1024,
    16 heads, intermediate 4096, WordPiece vocabulary of 30522, 512 positions; the masked-LM
    head's decoder shares the word embeddings' weight.

    K-FAC as KAISA's authors ran it skips the embeddings (not Linear or Conv2d here, so never
    registered) and the masked-LM head (``skip_layers=["cls\\\\.predictions"]``): its
    decoder's G factor would be 30522 wide (3.7 GB in float32).

    Args:
        seq_len: the sequence length it is planned for (128 in phase 1 of pre-training, 512
            in phase 2); any length up to ``max_position`` runs.

    Example:
        >>> with torch.device("meta"):
        ...     model = BertLarge()
        >>> sum(p.numel() for p in model.parameters())  # the tied decoder counted once
        336226108
    """

    def __init__(
        self,
        *,
        vocab_size: int = 30522,
        hidden: int = 1024,
        layers: int = 24,
        heads: int = 16,
        intermediate: int = 4096,
        max_position: int = 512,
        type_vocab_size: int = 2,
        seq_len: int = 512,
    ) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden={hidden} must be a multiple of heads={heads}")
        if not 1 <= seq_len <= max_position:
            raise ValueError(f"seq_len={seq_len} must be between 1 and max_position={max_position}")
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.embeddings = _Embeddings(vocab_size, hidden, max_position, type_vocab_size)
        self.encoder = nn.ModuleList(_Layer(hidden, heads, intermediate) for _ in range(layers))
        self.pooler = _Pooler(hidden)
        self.cls = _Heads(hidden, self.embeddings.word_embeddings)

    def example_input(self, batch_size: int) -> torch.Tensor:
        """A batch of token ids of the planned length (on the parameters' device)."""
        device = self.pooler.dense.weight.device
        return torch.zeros(batch_size, self.seq_len, dtype=torch.long, device=device)

    def forward(
        self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Maps token ids ``(N, S)`` to masked-LM logits ``(N, S, vocab)`` and next-sentence
        logits ``(N, 2)``.

        Raises:
            TypeError: the input is not integer token ids (an image dataset, say).
        """
        if input_ids.is_floating_point() or input_ids.dim() != 2:
            raise TypeError(
                f"BertLarge takes integer token ids (N, sequence); got a {input_ids.dtype} "
                f"tensor of shape {tuple(input_ids.shape)}. No token dataset is registered with "
                "kaisa-ray: the model is here for `kaisa-ray plan` and for datasets added "
                "through the 'kaisa_ray.datasets' entry point."
            )
        types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
        x = self.embeddings(input_ids, types)
        for layer in self.encoder:
            x = layer(x, None)
        pooled = self.pooler(x)
        return self.cls.predictions(x), self.cls.seq_relationship(pooled)
