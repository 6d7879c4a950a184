"""What a run's MFU is made of: the model's FLOPs per sample and a worker's measured peak."""

from __future__ import annotations

import torch
from torch import nn

from gradmesh.models.flops import flops_per_sample, measured_peak_flops


def test_flops_per_sample_counts_forward_and_backward_on_the_meta_device() -> None:
    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(8, 4, bias=False), nn.Linear(4, 2, bias=False))

    # forward 2 x 8 x 4 + 2 x 4 x 2; backward: both weights' gradients, and the input gradient
    # of the second layer only (the sample itself needs none)
    forward = 2 * 8 * 4 + 2 * 4 * 2
    backward = 2 * 8 * 4 + 2 * 4 * 2 + 2 * 4 * 2
    assert flops_per_sample(build, torch.randn(1, 8)) == forward + backward


def test_the_measured_peak_is_a_rate_of_dense_arithmetic() -> None:
    peak = measured_peak_flops(seconds=0.05, n=128)
    # any CPU that runs torch does 0.1 GFLOP/s and none of ours 100 TFLOP/s on one process
    assert 1e8 < peak < 1e14


def test_a_model_that_reads_values_back_is_counted_on_a_real_copy() -> None:
    class Reads(nn.Module):  # as a Hugging Face Llama does: .item() fails on the meta device
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 4, bias=False), nn.Linear(4, 2, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x)) * (1.0 if x.abs().sum().item() >= 0 else 0.0)

    plain = flops_per_sample(
        lambda: nn.Sequential(nn.Linear(8, 4, bias=False), nn.Linear(4, 2, bias=False)),
        torch.randn(1, 8),
    )
    assert flops_per_sample(Reads, torch.randn(1, 8)) == plain
