"""The zero-bubble schedules on real gloo ranks, against one plain-PyTorch process: a user's GPT
and a `transformers.LlamaForCausalLM`, each 8 blocks deep with its output head tied to its
embedding, cut on their graphs by the whole recipe (`gradmesh.parallelize(model, layout)`)
into pp 2 and pp 4 under ZB-H1 and ZBV (8 stages on 4 ranks in a V: rank 0 holds the embedding
and the head), also with data parallelism (the reduction starts at each weight's last W) and
with a tensor-parallel split inside each stage. 4 AdamW steps in float64; every parameter,
put together from its tp slices, within 1e-9 of the one process's (the helpers are
`test_script_api`'s)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn

import gradmesh
from gradmesh.layout.tensor.plan import shard_specs
from tests.distributed import test_script_api as api
from tests.harness import run_ranks

transformers = pytest.importorskip(
    "transformers", reason="the hf extra (pip install 'gradmesh[hf]') is missing"
)

DEPTH = 8
STEPS = 4
"""Each layout's first steps already differ if a schedule drops, repeats or misorders a B or
a W (a wrong gradient moves AdamW's very first update): four of `test_script_api`'s batches."""
LAYOUTS = {  # name: (tp, pp, schedule, micro-batches, stages)
    "pp2-zb-h1": (1, 2, "zb-h1", 4, 2),
    "pp2-zbv": (1, 2, "zbv", 4, 4),
    "pp4-zb-h1": (1, 4, "zb-h1", 4, 4),
    "pp4-zbv": (1, 4, "zbv", 8, 8),
    "dp2xpp2-zbv": (1, 2, "zbv", 2, 4),
    "tp2xpp2-zb-h1": (2, 2, "zb-h1", 4, 2),
}
JOBS = {
    "2": [(kind, name) for kind in ("gpt", "llama") for name in ("pp2-zb-h1", "pp2-zbv")],
    "4": [
        ("gpt", "pp4-zb-h1"),  # the Llama runs ZB-H1 at pp 2 and with tp 2 below
        *[(kind, "pp4-zbv") for kind in ("gpt", "llama")],
        ("gpt", "dp2xpp2-zbv"),
        ("llama", "tp2xpp2-zb-h1"),
    ],
}


def build(kind: str) -> tuple[nn.Module, str, Any]:
    """The model (float64, seed 0, head tied to the embedding), its blocks' prefix, its loss."""
    torch.manual_seed(0)
    if kind == "gpt":
        model = api.UserGPT(depth=DEPTH)
        model.head.weight = model.tok.weight
        return model.double(), "blocks", api.gpt_loss
    config = transformers.LlamaConfig(
        vocab_size=api.VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=DEPTH,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=api.SEQ,
        tie_word_embeddings=True,
    )
    return transformers.LlamaForCausalLM(config).double(), "model.layers", api.llama_loss


def one_process(kind: str) -> dict[str, torch.Tensor]:
    model, _, loss_fn = build(kind)
    xs, ys = api.batches(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        opt.zero_grad()
        loss_fn(model(xs[step]), ys[step]).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def train(kind: str, name: str) -> Any:
    tp, pp, schedule, m, stages = LAYOUTS[name]
    rt = gradmesh.init(mesh={"tp": tp, "pp": pp})
    coords, dp = rt.mesh.shape.coords(rt.rank), rt.mesh.shape.dp
    model, prefix, loss_fn = build(kind)
    points = [f"{prefix}.{DEPTH * k // stages}" for k in range(1, stages)]
    xs, ys = api.batches(kind)
    mine = slice(coords["dp"] * api.BATCH // dp, (coords["dp"] + 1) * api.BATCH // dp)
    layout = gradmesh.LayoutConfig(
        tensor_parallel=tp,
        pipeline_parallel=pp,
        microbatches=m,
        schedule=schedule,
        stages=",".join(points),
    )
    part = gradmesh.parallelize(model, layout, example=xs[0, mine], loss_fn=loss_fn)
    specs = shard_specs(model)
    opt = gradmesh.DistributedOptimizer(
        torch.optim.AdamW(part.module.parameters(), lr=1e-2),
        named_parameters=part.module.named_parameters(),
        backward_passes_per_step=part.backward_passes,
    )
    for step in range(STEPS):
        opt.zero_grad()
        part.step(xs[step, mine], ys[step, mine], 1.0 / len(ys[step, mine]))
        opt.step()
    params = {k: v.detach().clone() for k, v in part.module.named_parameters()}
    gradmesh.shutdown()
    return coords, params, specs


def all_layouts(job: str, ports: list[int]) -> list[Any]:
    gradmesh.shutdown()  # the harness's world (see test_script_api.all_layouts)
    results = []
    for (kind, name), port in zip(JOBS[job], ports, strict=True):
        os.environ["MASTER_PORT"] = str(port)
        results.append(train(kind, name))
    return results


@pytest.mark.parametrize("job", sorted(JOBS))
def test_zero_bubble_schedules_equal_one_process(job: str) -> None:
    ports = api.distinct_ports(len(JOBS[job]))
    ranks = run_ranks(all_layouts, int(job), job, ports, timeout=400.0)
    wants: dict[str, dict[str, torch.Tensor]] = {}
    for i, (kind, name) in enumerate(JOBS[job]):
        if kind not in wants:
            wants[kind] = one_process(kind)
        api.assert_equal([r[i] for r in ranks], wants[kind], f"{kind} {name}")
