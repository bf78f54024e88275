"""scikit-learn's digits (8x8 images, 10 classes; it ships inside the
package) and a small MLP for them: a real dataset and model for the studies
that train on CPU."""

from __future__ import annotations

import numpy as np
import torch


def digits_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Standardised features; a fixed 80/20 train/test split: (x, y, x_test, y_test)."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    rng = np.random.default_rng(1234)
    order = rng.permutation(len(x))
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    cut = int(0.8 * len(x))
    tr, te = order[:cut], order[cut:]
    xt = torch.tensor(x, dtype=torch.float32)
    yt = torch.tensor(y, dtype=torch.int64)
    return xt[tr], yt[tr], xt[te], yt[te]


def digits_mlp() -> torch.nn.Sequential:
    return torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 10),
    )  # fmt: skip
