"""A seeded teacher-student classification task, large enough to resolve a
tenth of a percentage point of test accuracy.

Inputs are standard normal in ``dim`` dimensions; a fixed random teacher MLP
(``dim -> hidden -> classes``, ReLU) labels them by its argmax, and a share
``noise`` of the labels is then replaced by a class drawn uniformly. So the
best any model can do on the test set is known in closed form: predict the
teacher's label, right with probability ``1 - noise + noise / classes``
(``bayes_accuracy``). With 20,000 test examples one example is 0.005 pp.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TeacherTask:
    dim: int = 16
    hidden: int = 32
    classes: int = 10
    train: int = 50_000
    test: int = 20_000
    noise: float = 0.1
    seed: int = 2024  # the task's; a training run's seed is separate

    @property
    def bayes_accuracy(self) -> float:
        return 1 - self.noise + self.noise / self.classes

    def data(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x, y, x_test, y_test), the same for the same task."""
        g = torch.Generator().manual_seed(self.seed)
        w1 = torch.randn(self.dim, self.hidden, generator=g) / self.dim**0.5
        w2 = torch.randn(self.hidden, self.classes, generator=g) / self.hidden**0.5
        n = self.train + self.test
        x = torch.randn(n, self.dim, generator=g)
        y = (torch.relu(x @ w1) @ w2).argmax(1)
        flip = torch.rand(n, generator=g) < self.noise
        y = torch.where(flip, torch.randint(0, self.classes, (n,), generator=g), y)
        return x[: self.train], y[: self.train], x[self.train :], y[self.train :]

    def student(self) -> torch.nn.Sequential:
        """The model trained on it: wider and deeper than the teacher."""
        return torch.nn.Sequential(
            torch.nn.Linear(self.dim, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128),
            torch.nn.ReLU(), torch.nn.Linear(128, self.classes),
        )  # fmt: skip
