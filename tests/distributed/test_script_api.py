"""The script API on the models and losses users write, against one plain-PyTorch process.

Two models written or built here, as a user's script would: a GPT whose attention reads
`self.qkv.out_features` (so a split layer must still look like the `nn.Linear` it replaced), and
a `transformers.LlamaForCausalLM` straight from its config (its cache on, as by default; it
returns a `ModelOutput`). Each trains 8 AdamW steps in float64 with a mean loss written as a
user writes it (`F.cross_entropy`, the Llama's read from `out.logits`, or its own `labels` path)
under tp 2, pp 2 (1F1B and interleaved) on 2 ranks and tp 2 x pp 2 on 4, each job
re-initialising gradmesh per layout: tp 2 and pp 2 through `gradmesh.parallelize(model)`
(the tensor step) and `gradmesh.pipeline_stage`, the other two through the whole recipe,
`gradmesh.parallelize(model, LayoutConfig(...))` on a mesh given as `init(mesh={...})`. Every
parameter, put together from its tp slices, must equal the one process's to 1e-9.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradmesh
from gradmesh.errors import GradmeshError
from gradmesh.launch.ports import free_port
from gradmesh.layout.tensor.layers import unshard
from gradmesh.layout.tensor.plan import shard_specs
from tests.harness import run_ranks

transformers = pytest.importorskip(
    "transformers", reason="the hf extra (pip install 'gradmesh[hf]') is missing"
)

STEPS, BATCH, VOCAB, SEQ = 8, 8, 64, 16
"""8 steps, as `test_zero_bubble`'s: a wrong gradient (a split, a schedule or a loss scale gone
wrong) moves AdamW's first updates already, far beyond 1e-9; 20 cost the suite about 10 s more."""
LAYOUTS = {  # name: (tp, pp, schedule, through the whole recipe: gradmesh.parallelize(layout))
    "tp2": (2, 1, "1f1b", False),
    "pp2": (1, 2, "1f1b", False),
    "pp2-interleaved": (1, 2, "interleaved", True),
    "tp2xpp2": (2, 2, "1f1b", True),
}


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        width = self.qkv.out_features // 3  # what a user's attention reads: this rank's width
        q, k, v = (
            z.view(b, t, -1, self.head_dim).transpose(1, 2)
            for z in self.qkv(x).split(width, dim=-1)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, width))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class UserGPT(nn.Module):
    tp_plan = {
        "blocks.*.attn.qkv": "colwise(1,1,1)",
        "blocks.*.attn.proj": "rowwise",
        "blocks.*.mlp.0": "colwise",
        "blocks.*.mlp.2": "rowwise",
    }

    def __init__(self, dim: int = 32, heads: int = 4, depth: int = 4) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, dim), nn.Embedding(SEQ, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def gpt_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def llama_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())


def labels_loss(out: Any, _y: Any) -> torch.Tensor:
    return out.loss  # the model's own labels path (shifted inside, the batch's mean)


def build(kind: str) -> tuple[nn.Module, list[str], Any]:
    """The model (float64, seed 0), its split points for 4 stages, its loss."""
    torch.manual_seed(0)
    if kind == "gpt":
        return UserGPT().double(), ["blocks.1", "blocks.2", "blocks.3"], gpt_loss
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
    )
    model = transformers.LlamaForCausalLM(config).double()
    points = ["model.layers.1", "model.layers.2", "model.layers.3"]
    return model, points, labels_loss if kind == "llama-labels" else llama_loss


def batches(kind: str) -> tuple[Any, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, VOCAB, (STEPS, BATCH, SEQ + 1), generator=g)
    if kind == "llama-labels":  # the model shifts its labels itself
        x = {"input_ids": data[:, :, :-1], "labels": data[:, :, :-1]}
        return x, data[:, :, 1:]
    return data[:, :, :-1], data[:, :, 1:]


def rows(x: Any, step: int, part: slice) -> Any:
    if isinstance(x, dict):
        return {k: v[step, part] for k, v in x.items()}
    return x[step, part]


def call(model: nn.Module, x: Any) -> Any:
    return model(**x) if isinstance(x, dict) else model(x)


