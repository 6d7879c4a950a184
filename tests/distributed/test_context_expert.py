"""Context and expert parallelism against one plain-PyTorch process.

gradmesh's GPT (4 heads, sequence 16) and its mixture-of-experts form (4 experts, top-2,
dropless routing, balance loss on) train 20 AdamW steps in float64 through the whole recipe,
`gradmesh.parallelize(model, LayoutConfig(...))` on a mesh given as `init(mesh={...})`: the
GPT at cp 2 and cp 4 with ring and with all-to-all attention, dp 2 x cp 2 and tp 2 x cp 2; the
mixture at ep 2, ep 4, dp 2 x ep 2 (ZeRO-1) and tp 2 x ep 2; the GPT also at dp 2 x cp 2
under ZeRO-3 (FSDP2 over the four ranks that hold the parameters, all-to-all attention); and
a Hugging Face `LlamaForCausalLM` built from its config (rotary positions, grouped-query
attention) at cp 2. A job of 2 ranks runs the layouts of 2 and one of 4 those of 4, gradmesh
re-initialised for each (`tests/distributed/test_script_api.py` does the same for tp and pp).
Every parameter, put together from its tp slices and its ep ranks' experts, must equal the one
process's to 1e-9 of its largest value.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn

import gradmesh
from gradmesh.layout.tensor.layers import unshard
from gradmesh.layout.tensor.plan import shard_specs
from gradmesh.models.gpt import GPT, GPTConfig, lm_loss
from gradmesh.runtime.mesh import EXPERT_PLACED
from tests.distributed.test_script_api import distinct_ports
from tests.harness import run_ranks

transformers = pytest.importorskip(
    "transformers", reason="the hf extra (pip install 'gradmesh[hf]') is missing"
)

STEPS, BATCH, VOCAB, SEQ = 20, 8, 64, 16
LAYOUTS = {  # name: (mesh sizes, context attention, ZeRO stage)
    "cp2": ({"cp": 2}, "ring", 0),
    "cp2-a2a": ({"cp": 2}, "alltoall", 0),
    "ep2": ({"ep": 2}, "ring", 0),
    "cp4": ({"cp": 4}, "ring", 0),
    "cp4-a2a": ({"cp": 4}, "alltoall", 0),
    "dp2xcp2": ({"cp": 2}, "ring", 0),
    "dp2xcp2-zero3": ({"cp": 2}, "alltoall", 3),  # FSDP2 over dp x cp
    "tp2xcp2": ({"tp": 2, "cp": 2}, "ring", 0),
    "ep4": ({"ep": 4}, "ring", 0),
    "dp2xep2-zero1": ({"ep": 2}, "ring", 1),  # the optimizer's state over dp, experts apart
    "tp2xep2": ({"tp": 2, "ep": 2}, "ring", 0),  # the experts whole on each tp rank
}
JOBS = {
    "2": [("gpt", "cp2"), ("gpt", "cp2-a2a"), ("moe", "ep2"), ("llama", "cp2")],
    "4": [
        ("gpt", "cp4"),
        ("gpt", "cp4-a2a"),
        ("gpt", "dp2xcp2"),
        ("gpt", "dp2xcp2-zero3"),
        ("gpt", "tp2xcp2"),
        ("moe", "ep4"),
        ("moe", "dp2xep2-zero1"),
        ("moe", "tp2xep2"),
    ],
}


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "llama":  # grouped-query attention: torch's attention called with enable_gqa
        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=SEQ,
        )
        return transformers.LlamaForCausalLM(config).double()
    experts = {"experts": 4, "top_k": 2, "balance": 0.05} if kind == "moe" else {}
    config = GPTConfig(vocab=VOCAB, seq=SEQ, dim=32, depth=2, heads=4, **experts)  # type: ignore[arg-type]
    return GPT(config).double()


def batches() -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.randint(
        0, VOCAB, (STEPS, BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1)
    )
    return data[:, :, :-1], data[:, :, 1:]


def loss_of(out: Any, y: torch.Tensor) -> torch.Tensor:
    """The mean next-token loss of a GPT's logits or a Hugging Face model's output."""
    return lm_loss(getattr(out, "logits", out), y)


def one_process(kind: str) -> dict[str, torch.Tensor]:
    model = build(kind)
    xs, ys = batches()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        opt.zero_grad()
        out = model(xs[step])
        loss = loss_of(out, ys[step])
        (loss + out.aux_loss if kind == "moe" else loss).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def train(kind: str, name: str) -> Any:
    sizes, attention, zero = LAYOUTS[name]
    rt = gradmesh.init(mesh=sizes)
    model = build(kind)
    xs, ys = batches()
    mine = slice(
        rt.batch.index * BATCH // rt.batch.size, (rt.batch.index + 1) * BATCH // rt.batch.size
    )
    layout = gradmesh.LayoutConfig(
        tensor_parallel=sizes.get("tp", 1),
        context_parallel=sizes.get("cp", 1),
        expert_parallel=sizes.get("ep", 1),
        context_attention=attention,
    )
    split = gradmesh.parallelize(model, layout, loss_fn=loss_of, zero_stage=zero)
    specs = shard_specs(model)
    opt = torch.optim.AdamW(split.module.parameters(), lr=1e-2)
    if zero < 2:  # FSDP2 averages its shards' gradients itself
        opt = gradmesh.DistributedOptimizer(
            opt, named_parameters=split.module.named_parameters(), zero_stage=zero
        )
    for step in range(STEPS):
        opt.zero_grad()
        split.step(xs[step, mine], ys[step, mine], 1.0 / len(ys[step, mine]))
        opt.step()
    params = {k: _whole(v) for k, v in split.module.named_parameters()}
    placed = {k for k, v in split.module.named_parameters() if getattr(v, EXPERT_PLACED, False)}
    coords = rt.mesh.shape.coords(rt.rank)
    gradmesh.shutdown()
    return coords, params, specs, placed


def _whole(p: torch.Tensor) -> torch.Tensor:
    """A parameter as a tensor of this rank's (a DTensor shard's whole, gathered)."""
    full = getattr(p, "full_tensor", None)
    return (full() if full is not None else p).detach().clone()


def all_layouts(job: str, ports: list[int]) -> list[Any]:
    gradmesh.shutdown()  # the harness's world, all data-parallel
    results = []
    for (kind, name), port in zip(JOBS[job], ports, strict=True):
        os.environ["MASTER_PORT"] = str(port)
        results.append(train(kind, name))
    return results


def assert_equal(results: list[Any], want: dict[str, torch.Tensor], what: str) -> float:
    """Each parameter from the first replica's first cp rank: its tp slices unsharded, its
    experts concatenated in ep order; within 1e-9 of the one process's largest value."""
    first = [r for r in results if r[0]["dp"] == 0 and r[0]["cp"] == 0]
    worst = 0.0
    for name, whole in want.items():
        by_ep = []
        for ep in sorted({r[0]["ep"] for r in first}):
            group = sorted((r for r in first if r[0]["ep"] == ep), key=lambda r: r[0]["tp"])
            pieces = [r[1][name] for r in group]
            specs = group[0][2]
            by_ep.append(unshard(pieces, *specs[name]) if name in specs else pieces[0])
        got = torch.cat(by_ep) if name in first[0][3] else by_ep[0]
        error = float((got - whole).abs().max() / whole.abs().max())
        assert error <= 1e-9, f"{what} {name}: {error:.2e}"
        worst = max(worst, error)
    return worst


@pytest.mark.parametrize("job", sorted(JOBS))
def test_context_and_expert_parallel_gpt_equals_one_process(job: str) -> None:
    ranks = run_ranks(all_layouts, int(job), job, distinct_ports(len(JOBS[job])), timeout=300.0)
    wants: dict[str, dict[str, torch.Tensor]] = {}
    for i, (kind, name) in enumerate(JOBS[job]):
        if kind not in wants:
            wants[kind] = one_process(kind)
        worst = assert_equal([r[i] for r in ranks], wants[kind], f"{kind} {name}")
        print(f"{kind} {name}: worst error {worst:.1e}")  # shown with -s (docs' figures)
