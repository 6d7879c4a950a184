"""The ImageNet classifiers that published scaling results use, written out layer by layer
(there is no CPU build of torchvision to import them from): ResNet-50 and ResNet-101 (He et
al., 2016), VGG-16 (Simonyan & Zisserman, 2015), Inception V3 (Szegedy et al., 2016) and
AlexNet in the one-tower form torchvision and most benchmarks train (Krizhevsky, 2014).

Their shapes (layers, channels, kernels, strides) are the published ones, so their parameter
counts (25.6M, 44.5M, 138.4M, 23.8M without the auxiliary head, 61.1M) and FLOPs match what
benchmarks of them report. The simulator builds them on torch's meta device (no memory, no
compute); `gradmesh train --dataset synthetic --synthetic-shape 3x224x224` can train them too.
`NATIVE_SHAPES` holds the input each was designed for.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from gradmesh.errors import GradmeshError
from gradmesh.models.registry import MODELS, TP_PLANS

NATIVE_SHAPES = {
    "resnet50": (3, 224, 224),
    "resnet101": (3, 224, 224),
    "vgg16": (3, 224, 224),
    "inception3": (3, 299, 299),
    "alexnet-imagenet": (3, 224, 224),
}


def _image(name: str, input_shape: tuple[int, ...], smallest: int) -> int:
    if len(input_shape) != 3 or min(input_shape[1:]) < smallest:
        raise GradmeshError(
            f"model {name} needs (channels, height, width) inputs of at least "
            f"{smallest}x{smallest}, got shape {input_shape}"
        )
    return input_shape[0]


def conv_bn(
    cin: int,
    cout: int,
    kernel: int | tuple[int, int],
    stride: int = 1,
    padding: int | tuple[int, int] = 0,
    eps: float = 1e-5,
) -> nn.Sequential:
    """Convolution without bias, batch norm, ReLU: the unit every modern convnet repeats."""
    return nn.Sequential(
        nn.Conv2d(cin, cout, kernel, stride, padding, bias=False),
        nn.BatchNorm2d(cout, eps=eps),
        nn.ReLU(inplace=True),
    )


# -- ResNet-50 ---------------------------------------------------------------------------------


class Bottleneck(nn.Module):
    """1x1 down, 3x3 (strided in the first block of a stage), 1x1 up x4, plus the shortcut."""

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        out = width * 4
        self.body = nn.Sequential(
            conv_bn(cin, width, 1),
            conv_bn(width, width, 3, stride, 1),
            nn.Conv2d(width, out, 1, bias=False),
            nn.BatchNorm2d(out),
        )
        self.shortcut = (
            nn.Sequential(nn.Conv2d(cin, out, 1, stride, bias=False), nn.BatchNorm2d(out))
            if stride != 1 or cin != out
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


def _resnet(
    name: str, depths: tuple[int, ...], input_shape: tuple[int, ...], classes: int
) -> nn.Module:
    cin = _image(name, input_shape, 32)
    layers: list[nn.Module] = [conv_bn(cin, 64, 7, 2, 3), nn.MaxPool2d(3, 2, 1)]
    channels = 64
    for stage, (blocks, width) in enumerate(zip(depths, (64, 128, 256, 512), strict=True)):
        for b in range(blocks):
            layers.append(Bottleneck(channels, width, 2 if b == 0 and stage > 0 else 1))
            channels = width * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, classes)]
    return nn.Sequential(*layers)


@MODELS.register("resnet50")
def resnet50(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """ResNet-50: a 7x7 stem, then 3, 4, 6 and 3 bottleneck blocks of width 64..512."""
    return _resnet("resnet50", (3, 4, 6, 3), input_shape, num_classes)


@MODELS.register("resnet101")
def resnet101(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """ResNet-101: ResNet-50 with 23 blocks in its third stage."""
    return _resnet("resnet101", (3, 4, 23, 3), input_shape, num_classes)


# -- VGG-16 and AlexNet ------------------------------------------------------------------------


def _classifier(features: int, hidden: int, num_classes: int) -> list[nn.Module]:
    return [
        nn.Flatten(),
        nn.Dropout(),
        nn.Linear(features, hidden),
        nn.ReLU(inplace=True),
        nn.Dropout(),
        nn.Linear(hidden, hidden),
        nn.ReLU(inplace=True),
        nn.Linear(hidden, num_classes),
    ]


@MODELS.register("vgg16")
def vgg16(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """VGG-16 (configuration D): thirteen 3x3 convolutions in five pooled stages, then three
    fully connected layers of 4096 units (89% of the 138M parameters)."""
    cin = _image("vgg16", input_shape, 32)
    layers: list[nn.Module] = []
    for width, repeat in ((64, 2), (128, 2), (256, 3), (512, 3), (512, 3)):
        for _ in range(repeat):
            layers += [nn.Conv2d(cin, width, 3, padding=1), nn.ReLU(inplace=True)]
            cin = width
        layers.append(nn.MaxPool2d(2))
    layers += [nn.AdaptiveAvgPool2d(7), *_classifier(512 * 7 * 7, 4096, num_classes)]
    return nn.Sequential(*layers)


@MODELS.register("alexnet-imagenet")
def alexnet_imagenet(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """AlexNet at 224x224 in one tower: five convolutions (11x11 stride 4 first), then three
    fully connected layers of 4096 units (96% of the 61M parameters)."""
    cin = _image("alexnet-imagenet", input_shape, 64)
    return nn.Sequential(
        nn.Conv2d(cin, 64, 11, 4, 2),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2),
        nn.Conv2d(64, 192, 5, padding=2),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2),
        nn.Conv2d(192, 384, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.Conv2d(384, 256, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.Conv2d(256, 256, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2),
        nn.AdaptiveAvgPool2d(6),
        *_classifier(256 * 6 * 6, 4096, num_classes),
    )


# the first two fully connected layers split (column, then row), as in alexnet's plan
TP_PLANS.register("vgg16")({"34": "colwise", "37": "rowwise"})
TP_PLANS.register("alexnet-imagenet")({"16": "colwise", "19": "rowwise"})


# -- Inception V3 ------------------------------------------------------------------------------


def _bn(
    cin: int,
    cout: int,
    kernel: int | tuple[int, int],
    stride: int = 1,
    padding: int | tuple[int, int] = 0,
) -> nn.Sequential:
    return conv_bn(cin, cout, kernel, stride, padding, eps=1e-3)


class Branches(nn.Module):
    """Inception's module: parallel branches on one input, concatenated by channel."""

    def __init__(self, branches: Sequence[nn.Module]) -> None:
        super().__init__()
        self.branches = nn.ModuleList(branches)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([b(x) for b in self.branches], 1)


