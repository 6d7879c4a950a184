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


class Weighted(nn.Module):
    """Two inputs by keyword (as a Hugging Face model takes input_ids and attention_mask)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Net(24)

    def forward(self, features: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.net(features * scale)


def weighted_model() -> nn.Module:
    return Weighted()


def weighted_data() -> tuple[dict, dict, dict, dict]:
    """The blobs as dicts: inputs {features, scale}, targets {label, weight}."""
    x_train, y_train, x_test, y_test = data()
    g = torch.Generator().manual_seed(1)

    def inputs(x: torch.Tensor) -> dict:
        return {"features": x, "scale": 0.5 + torch.rand(len(x), 1, generator=g)}

    def targets(y: torch.Tensor) -> dict:
        return {"label": y, "weight": 0.5 + torch.rand(len(y), generator=g)}

    return inputs(x_train), targets(y_train), inputs(x_test), targets(y_test)


def weighted_loss(out: torch.Tensor, y: dict) -> torch.Tensor:
    per_sample = F.cross_entropy(out, y["label"], reduction="none")
    return (per_sample * y["weight"]).mean()


class ValueReader(nn.Module):
    """A token model whose forward reads its input's values (a range check), which a forward on
    the meta device cannot."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 16)
        self.out = nn.Linear(16, 100)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if int(ids.max()) >= 100:
            raise ValueError("a token id past the vocabulary")
        return self.out(self.embed(ids))


def value_reader() -> nn.Module:
    return ValueReader()
