"""A tiny Llama built from `transformers`' LlamaConfig (grouped-query attention: 4 query heads,
2 key/value heads), split by the tensor-parallel plan the model declares, trained 20 AdamW steps
in float64 on 2 gloo ranks and compared with one process (as tests/distributed/test_any_model.py
does for gradmesh's own GPT). Needs the `hf` extra, which `make test` installs."""

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


def train_llama() -> Any:
    from gradmesh.models.hf import build

    rt = gradmesh.get_runtime()
    torch.manual_seed(0)
    model = build("llama")((SEQ,), VOCAB, **LLAMA).double()
    model = gradmesh.parallelize(model)  # the plan the model declares (tp 1: left whole)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.randint(0, VOCAB, (STEPS, 8, SEQ + 1), generator=torch.Generator().manual_seed(1))
    for step in range(STEPS):
        x, y = data[step, :, :-1], data[step, :, 1:]
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    return rt.mesh["tp"].index, params, shard_specs(model)


def test_a_tiny_llama_split_by_its_declared_plan_equals_one_process() -> None:
    ((_, want, _),) = run_ranks(train_llama, 1)
    parts = sorted(run_ranks(train_llama, 2, init={"tensor_parallel": 2}), key=lambda r: r[0])
    specs = parts[0][2]
    # q/k/v/o, the MLP, the embedding and the head are split; the norms stay whole
    assert {n.rsplit(".", 2)[-2] for n in specs} >= {"q_proj", "k_proj", "o_proj", "down_proj"}
    assert "net.model.embed_tokens.weight" in specs and "net.lm_head.weight" in specs
    for name, whole in want.items():
        pieces = [p[1][name] for p in parts]
        got = unshard(pieces, *specs[name]) if name in specs else pieces[0]
        error = float((got - whole).abs().max() / whole.abs().max())
        assert error <= 1e-9, f"{name}: {error:.2e} of its largest value"