def one_process(kind: str) -> dict[str, torch.Tensor]:
    model, _, loss_fn = build(kind)
    xs, ys = batches(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        opt.zero_grad()
        loss_fn(call(model, rows(xs, step, slice(None))), ys[step]).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def train(kind: str, tp: int, pp: int, schedule: str, recipe: bool) -> Any:
    """STEPS steps of this rank's part under (tp, pp, schedule), from a script's calls: the
    tensor step then `pipeline_stage`, or the whole recipe from a layout."""
    if recipe:
        rt = gradmesh.init(mesh={"tp": tp, "pp": pp})
    else:
        rt = gradmesh.init(tensor_parallel=tp, pipeline_parallel=pp)
    coords = rt.mesh.shape.coords(rt.rank)
    dp = rt.mesh.shape.dp
    model, points, loss_fn = build(kind)
    xs, ys = batches(kind)
    mine = slice(coords["dp"] * BATCH // dp, (coords["dp"] + 1) * BATCH // dp)
    virtual = 2 if schedule == "interleaved" else 1
    split = points if virtual == 2 else points[1:2]
    step_fn, passes = None, 1
    if recipe:
        layout = gradmesh.LayoutConfig(
            tensor_parallel=tp,
            pipeline_parallel=pp,
            microbatches=4,
            schedule=schedule,
            stages=",".join(split),
        )
        part = gradmesh.parallelize(model, layout, example=rows(xs, 0, mine), loss_fn=loss_fn)
        specs = shard_specs(model)  # split in place: the whole model's modules, sliced
        model, step_fn, passes = part.module, part.step, part.backward_passes
    else:
        model = gradmesh.parallelize(model)  # by the plan it declares (tp 1: left whole)
        specs = shard_specs(model)
        if pp > 1:
            stage = gradmesh.pipeline_stage(
                model, rows(xs, 0, mine), split, 4, schedule, loss_fn, virtual_stages=virtual
            )
            model, step_fn, passes = stage.stage_module, stage.step, stage.backward_passes
    opt = gradmesh.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        named_parameters=model.named_parameters(),
        backward_passes_per_step=passes,
    )
    for step in range(STEPS):
        x, y = rows(xs, step, mine), ys[step, mine]
        opt.zero_grad()
        if step_fn is not None:
            step_fn(x, y, 1.0 / len(y))
        else:
            loss_fn(call(model, x), y).backward()
        opt.step()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    gradmesh.shutdown()
    return coords, params, specs


JOBS = {  # a job of 2 ranks for the layouts of 2, one of 4 for tp 2 x pp 2: (model, layout)
    "2": [
        *[(kind, name) for kind in ("gpt", "llama") for name in ("tp2", "pp2", "pp2-interleaved")],
        ("llama-labels", "pp2"),
    ],
    "4": [("gpt", "tp2xpp2"), ("llama", "tp2xpp2")],
}


def all_layouts(job: str, ports: list[int]) -> list[Any]:
    """Every (model, layout) of `job` in turn in this one job, gradmesh re-initialised for
    each on a rendezvous port of its own: `shutdown` waits for no peer, so a rank that
    re-initialises first would otherwise join rank 0's old store before rank 0 closes it."""
    gradmesh.shutdown()  # the harness's world, all data-parallel
    results = []
    for (kind, name), port in zip(JOBS[job], ports, strict=True):
        os.environ["MASTER_PORT"] = str(port)
        results.append(train(kind, *LAYOUTS[name]))
    return results


def distinct_ports(n: int) -> list[int]:
    """`n` different free ports (each drawn below the ephemeral range, see `free_port`)."""
    ports: set[int] = set()
    while len(ports) < n:
        ports.add(free_port())
    return sorted(ports)


def assert_equal(results: list[Any], want: dict[str, torch.Tensor], what: str) -> None:
    """Each parameter, put together from the first replica's tp ranks of its stage, within
    1e-9 of the one process's."""
    first = [r for r in results if r[0]["dp"] == 0]
    seen = set()
    for stage in {r[0]["pp"] for r in first}:
        group = sorted((r for r in first if r[0]["pp"] == stage), key=lambda r: r[0]["tp"])
        specs = group[0][2]
        for name, whole in want.items():
            if name not in group[0][1]:
                continue
            seen.add(name)
            pieces = [r[1][name] for r in group]
            got = unshard(pieces, *specs[name]) if name in specs else pieces[0]
            error = float((got - whole).abs().max() / whole.abs().max())
            assert error <= 1e-9, f"{what} stage {stage} {name}: {error:.2e}"
    assert seen == set(want), f"{what}: parameters missing {set(want) - seen}"
    if group[0][0]["tp"] != group[-1][0]["tp"]:
        assert specs, f"{what}: nothing was split"


@pytest.mark.parametrize("job", sorted(JOBS))
def test_a_users_model_and_mean_loss_equal_one_process_in_every_layout(job: str) -> None:
    ranks = run_ranks(all_layouts, int(job), job, distinct_ports(len(JOBS[job])), timeout=300.0)
    wants: dict[str, dict[str, torch.Tensor]] = {}
    for i, (kind, name) in enumerate(JOBS[job]):
        if kind not in wants:
            wants[kind] = one_process(kind)
        assert_equal([r[i] for r in ranks], wants[kind], f"{kind} {name}")


def test_a_split_linear_is_still_a_linear_of_this_ranks_widths() -> None:
    from gradmesh.layout.tensor.plan import apply_tp_plan

    model = UserGPT()
    apply_tp_plan(model, UserGPT.tp_plan, 2, 1)
    qkv, proj = model.blocks[0].attn.qkv, model.blocks[0].attn.proj
    assert isinstance(qkv, nn.Linear) and isinstance(proj, nn.Linear)
    assert (qkv.in_features, qkv.out_features) == (32, 48)  # half of q, k and v each
    assert (proj.in_features, proj.out_features) == (16, 32)
    assert tuple(qkv.weight.shape) == (48, 32) and tuple(qkv.bias.shape) == (48,)
    with pytest.raises(GradmeshError, match=r"blocks.0.attn.qkv of model model is split already"):
        apply_tp_plan(model, UserGPT.tp_plan, 2, 1)


@pytest.mark.parametrize(
    ("loss", "message"),
    [
        (
            lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="none"),
            r"loss .* returned shape \(16,\), not a scalar: return the batch's mean",
        ),
        (lambda out, y: 0.5, r"loss .* returned float, not a scalar"),
    ],
)
def test_a_loss_that_is_not_the_batch_mean_is_one_line(loss: Any, message: str) -> None:
    from gradmesh.layout.engine import PlainEngine

    model = UserGPT()
    x = torch.randint(0, VOCAB, (2, 8))
    with pytest.raises(GradmeshError, match=message) as err:
        PlainEngine(model, 1, loss).step(x, x, 0.5)
    assert "\n" not in str(err.value)


