"""Tensor parallelism by module name on models that are not a sequence of layers: a GPT with a
fused q/k/v projection and an output head tied to its embedding (also with grouped-query
attention and a vocabulary-parallel loss), and a residual CNN; each trained 20 AdamW steps on
real gloo ranks through `gradmesh.parallelize` and compared with one process, parameter by
parameter, to 1e-5 of the tensor's largest value."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import gradmesh
from gradmesh.layout.tensor_parallel import unshard
from gradmesh.layout.tp_plan import shard_specs
from gradmesh.models.gpt import GPT, GPTConfig
from gradmesh.models.small import ResidualCNN
from tests.harness import run_ranks

STEPS, BATCH = 20, 8
MHA = {"vocab": 64, "seq": 16, "dim": 32, "depth": 2, "heads": 4}
GQA = {**MHA, "kv_heads": 2}


def _model(kind: str, args: dict[str, int]) -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(**args)) if kind == "gpt" else ResidualCNN(1, 10, width=8)


def _batches(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    if kind == "gpt":
        data = torch.randint(0, MHA["vocab"], (STEPS, BATCH, MHA["seq"] + 1), generator=g)
        return data[:, :, :-1], data[:, :, 1:]
    return torch.randn(STEPS, BATCH, 1, 8, 8, generator=g), torch.randint(
        0, 10, (STEPS, BATCH), generator=g
    )


def train(kind: str, args: dict[str, int], vocab_loss: bool) -> Any:
    """20 AdamW steps on this rank's part; returns (tp index, dp index, parameters, specs)."""
    rt = gradmesh.get_runtime()
    coords = rt.mesh.shape.coords(rt.rank)
    model = _model(kind, args)
    plan = dict(model.tp_plan)
    if vocab_loss:
        plan["head"] = "colwise"  # logits stay split by vocabulary
    model = gradmesh.parallelize(model, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dp = rt.mesh["dp"].size
    if dp > 1:
        opt = gradmesh.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    xs, ys = _batches(kind)
    for step in range(STEPS):
        x, y = xs[step].chunk(dp)[coords["dp"]], ys[step].chunk(dp)[coords["dp"]]
        out = model(x)
        if vocab_loss:
            loss = gradmesh.vocab_parallel_cross_entropy(out, y).mean()
        else:
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    return coords["tp"], coords["dp"], params, shard_specs(model)


@pytest.fixture(scope="module")
def references() -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for key, kind, args in (("mha", "gpt", MHA), ("gqa", "gpt", GQA), ("cnn", "cnn", {})):
        out[key] = run_ranks(train, 1, kind, args, False)[0][2]
    return out


CASES = {
    # name: (reference, kind, args, vocab-parallel loss, world, tp)
    "gpt-tp2": ("mha", "gpt", MHA, False, 2, 2),
    "gpt-gqa-tp2-vocab-loss": ("gqa", "gpt", GQA, True, 2, 2),
    "gpt-dp2-tp2": ("mha", "gpt", MHA, False, 4, 2),
    "residual-cnn-tp2": ("cnn", "cnn", {}, False, 2, 2),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_tensor_parallel_by_name_equals_one_process(
    case: str, references: dict[str, dict[str, torch.Tensor]]
) -> None:
    ref, kind, args, vocab_loss, world, tp = CASES[case]
    results = run_ranks(train, world, kind, args, vocab_loss, init={"tensor_parallel": tp})
    replica = sorted((r for r in results if r[1] == 0), key=lambda r: r[0])
    specs = replica[0][3]
    assert specs, "nothing was split"
    want = references[ref]
    assert sorted(replica[0][2]) == sorted(want)  # names kept; the tied weight is one parameter
    for name, whole in want.items():
        pieces = [r[2][name] for r in replica]
        got = unshard(pieces, *specs[name]) if name in specs else pieces[0]
        assert got.shape == whole.shape, name
        error = float((got - whole).abs().max() / whole.abs().max())
        assert error <= 1e-5, f"{name}: {error:.2e} of its largest value"
    for other in results:  # every data-parallel replica ends the same
        same = next(r for r in replica if r[0] == other[0])
        for name, tensor in other[2].items():
            torch.testing.assert_close(tensor, same[2][name], rtol=0, atol=1e-6)
