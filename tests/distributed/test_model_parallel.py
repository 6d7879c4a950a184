"""Tensor and pipeline parallelism on real gloo ranks, against one process with the whole model.

Each job trains through the trainer's own parts (setup, attach, loop) for 20 steps of SGD with
momentum and weight decay on the same global batches; the parameters each rank ends with are
put back together and compared with the single process's, to 1e-5 relative.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import gradmesh
from gradmesh.layout.tensor.layers import ParallelLayer
from gradmesh.train.config import TrainConfig
from gradmesh.train.loop import loop
from gradmesh.train.resume import resume
from gradmesh.train.setup import attach, setup
from tests.harness import run_ranks

# 320 training samples at a global batch of 16: one epoch is 20 steps
BASE = TrainConfig.of(
    model="cnn",
    dataset="synthetic",
    synthetic_samples=400,
    batch_size=16,
    epochs=1,
    lr=0.05,
    momentum=0.9,
    weight_decay=1e-3,
    seed=4,
)


def train_parts(
    config: TrainConfig,
) -> tuple[dict[str, int], dict[str, torch.Tensor], dict[str, str]]:
    """Train on this rank; return its mesh coordinates, its part's parameters, and how each
    split parameter is cut (name -> 'colwise' | 'rowwise')."""
    rt = gradmesh.get_runtime()
    job = setup(config, rt)
    resume(job)
    attach(job)
    loop(job)
    styles = {}
    for name, module in job.split.module.named_modules():
        if isinstance(module, ParallelLayer):
            styles[f"{name}.weight"] = module.style
            if module.style == "colwise":
                styles[f"{name}.bias"] = module.style
    state = {k: v.detach().clone() for k, v in job.split.module.named_parameters()}
    return rt.mesh.shape.coords(rt.rank), state, styles


def whole(
    results: list[tuple[dict[str, int], dict[str, torch.Tensor], dict[str, str]]],
) -> dict[str, torch.Tensor]:
    """The whole model's parameters from the first replica's parts."""
    parts: dict[str, list[tuple[int, torch.Tensor]]] = {}
    styles: dict[str, str] = {}
    for coords, state, style in results:
        if coords["dp"] != 0:
            continue
        styles.update(style)
        for name, tensor in state.items():
            parts.setdefault(name, []).append((coords["tp"], tensor))
    out = {}
    for name, pieces in parts.items():
        pieces.sort(key=lambda item: item[0])
        if name in styles:
            dim = 0 if styles[name] == "colwise" else 1
            out[name] = torch.cat([t for _, t in pieces], dim=dim)
        else:
            out[name] = pieces[0][1]
    return out


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    (result,) = run_ranks(train_parts, 1, BASE)
    return result[1]


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].shape == want[name].shape, name
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


HYBRID = {
    "model": "cnn",
    "tensor_parallel": 4,
    "layers": {"0": "data", "2": "data", "6": "colwise", "8": "rowwise"},
}
MIXED = {
    "model": "cnn",
    "tensor_parallel": 2,
    "layers": {"0": "replicate", "2": "data", "6": "colwise", "8": "rowwise"},
}

LAYOUTS = {
    "tp2": (2, dict(tensor_parallel=2)),
    "pp2-1f1b": (2, dict(pipeline_parallel=2, microbatches=4, schedule="1f1b", stages="6")),
    "dp2-tp2": (4, dict(tensor_parallel=2)),
    "dp2-pp2": (4, dict(pipeline_parallel=2, microbatches=4, schedule="1f1b")),
    # 4 stages, one per layer with weights: rank 0 holds layers 0 and 6, rank 1 layers 2 and 8
    "pp2-interleaved": (2, dict(pipeline_parallel=2, microbatches=4, schedule="interleaved")),
    # the hybrid plan: convolutions data-parallel over all 4 ranks, the fully connected pair split
    "hybrid-tp4": (4, dict(plan=json.dumps(HYBRID), tensor_parallel=4)),
    # every conversion: a replicated first layer sliced for a data-parallel one, dp 2 x tp 2
    "hybrid-dp2-tp2": (4, dict(plan=json.dumps(MIXED), tensor_parallel=2)),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_split_training_equals_one_process(layout: str, reference: dict[str, torch.Tensor]) -> None:
    world, fields = LAYOUTS[layout]
    config = BASE.with_options(workers=world, **fields)
    init = {k: v for k, v in fields.items() if k in ("tensor_parallel", "pipeline_parallel")}
    results = run_ranks(train_parts, world, config, init=init, timeout=120)
    assert_same(whole(results), reference)
    if config.layout.tensor_parallel > 1:  # the split layers really are split
        assert results[0][1]["6.weight"].shape == (64 // config.layout.tensor_parallel, 512)


def column_row_pair() -> tuple[torch.Tensor, ...]:
    """A Linear pair split column-wise then row-wise: outputs and gradients of the whole pair."""
    torch.manual_seed(0)
    pair = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    plain = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    plain.load_state_dict(pair.state_dict())
    tp = gradmesh.mesh()["tp"]
    gradmesh.parallelize(pair, {"0": "colwise", "2": "rowwise"})
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
    xs = x.clone().requires_grad_()
    xp = x.clone().requires_grad_()
    out, ref = pair(xs), plain(xp)
    F.mse_loss(out, torch.ones_like(out)).backward()
    F.mse_loss(ref, torch.ones_like(ref)).backward()
    w0 = plain[0].weight.grad.chunk(tp.size, 0)[tp.index]
    w2 = plain[2].weight.grad.chunk(tp.size, 1)[tp.index]
    return (
        out.detach() - ref.detach(),
        xs.grad - xp.grad,
        pair[0].weight.grad - w0,
        pair[2].weight.grad - w2,
        pair[2].bias.grad - plain[2].bias.grad,
    )


def test_column_then_row_parallel_pair_is_the_plain_pair() -> None:
    for diffs in run_ranks(column_row_pair, 2, init={"tensor_parallel": 2}):
        for d in diffs:
            assert float(d.abs().max()) < 1e-6
