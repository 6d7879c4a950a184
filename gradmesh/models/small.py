"""The project's own models: a small CNN, AlexNet's shape at 32x32, an MLP, logistic regression,
and a sparse bag-of-features model; each with its tensor-parallel plan where it has one."""

from __future__ import annotations

import math

import torch
from torch import nn

from gradmesh.errors import GradmeshError
from gradmesh.models.registry import MODELS, TP_PLANS


@MODELS.register("cnn")
def small_cnn(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Two 3x3 convolutions, pooled to 4x4, then two fully connected layers (~38k parameters)."""
    if len(input_shape) != 3:
        raise GradmeshError(
            f"model cnn needs (channels, height, width) inputs, got shape {input_shape}"
        )
    channels = input_shape[0]
    return nn.Sequential(
        nn.Conv2d(channels, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveMaxPool2d(4),
        nn.Flatten(),
        nn.Linear(32 * 16, 64),
        nn.ReLU(),
        nn.Linear(64, num_classes),
    )


# each convolution pair and the fully connected pair: column-parallel, then row-parallel
TP_PLANS.register("cnn")({"0": "colwise", "2": "rowwise", "6": "colwise", "8": "rowwise"})


@MODELS.register("alexnet")
def alexnet(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """AlexNet's shape at 32x32: three convolution blocks (3x3, ReLU, 2x2 max-pool) then three
    fully connected layers of 1024 units, which hold 97% of the ~2.7M parameters (as AlexNet's
    and VGG's hold over 85%): the model where splitting the weights pays."""
    if len(input_shape) != 3 or input_shape[1] % 8 or input_shape[2] % 8:
        raise GradmeshError(
            "model alexnet needs (channels, height, width) inputs with height and width "
            f"multiples of 8, got shape {input_shape}"
        )
    channels, height, width = input_shape
    return nn.Sequential(
        nn.Conv2d(channels, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(64, 96, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(96 * (height // 8) * (width // 8), 1024),
        nn.ReLU(),
        nn.Linear(1024, 1024),
        nn.ReLU(),
        nn.Linear(1024, num_classes),
    )


# the convolutions (3% of the weights) stay whole; the first two fully connected layers split
TP_PLANS.register("alexnet")({"10": "colwise", "12": "rowwise"})


@MODELS.register("mlp")
def mlp(
    input_shape: tuple[int, ...], num_classes: int, depth: int = 1, width: int = 128
) -> nn.Module:
    """`depth` hidden layers of `width` units (ReLU) on the flattened input (deeper: a layer
    sequence to pipeline, as the schedules' benchmarks do)."""
    features = math.prod(input_shape)
    layers: list[nn.Module] = [nn.Flatten(), nn.Linear(features, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, num_classes))


TP_PLANS.register("mlp")({"1": "colwise", "3": "rowwise"})


@MODELS.register("linear")
def linear(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Multinomial logistic regression on the flattened input."""
    features = math.prod(input_shape)
    return nn.Sequential(nn.Flatten(), nn.Linear(features, num_classes))


class BagOfFeatures(nn.Module):
    """A linear classifier over bags of feature ids: logits = sum of the ids' weight rows + bias.

    The weight is an `EmbeddingBag` with sparse gradients, so a step touches only the rows of the
    ids in the batch; id 0 is padding. Zero-initialised, as linear models usually are.
    """

    def __init__(self, vocab: int, num_classes: int) -> None:
        super().__init__()
        self.weight = nn.EmbeddingBag(vocab, num_classes, mode="sum", sparse=True, padding_idx=0)
        nn.init.zeros_(self.weight.weight)
        self.bias = nn.Parameter(torch.zeros(num_classes, device=self.weight.weight.device))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.weight(ids) + self.bias
        return logits


@MODELS.register("bag")
def bag(input_shape: tuple[int, ...], num_classes: int, vocab: int = 0) -> nn.Module:
    """Sparse linear model over feature ids (see `BagOfFeatures`)."""
    if len(input_shape) != 1 or vocab < 2:
        raise GradmeshError(
            f"model bag needs 1-d feature-id inputs and a vocabulary, got {input_shape}, {vocab}"
        )
    return BagOfFeatures(vocab, num_classes)


class ResidualBlock(nn.Module):
    """x + conv2(relu(conv1(x))), 3x3 convolutions that keep the width."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.conv2 = nn.Conv2d(2 * width, width, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.conv2(torch.relu(self.conv1(x)))
        return out


class ResidualCNN(nn.Module):
    """A stem convolution, residual blocks, max-pooling to 2x2 and a two-layer classifier: the
    shape of a ResNet without its normalisation, small enough for digits (~25k parameters at
    the defaults). It declares its tensor-parallel plan (`tp_plan`): each block's first
    convolution split on output channels, its second on input channels (one allreduce per
    block), and the classifier pair split the same way."""

    def __init__(self, channels: int = 1, num_classes: int = 10, width: int = 16, depth: int = 2):
        super().__init__()
        self.stem = nn.Conv2d(channels, width, 3, padding=1)
        self.blocks = nn.ModuleList(ResidualBlock(width) for _ in range(depth))
        self.fc1 = nn.Linear(4 * width, 4 * width)
        self.fc2 = nn.Linear(4 * width, num_classes)

    tp_plan = {
        "blocks.*.conv1": "colwise",
        "blocks.*.conv2": "rowwise",
        "fc1": "colwise",
        "fc2": "rowwise",
    }

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.stem(x))
        for block in self.blocks:
            x = torch.relu(block(x))
        pooled = torch.nn.functional.adaptive_max_pool2d(x, 2).flatten(1)
        out: torch.Tensor = self.fc2(torch.relu(self.fc1(pooled)))
        return out


@MODELS.register("residual")
def resnet(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """A small residual CNN (see `ResidualCNN`)."""
    if len(input_shape) != 3:
        raise GradmeshError(
            f"model residual needs (channels, height, width) inputs, got shape {input_shape}"
        )
    return ResidualCNN(input_shape[0], num_classes)
