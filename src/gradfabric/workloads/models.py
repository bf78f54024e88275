"""Reference model definitions, built on the meta device (no memory, no weights).

Written out here (rather than imported from torchvision or transformers) so the
catalog depends on torch alone; each follows the published architecture and
its parameter count is checked against the published figure in the tests.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import cast

import torch
from torch import nn

Builder = Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]]


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.down: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idt = x if self.down is None else self.down(x)
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        out: torch.Tensor = self.relu(self.bn3(self.conv3(y)) + idt)
        return out


class ResNet(nn.Module):
    def __init__(self, blocks: list[int], classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 7, 2, 3, bias=False),
            nn.BatchNorm2d(64),
            nn.ReLU(),
            nn.MaxPool2d(3, 2, 1),
        )
        layers: list[nn.Module] = []
        cin = 64
        for i, n in enumerate(blocks):
            width = 64 * 2**i
            for j in range(n):
                layers.append(Bottleneck(cin, width, 2 if (j == 0 and i > 0) else 1))
                cin = width * 4
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc(torch.flatten(self.pool(self.layers(self.stem(x))), 1))
        return out


VGG_CFG: dict[int, list[int | str]] = {
    16: [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"],
    19: [
        64,
        64,
        "M",
        128,
        128,
        "M",
        256,
        256,
        256,
        256,
        "M",
        512,
        512,
        512,
        512,
        "M",
        512,
        512,
        512,
        512,
        "M",
    ],
}


class VGG(nn.Module):
    def __init__(self, depth: int, classes: int = 1000) -> None:
        super().__init__()
        feats: list[nn.Module] = []
        cin = 3
        for v in VGG_CFG[depth]:
            if isinstance(v, str):  # "M": max-pool
                feats.append(nn.MaxPool2d(2))
            else:
                feats += [nn.Conv2d(cin, v, 3, padding=1), nn.ReLU()]
                cin = v
        self.features = nn.Sequential(*feats)
        self.pool = nn.AdaptiveAvgPool2d(7)
        self.classifier = nn.Sequential(
            nn.Linear(512 * 49, 4096),
            nn.ReLU(),
            nn.Dropout(),
            nn.Linear(4096, 4096),
            nn.ReLU(),
            nn.Dropout(),
            nn.Linear(4096, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, self.classifier(torch.flatten(self.pool(self.features(x)), 1)))


class Transformer(nn.Module):
    """BERT (post-norm encoder + pooler) or GPT-2 (pre-norm, final norm, tied head)."""

    def __init__(
        self, vocab: int, positions: int, hidden: int, layers: int, heads: int, ffn: int, gpt: bool
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(positions, hidden)
        self.seg = None if gpt else nn.Embedding(2, hidden)
        self.emb_norm = None if gpt else nn.LayerNorm(hidden, eps=1e-12)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                hidden, heads, ffn, dropout=0.0, activation="gelu", batch_first=True, norm_first=gpt
            )
            for _ in range(layers)
        )
        self.final_norm = nn.LayerNorm(hidden) if gpt else None
        self.pooler = None if gpt else nn.Linear(hidden, hidden)
        self.head: nn.Linear | None = None
        if gpt:  # GPT-2's LM head shares the token embedding's weight
            self.head = nn.Linear(hidden, vocab, bias=False)
            self.head.weight = self.tok.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        x = self.tok(ids) + self.pos(pos)
        if self.seg is not None and self.emb_norm is not None:
            x = self.emb_norm(x + self.seg(torch.zeros_like(ids)))
        for blk in self.blocks:
            x = blk(x)
        if self.final_norm is not None and self.head is not None:
            return cast(torch.Tensor, self.head(self.final_norm(x)))
        assert self.pooler is not None
        return torch.tanh(self.pooler(x[:, 0]))


class LSTMLM(nn.Module):
    """Word-level LSTM language model (the "large" WikiText-2 configuration)."""

    def __init__(self, vocab: int = 33278, hidden: int = 1500, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.lstm = nn.LSTM(hidden, hidden, layers, batch_first=True)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        y, _ = self.lstm(self.emb(ids))
        return cast(torch.Tensor, self.out(y))


class NCF(nn.Module):
    """Neural collaborative filtering (NeuMF) at MovieLens-20M scale: embedding-heavy."""

    def __init__(
        self,
        users: int = 138_493,
        items: int = 26_744,
        mf_dim: int = 64,
        mlp: tuple[int, ...] = (256, 256, 128, 64),
    ) -> None:
        super().__init__()
        self.mf_user = nn.Embedding(users, mf_dim)
        self.mf_item = nn.Embedding(items, mf_dim)
        self.mlp_user = nn.Embedding(users, mlp[0] // 2)
        self.mlp_item = nn.Embedding(items, mlp[0] // 2)
        self.mlp = nn.Sequential(
            *[m for a, b in itertools.pairwise(mlp) for m in (nn.Linear(a, b), nn.ReLU())]
        )
        self.head = nn.Linear(mf_dim + mlp[-1], 1)

    def forward(self, pair: torch.Tensor) -> torch.Tensor:
        u, i = pair[:, 0], pair[:, 1]
        mf = self.mf_user(u) * self.mf_item(i)
        h = self.mlp(torch.cat([self.mlp_user(u), self.mlp_item(i)], dim=1))
        out: torch.Tensor = self.head(torch.cat([mf, h], dim=1))
        return out


def _image(model: nn.Module) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return model, (torch.empty(1, 3, 224, 224, device="meta"),)


def _tokens(
    model: nn.Module, length: int, vocab: int = 2
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return model, (torch.zeros(1, length, dtype=torch.long, device="meta"),)


BUILDERS: dict[str, Builder] = {
    "resnet50": lambda: _image(ResNet([3, 4, 6, 3])),
    "resnet152": lambda: _image(ResNet([3, 8, 36, 3])),
    "vgg16": lambda: _image(VGG(16)),
    "vgg19": lambda: _image(VGG(19)),
    "bert-base": lambda: _tokens(Transformer(30522, 512, 768, 12, 12, 3072, gpt=False), 128),
    "bert-large": lambda: _tokens(Transformer(30522, 512, 1024, 24, 16, 4096, gpt=False), 128),
    "gpt2": lambda: _tokens(Transformer(50257, 1024, 768, 12, 12, 3072, gpt=True), 1024),
    # GPT-2 XL (1.5B parameters): the scale studies' model (simulated only)
    "gpt2-xl": lambda: _tokens(Transformer(50257, 1024, 1600, 48, 25, 6400, gpt=True), 1024),
    "lstm": lambda: _tokens(LSTMLM(), 35),
    # A small MLP (51K parameters) for tests and quick runs of the protocols.
    "mlp": lambda: (
        nn.Sequential(
            nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10)
        ),
        (torch.empty(1, 64, device="meta"),),
    ),
    "ncf": lambda: (NCF(), (torch.zeros(1, 2, dtype=torch.long, device="meta"),)),
}
