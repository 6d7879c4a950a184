"""Models by name: each builder takes (input_shape, num_classes) and returns an `nn.Module`."""

from collections.abc import Callable

import torch
from torch import nn

from gradmesh.errors import GradmeshError
from gradmesh.registry import Registry

ModelFn = Callable[[tuple[int, ...], int], nn.Module]
MODELS: Registry[ModelFn] = Registry("model")


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


@MODELS.register("mlp")
def mlp(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """One hidden layer of 128 units on the flattened input."""
    features = int(torch.tensor(input_shape).prod())
    return nn.Sequential(
        nn.Flatten(), nn.Linear(features, 128), nn.ReLU(), nn.Linear(128, num_classes)
    )


@MODELS.register("linear")
def linear(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Multinomial logistic regression on the flattened input."""
    features = int(torch.tensor(input_shape).prod())
    return nn.Sequential(nn.Flatten(), nn.Linear(features, num_classes))
