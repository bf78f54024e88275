"""The models ``bench ddp`` trains, each with its batches and its loss.

- ``mlp``: eight 1024x1024 linear layers (32 MB of dense gradients);
- ``neumf``: NeuMF on the synthetic click log (two large embeddings; a batch
  touches a few thousand rows: sparse gradients);
- ``mixed``: a large embedding bag and a dense 4-layer 1024-wide MLP (a
  DLRM-like recommender: some buckets sparse, others dense);
- ``dlrm``: DLRM-style (``Dlrm``): five tables of 200 to 400k rows, one
  Zipf-skewed id each per sample (``SkewedIds``), a bottom and a top MLP;
- ``transformer``: a small causal transformer language model (``TinyLM``,
  21 MB of dense gradients) on random token sequences.

Each ``MODELS`` entry builds (model, batch, loss): ``batch(rank, step)`` is
that rank's inputs and target at that step (seeded by both, so every replica
of a run sees the same batches). The recommenders with tables (``Mixed``,
``Dlrm``, and ``workloads.ctr.NeuMF``) also split into ``bags``, ``lookups``
and ``head`` (``Bagged``: the form ``lab.trec`` shards).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from gradfabric.workloads.ctr import ClickLog, ClickLogConfig, NeuMF

Batch = Callable[[int, int], tuple[tuple[torch.Tensor, ...], torch.Tensor]]  # (rank, step)


class Mixed(nn.Module):
    """A DLRM-like recommender: an embedding per feature, summed, then a dense MLP."""

    def __init__(self, rows: int = 400_000, dim: int = 64, width: int = 1024) -> None:
        super().__init__()
        self.emb = nn.EmbeddingBag(rows, dim, mode="sum")
        nn.init.normal_(self.emb.weight, std=0.01)
        self.mlp = nn.Sequential(
            nn.Linear(dim, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
            nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1),
        )  # fmt: skip

    # (``Bagged``: the form ``lab.trec`` shards)
    def bags(self) -> list[nn.EmbeddingBag]:
        return [self.emb]

    def dense(self) -> list[nn.Module]:
        return [self.mlp]

    def lookups(self, ids: torch.Tensor) -> tuple[list[torch.Tensor], tuple[torch.Tensor, ...]]:
        return [ids], ()

    def head(self, pooled: list[torch.Tensor]) -> torch.Tensor:
        out: torch.Tensor = self.mlp(pooled[0]).squeeze(1)
        return out

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head([self.emb(ids)])


DLRM_TABLES = (400_000, 100_000, 20_000, 2_000, 200)


class Dlrm(nn.Module):
    """A DLRM-style recommender (Naumov et al., 2019): 13 dense features
    through a bottom MLP, one categorical feature per embedding bag (tables of
    very different sizes), the pooled rows and the bottom's output
    concatenated into a top MLP. Its bags come first, so that its parameters'
    order is ``[*tables, *bottom, *top]``."""

    def __init__(self, rows: tuple[int, ...] = DLRM_TABLES, dim: int = 32) -> None:
        super().__init__()
        self.tables = nn.ModuleList(nn.EmbeddingBag(n, dim, mode="sum") for n in rows)
        for t in self.tables:
            nn.init.normal_(t.weight, std=0.01)  # type: ignore[arg-type]
        self.bottom = nn.Sequential(nn.Linear(13, 256), nn.ReLU(), nn.Linear(256, dim), nn.ReLU())
        self.top = nn.Sequential(
            nn.Linear(dim * (len(rows) + 1), 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
            nn.Linear(256, 1),
        )  # fmt: skip

    def bags(self) -> list[nn.EmbeddingBag]:
        return list(self.tables)  # type: ignore[arg-type]

    def dense(self) -> list[nn.Module]:
        return [self.bottom, self.top]

    def lookups(
        self, dense: torch.Tensor, ids: torch.Tensor
    ) -> tuple[list[torch.Tensor], tuple[torch.Tensor, ...]]:
        return [ids[:, k : k + 1] for k in range(ids.shape[1])], (dense,)

    def head(self, dense: torch.Tensor, pooled: list[torch.Tensor]) -> torch.Tensor:
        out: torch.Tensor = self.top(torch.cat([self.bottom(dense), *pooled], 1)).squeeze(1)
        return out

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        pooled = [t(ids[:, k : k + 1]) for k, t in enumerate(self.tables)]
        return self.head(dense, pooled)


def _mlp() -> tuple[nn.Module, Batch, Callable[..., torch.Tensor]]:
    model = nn.Sequential(*(m for _ in range(8) for m in (nn.Linear(1024, 1024), nn.Tanh())))

    def batch(rank: int, step: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        g = torch.Generator().manual_seed(rank * 100_003 + step)
        return (torch.randn(64, 1024, generator=g),), torch.randn(64, 1024, generator=g)

    return model, batch, nn.functional.mse_loss


def _neumf() -> tuple[nn.Module, Batch, Callable[..., torch.Tensor]]:
    log = ClickLog(ClickLogConfig(users=400_000, items=100_000))

    def batch(rank: int, step: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        users, items, clicks = log.batch(1024, rank, step)
        return (users, items), clicks

    return NeuMF(400_000, 100_000, 16), batch, nn.functional.binary_cross_entropy_with_logits


def _mixed() -> tuple[nn.Module, Batch, Callable[..., torch.Tensor]]:
    log = ClickLog(ClickLogConfig(users=400_000, items=100_000))

    def batch(rank: int, step: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        users, items, clicks = log.batch(512, rank, step)
        return (torch.stack([users, items % 400_000], 1),), clicks

    return Mixed(), batch, nn.functional.binary_cross_entropy_with_logits


class SkewedIds:
    """Categorical features as click logs have them: per table, ids drawn with
    Zipf popularity (``rank^-zipf``), the popular ones scattered over the table
    by a fixed permutation (as hashing does); batches by (rank, step) seeds."""

    def __init__(self, rows: tuple[int, ...], zipf: float, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.weights = [torch.arange(1, n + 1, dtype=torch.float64) ** -zipf for n in rows]
        self.perms = [torch.randperm(n, generator=g) for n in rows]

    def batch(self, size: int, g: torch.Generator) -> torch.Tensor:
        cols = [p[torch.multinomial(w, size, replacement=True, generator=g)]
                for w, p in zip(self.weights, self.perms, strict=True)]  # fmt: skip
        return torch.stack(cols, 1)


DLRM_ZIPF = 1.2


def _dlrm() -> tuple[nn.Module, Batch, Callable[..., torch.Tensor]]:
    ids = SkewedIds(DLRM_TABLES, DLRM_ZIPF)
    w = torch.randn(13, generator=torch.Generator().manual_seed(1))

    def batch(rank: int, step: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        g = torch.Generator().manual_seed(rank * 100_003 + step)
        dense = torch.randn(1024, 13, generator=g)
        clicks = (torch.rand(1024, generator=g) < torch.sigmoid(dense @ w)).float()
        return (dense, ids.batch(1024, g)), clicks

    return Dlrm(), batch, nn.functional.binary_cross_entropy_with_logits


class TinyLM(nn.Module):
    """A small causal transformer language model (4 pre-norm layers of width
    256, 4 heads, a 4096-token vocabulary, an untied output head: 5.3 M
    parameters, 21 MB of dense gradients)."""

    def __init__(self, vocab: int = 4096, width: int = 256, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.zeros(1, 64, width))
        layer = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True,
                                           norm_first=True)  # fmt: skip
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(n)
        h = self.body(self.embed(tokens) + self.pos[:, :n], mask=mask, is_causal=True)
        out: torch.Tensor = self.head(h).reshape(-1, self.head.out_features)
        return out


def _transformer() -> tuple[nn.Module, Batch, Callable[..., torch.Tensor]]:
    def batch(rank: int, step: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        g = torch.Generator().manual_seed(rank * 100_003 + step)
        text = torch.randint(0, 4096, (8, 33), generator=g)
        return (text[:, :-1],), text[:, 1:].reshape(-1)  # the next token at each position

    return TinyLM(), batch, nn.functional.cross_entropy


MODELS: dict[str, Callable[[], tuple[nn.Module, Batch, Callable[..., torch.Tensor]]]] = {
    "mlp": _mlp,
    "neumf": _neumf,
    "mixed": _mixed,
    "dlrm": _dlrm,
    "transformer": _transformer,
}