class Split(nn.Module):
    """A stem followed by two parallel convolutions whose outputs are concatenated
    (Inception V3's expanded filter banks, module E)."""

    def __init__(self, stem: nn.Module, left: nn.Module, right: nn.Module) -> None:
        super().__init__()
        self.stem, self.left, self.right = stem, left, right

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        return torch.cat([self.left(y), self.right(y)], 1)


def _seq(*layers: nn.Module) -> nn.Sequential:
    return nn.Sequential(*layers)


def _pool_branch(cin: int, cout: int) -> nn.Sequential:
    return _seq(nn.AvgPool2d(3, 1, 1), _bn(cin, cout, 1))


def _module_a(cin: int, pool: int) -> Branches:
    return Branches(
        [
            _bn(cin, 64, 1),
            _seq(_bn(cin, 48, 1), _bn(48, 64, 5, padding=2)),
            _seq(_bn(cin, 64, 1), _bn(64, 96, 3, padding=1), _bn(96, 96, 3, padding=1)),
            _pool_branch(cin, pool),
        ]
    )


def _module_b(cin: int) -> Branches:
    return Branches(
        [
            _bn(cin, 384, 3, 2),
            _seq(_bn(cin, 64, 1), _bn(64, 96, 3, padding=1), _bn(96, 96, 3, 2)),
            nn.MaxPool2d(3, 2),
        ]
    )


def _module_c(cin: int, c7: int) -> Branches:
    row, col = (1, 7), (7, 1)
    return Branches(
        [
            _bn(cin, 192, 1),
            _seq(
                _bn(cin, c7, 1), _bn(c7, c7, row, padding=(0, 3)), _bn(c7, 192, col, padding=(3, 0))
            ),
            _seq(
                _bn(cin, c7, 1),
                _bn(c7, c7, col, padding=(3, 0)),
                _bn(c7, c7, row, padding=(0, 3)),
                _bn(c7, c7, col, padding=(3, 0)),
                _bn(c7, 192, row, padding=(0, 3)),
            ),
            _pool_branch(cin, 192),
        ]
    )


def _module_d(cin: int) -> Branches:
    return Branches(
        [
            _seq(_bn(cin, 192, 1), _bn(192, 320, 3, 2)),
            _seq(
                _bn(cin, 192, 1),
                _bn(192, 192, (1, 7), padding=(0, 3)),
                _bn(192, 192, (7, 1), padding=(3, 0)),
                _bn(192, 192, 3, 2),
            ),
            nn.MaxPool2d(3, 2),
        ]
    )


def _module_e(cin: int) -> Branches:
    def fan(stem: nn.Module, width: int) -> Split:
        return Split(
            stem, _bn(width, 384, (1, 3), padding=(0, 1)), _bn(width, 384, (3, 1), padding=(1, 0))
        )

    return Branches(
        [
            _bn(cin, 320, 1),
            fan(_bn(cin, 384, 1), 384),
            fan(_seq(_bn(cin, 448, 1), _bn(448, 384, 3, padding=1)), 384),
            _pool_branch(cin, 192),
        ]
    )


@MODELS.register("inception3")
def inception3(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Inception V3 without its auxiliary classifier (which only adds a loss during training):
    a five-convolution stem, modules A x3, B, C x4, D, E x2, average pool, one linear layer."""
    cin = _image("inception3", input_shape, 75)
    return nn.Sequential(
        _bn(cin, 32, 3, 2),
        _bn(32, 32, 3),
        _bn(32, 64, 3, padding=1),
        nn.MaxPool2d(3, 2),
        _bn(64, 80, 1),
        _bn(80, 192, 3),
        nn.MaxPool2d(3, 2),
        _module_a(192, 32),
        _module_a(256, 64),
        _module_a(288, 64),
        _module_b(288),
        _module_c(768, 128),
        _module_c(768, 160),
        _module_c(768, 160),
        _module_c(768, 192),
        _module_d(768),
        _module_e(1280),
        _module_e(2048),
        nn.AdaptiveAvgPool2d(1),
        nn.Dropout(),
        nn.Flatten(),
        nn.Linear(2048, num_classes),
    )
