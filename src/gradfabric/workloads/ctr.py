"""An embedding-heavy recommender and the synthetic click log it learns from.

``click_log`` draws (user, item, click) triples: users uniform, items with
power-law (Zipf) popularity as in real catalogues, and clicks from a hidden
low-rank preference model plus an item-popularity bias, so there is
something to learn and a loss that falls. ``NeuMF`` is the NCF model (He et
al., WWW 2017): a generalised matrix factorisation branch and an MLP branch
over separate user and item embeddings. With dense embedding gradients (as DDP
buckets them) almost every gradient row is zero: the rows of the users and
items a batch did not touch. That is the workload OmniReduce was built for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ClickLogConfig:
    users: int = 200_000
    items: int = 100_000
    zipf: float = 1.1  # item popularity ~ rank^-zipf
    rank: int = 8  # of the hidden preference model
    seed: int = 0


class ClickLog:
    """A sampler of click triples; batches are drawn by (rank, step) seeds, so
    any process can regenerate any batch."""

    def __init__(self, cfg: ClickLogConfig) -> None:
        g = torch.Generator().manual_seed(cfg.seed)
        self.cfg = cfg
        self.u = torch.randn(cfg.users, cfg.rank, generator=g) / cfg.rank**0.5
        self.v = torch.randn(cfg.items, cfg.rank, generator=g) / cfg.rank**0.5
        ranks = torch.arange(1, cfg.items + 1, dtype=torch.float64)
        self.popularity = (ranks**-cfg.zipf / (ranks**-cfg.zipf).sum()).float()
        self.bias = torch.log(self.popularity * cfg.items).clamp(-3, 3) * 0.5

    def batch(self, size: int, *seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(hash((self.cfg.seed, *seed)) % 2**62)
        users = torch.randint(0, self.cfg.users, (size,), generator=g)
        items = torch.multinomial(self.popularity, size, replacement=True, generator=g)
        logit = 3.0 * (self.u[users] * self.v[items]).sum(1) + self.bias[items]
        clicks = (torch.rand(size, generator=g) < torch.sigmoid(logit)).float()
        return users, items, clicks


class NeuMF(nn.Module):
    def __init__(
        self,
        users: int,
        items: int,
        dim: int = 32,
        hidden: tuple[int, ...] = (64, 32),
        sparse: bool = False,
    ):
        """``sparse``: embeddings with sparse gradients (``nn.Embedding(sparse=True)``),
        the rows a batch touched only, which DDP all-reduces as sparse tensors."""
        super().__init__()
        self.gmf_user = nn.Embedding(users, dim, sparse=sparse)
        self.gmf_item = nn.Embedding(items, dim, sparse=sparse)
        self.mlp_user = nn.Embedding(users, dim, sparse=sparse)
        self.mlp_item = nn.Embedding(items, dim, sparse=sparse)
        for e in (self.gmf_user, self.gmf_item, self.mlp_user, self.mlp_item):
            nn.init.normal_(e.weight, std=0.01)
        layers: list[nn.Module] = []
        width = 2 * dim
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        self.mlp = nn.Sequential(*layers)
        self.out = nn.Linear(dim + width, 1)

    # (the form ``lab.trec`` shards: a table looked up by one id per
    # sample is a sum-pooled bag of one)
    def bags(self) -> list[nn.Embedding]:
        return [self.gmf_user, self.gmf_item, self.mlp_user, self.mlp_item]

    def dense(self) -> list[nn.Module]:
        return [self.mlp, self.out]

    def lookups(
        self, users: torch.Tensor, items: torch.Tensor
    ) -> tuple[list[torch.Tensor], tuple[torch.Tensor, ...]]:
        return [users[:, None], items[:, None], users[:, None], items[:, None]], ()

    def head(self, rows: list[torch.Tensor]) -> torch.Tensor:
        """The output from each table's rows, in ``bags`` order."""
        gmf_user, gmf_item, mlp_user, mlp_item = rows
        mlp = self.mlp(torch.cat([mlp_user, mlp_item], dim=1))
        logit: torch.Tensor = self.out(torch.cat([gmf_user * gmf_item, mlp], dim=1))
        return logit.squeeze(1)

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        ids, _ = self.lookups(users, items)  # (which table each id column reads: said once)
        return self.head([t(i[:, 0]) for t, i in zip(self.bags(), ids, strict=True)])
