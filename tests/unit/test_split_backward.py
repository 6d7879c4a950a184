"""The backward split into B (the input's gradient) and W (the weights'): B leaves every weight's
gradient untouched, B then W equals the whole backward exactly, on the stage kinds a pipeline
makes (a layer sequence, a transformer block, a first stage of integer tokens, a stage using a
weight twice), and a custom autograd function that cannot be split is refused in one line."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from gradmesh.errors import GradmeshError
from gradmesh.layout.pipeline.split import backward_input
from gradmesh.models.gpt import GPT, GPTConfig

CONFIG = GPTConfig(vocab=40, seq=8, dim=16, depth=2, heads=2)


class Twice(nn.Module):
    """One weight on two paths of the stage's input."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(self.lin(x)))


def _stage(kind: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    if kind == "sequence":
        layers = [nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 8)]
        return nn.Sequential(*layers).double(), torch.randn(4, 8, dtype=torch.float64)
    if kind == "block":
        return GPT(CONFIG).blocks[0].double(), torch.randn(3, 8, 16, dtype=torch.float64)
    if kind == "twice":
        return Twice().double(), torch.randn(4, 8, dtype=torch.float64)
    return GPT(CONFIG).double(), torch.randint(0, 40, (3, 8))


@pytest.mark.parametrize("kind", ["sequence", "block", "twice", "tokens"])
def test_b_then_w_is_the_whole_backward(kind: str) -> None:
    stage, x = _stage(kind)
    whole = copy.deepcopy(stage)
    floating = x.is_floating_point()
    xs, xw = (x.clone().requires_grad_(floating) for _ in range(2))
    accumulated: list[str] = []
    for name, p in stage.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, name=name: accumulated.append(name))  # type: ignore[no-untyped-call]

    out, ref = stage(xs), whole(xw)
    grad = torch.randn_like(ref)
    ref.backward(grad)
    ins, work = backward_input([out], [grad], [xs])
    assert not accumulated and all(p.grad is None for p in stage.parameters())
    if floating:
        assert torch.equal(ins[0], xw.grad)
    else:
        assert ins == [None]
    work.run()
    assert sorted(accumulated) == sorted(n for n, _ in stage.named_parameters())
    for (name, p), q in zip(stage.named_parameters(), whole.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14, msg=name)


def test_the_last_stage_splits_from_its_scalar_loss() -> None:
    stage, x = _stage("block")
    whole = copy.deepcopy(stage)
    xs, xw = x.clone().requires_grad_(), x.clone().requires_grad_()
    whole(xw).square().mean().backward()
    ins, work = backward_input([stage(xs).square().mean()], None, [xs])
    assert all(p.grad is None for p in stage.parameters())
    work.run()
    torch.testing.assert_close(ins[0], xw.grad, rtol=1e-12, atol=1e-14)
    for p, q in zip(stage.parameters(), whole.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)


class _Scaled(torch.autograd.Function):
    """x * w with a backward that computes both gradients at once."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, w: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, g: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors  # type: ignore[attr-defined]
        return g * w, (g * x).sum(0)


def test_a_custom_function_using_a_weight_on_the_input_s_path_is_refused_in_one_line() -> None:
    w = nn.Parameter(torch.ones(4))
    x = torch.randn(2, 4, requires_grad=True)
    out = _Scaled.apply(x, w)
    with pytest.raises(
        GradmeshError, match=r"custom autograd function _ScaledBackward .* cannot run the two apart"
    ):
        backward_input([out], [torch.ones_like(out)], [x])
    # on the activations alone (as the tensor-parallel exchanges are), it splits
    lin = nn.Linear(4, 4)
    y = lin(_Scaled.apply(x, torch.ones(4)))
    ins, work = backward_input([y], [torch.ones_like(y)], [x])
    work.run()
    assert ins[0] is not None and lin.weight.grad is not None


def test_a_hook_changing_an_activation_s_gradient_changes_it_once() -> None:
    stage, x = _stage("sequence")
    whole = copy.deepcopy(stage)
    xs, xw = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, ref = stage(xs), whole(xw)
    out.register_hook(lambda g: 3 * g)  # type: ignore[no-untyped-call]
    ref.register_hook(lambda g: 3 * g)  # type: ignore[no-untyped-call]
    grad = torch.randn_like(ref)
    ref.backward(grad)
    ins, work = backward_input([out], [grad], [xs])
    work.run()
    torch.testing.assert_close(ins[0], xw.grad, rtol=1e-12, atol=1e-14)
    for p, q in zip(stage.parameters(), whole.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)


class _ScaledLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Scaled.apply(x, self.w)  # type: ignore[no-any-return]


def test_the_layout_check_refuses_such_a_layer_before_launch() -> None:
    from gradmesh.layout.config import LayoutConfig
    from gradmesh.layout.engine import check_layout

    model = nn.Sequential(nn.Linear(4, 4), _ScaledLayer(), nn.Linear(4, 4))
    sample = torch.randn(1, 4)
    split = LayoutConfig(pipeline_parallel=2, microbatches=2, schedule="zb-h1")
    with pytest.raises(GradmeshError, match="custom autograd function _ScaledBackward"):
        check_layout(model, "model", split, sample)
    check_layout(model, "model", LayoutConfig(pipeline_parallel=2, microbatches=2), sample)
