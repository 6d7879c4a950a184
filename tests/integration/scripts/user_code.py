"""A user's own model, dataset and loss, as `gradmesh train --model pkg.module:factory` imports
them: nothing of gradmesh in here."""

import torch
import torch.nn.functional as F
from torch import nn


class Net(nn.Module):
    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.body = nn.ModuleList([nn.Linear(16, hidden), nn.Linear(hidden, hidden)])
        self.out = nn.Linear(hidden, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.body[0](x))
        h = h + torch.relu(self.body[1](h))  # a residual: not a sequence of layers
        return self.out(h)


def model(hidden: int = 32) -> nn.Module:
    return Net(hidden)


def data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Four Gaussian blobs in 16 dimensions: (x_train, y_train, x_test, y_test)."""
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(4, 16, generator=g) * 2
    y = torch.randint(0, 4, (1200,), generator=g)
    x = centres[y] + torch.randn(1200, 16, generator=g)
    return x[:1000], y[:1000], x[1000:], y[1000:]


def smooth_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y, label_smoothing=0.1)


def per_sample_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y, reduction="none")  # not a scalar: refused
