"""A tiny Llama built from `transformers`' LlamaConfig (grouped-query attention: 4 query heads,
2 key/value heads), split by the tensor-parallel plan the model declares, and cut into 2
pipeline stages at its second decoder layer on its graph (the cut carries the residual stream,
the rotary embeddings and the attention mask); trained 20 AdamW steps in float64 on 2 gloo
ranks and compared with one process (as tests/distributed/test_any_model.py does for
gradmesh's own GPT). Needs the `hf` extra, which `make test` installs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import gradmesh
from gradmesh.layout.tensor_parallel import unshard
from gradmesh.layout.tp_plan import shard_specs
from tests.harness import run_ranks

pytest.importorskip("transformers", reason="the hf extra (pip install 'gradmesh[hf]') is missing")

LLAMA = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
STEPS, VOCAB, SEQ = 20, 64, 16


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum") / y.shape[1]


def train_llama() -> Any:
    from gradmesh.models.hf import build

    rt = gradmesh.get_runtime()
    torch.manual_seed(0)
    model = build("llama")((SEQ,), VOCAB, **LLAMA).double()
    data = torch.randint(0, VOCAB, (STEPS, 8, SEQ + 1), generator=torch.Generator().manual_seed(1))
    step_fn = None
    model = gradmesh.parallelize(model)  # the plan the model declares (tp 1: left whole)
    specs = shard_specs(model)
    if rt.mesh["pp"].size > 1:  # then cut on the graph
        stage = gradmesh.pipeline_stage(
            model, data[0, :, :-1], ["net.model.layers.1"], 4, "1f1b", lm_loss
        )
        model, step_fn = stage.stage_module, stage.step
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        x, y = data[step, :, :-1], data[step, :, 1:]
        opt.zero_grad()
        if step_fn is not None:
            step_fn(x, y, 1.0 / len(y))
        else:
            (lm_loss(model(x), y) / len(y)).backward()
        opt.step()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    return (rt.mesh["pp"].index, rt.mesh["tp"].index), params, specs


def test_a_tiny_llama_split_by_its_declared_plan_equals_one_process() -> None:
    ((_, want, _),) = run_ranks(train_llama, 1)
    parts = sorted(run_ranks(train_llama, 2, init={"tensor_parallel": 2}), key=lambda r: r[0])
    specs = parts[0][2]
    assert [p[0] for p in parts] == [(0, 0), (0, 1)]
    # q/k/v/o, the MLP, the embedding and the head are split; the norms stay whole
    assert {n.rsplit(".", 2)[-2] for n in specs} >= {"q_proj", "k_proj", "o_proj", "down_proj"}
    assert "net.model.embed_tokens.weight" in specs and "net.lm_head.weight" in specs
    for name, whole in want.items():
        pieces = [p[1][name] for p in parts]
        got = unshard(pieces, *specs[name]) if name in specs else pieces[0]
        error = float((got - whole).abs().max() / whole.abs().max())
        assert error <= 1e-9, f"{name}: {error:.2e} of its largest value"


def test_a_tiny_llama_cut_on_its_graph_equals_one_process() -> None:
    ((_, want, _),) = run_ranks(train_llama, 1)
    stages = sorted(run_ranks(train_llama, 2, init={"pipeline_parallel": 2}), key=lambda r: r[0])
    assert "net.model.embed_tokens.weight" in stages[0][1]
    assert (
        "net.lm_head.weight" in stages[1][1]
        and "net.model.layers.1.mlp.up_proj.weight" in stages[1][1]
    )
    seen = set()
    for _, params, _ in stages:
        for name, tensor in params.items():
            seen.add(name)
            error = float((tensor - want[name]).abs().max() / want[name].abs().max())
            assert error <= 1e-9, f"{name}: {error:.2e} of its largest value"
    assert seen == set(want)


def test_a_tiny_llama_split_by_its_plan_then_cut_on_its_graph_equals_one_process() -> None:
    """tp 2 x pp 2: each stage's q/k/v/o and MLP split over its 2 tp ranks (the grouped-query
    heads too: 2 query and 1 key/value head a rank), the cut carrying the split model's
    residual stream, rotary embeddings and mask."""
    ((_, want, _),) = run_ranks(train_llama, 1)
    init = {"pipeline_parallel": 2, "tensor_parallel": 2}
    parts = run_ranks(train_llama, 4, init=init)
    specs = parts[0][2]
    assert "net.model.layers.1.self_attn.k_proj.weight" in specs
    seen = set()
    for stage in (0, 1):
        group = sorted((p for p in parts if p[0][0] == stage), key=lambda p: p[0][1])
        for name in group[0][1]:
            seen.add(name)
            pieces = [p[1][name] for p in group]
            got = unshard(pieces, *specs[name]) if name in specs else pieces[0]
            error = float((got - want[name]).abs().max() / want[name].abs().max())
            assert error <= 1e-9, f"stage {stage} {name}: {error:.2e} of its largest value"
    assert seen == set(want)