class Scaled(nn.Linear):
    """A user's Linear subclass with a forward of its own, which a split layer would drop."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


@pytest.mark.parametrize(
    ("layer", "message"),
    [
        (Scaled(8, 8), r"is a Scaled, a subclass of nn.Linear whose own attributes and forward"),
        (
            nn.Conv2d(8, 8, 3, padding=1, padding_mode="reflect"),
            r"pads with padding_mode='reflect', which a split Conv2d does not keep",
        ),
    ],
)
def test_a_plan_on_a_layer_a_split_cannot_keep_is_one_line(layer: nn.Module, message: str) -> None:
    from gradmesh.layout.tensor.plan import check_plan

    model = nn.Sequential(layer)
    with pytest.raises(GradmeshError, match="layer 0 of model m " + message) as err:
        check_plan(model, {"0": "colwise"}, 2, "m")
    assert "\n" not in str(err.value)


class Opaque(nn.Module):
    """A model whose forward returns an object that is not tensors."""

    class Out:
        def __init__(self, x: torch.Tensor) -> None:
            self.x = x

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor) -> Any:
        for block in self.blocks:
            x = block(x)
        return Opaque.Out(x)


def test_a_model_whose_output_cannot_cross_a_stage_is_one_line() -> None:
    from gradmesh.layout.pipeline.graph import GraphStages

    stages = GraphStages(Opaque(), ["blocks.1"], "Opaque", torch.randn(2, 4))
    message = r"cannot cut model Opaque at blocks.1: its forward returns a Out, which a stage "
    with pytest.raises(GradmeshError, match=message) as err:
        stages.stages(torch.randn(2, 4))
    assert "\n" not in str(err.value)


def test_a_layout_the_mesh_does_not_have_is_one_line() -> None:
    from gradmesh.layout.config import LayoutConfig
    from gradmesh.layout.engine import check_run

    asks = r"the layout asks for .*tp 2; the mesh has .*tp 1: init"
    with pytest.raises(GradmeshError, match=asks):
        check_run(LayoutConfig(tensor_parallel=2), {"tp": 1})
    with pytest.raises(GradmeshError, match=r"--precision fp8 with --tensor-parallel"):
        check_run(LayoutConfig(tensor_parallel=2, precision="fp8"), {"tp": 2})
