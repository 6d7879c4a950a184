"""Tensor and pipeline parallelism on models that are not a sequence of layers: a GPT with a
fused q/k/v projection and an output head tied to its embedding (also with grouped-query
attention and a vocabulary-parallel loss), and a residual CNN. Each is trained 20 AdamW steps
on real gloo ranks through `gradmesh.parallelize` and `graph_pipeline` and compared with one
process, parameter by parameter, to 1e-9 of the tensor's largest value.

In float64: in float32 the layouts agree to 2e-6-4e-5 (the figure moves with the model's
initialisation), because AdamW turns rounding into a visible step wherever a gradient cancels
to about its eps; float64 shows that the layouts' arithmetic is the one process's."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import gradmesh
from gradmesh.layout.config import LayoutConfig
from gradmesh.layout.loss import cross_entropy
from gradmesh.layout.memory import checkpoint_blocks
from gradmesh.layout.pipeline.stages import graph_pipeline
from gradmesh.layout.tensor.layers import unshard
from gradmesh.layout.tensor.plan import shard_specs
from gradmesh.models.gpt import GPT, GPTConfig, lm_loss
from gradmesh.models.small import ResidualCNN
from gradmesh.sync.sharded.model import state_bytes
from tests.harness import run_ranks

STEPS, BATCH = 20, 8
MHA = {"vocab": 64, "seq": 16, "dim": 32, "depth": 2, "heads": 4}
GQA = {**MHA, "kv_heads": 2}


LLAMA = {
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2,
}  # fmt: skip


def _model(kind: str, args: dict[str, int]) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "llama":  # a Hugging Face Llama through gradmesh's wrapper (its plans)
        from gradmesh.models.registry import MODELS

        return MODELS.get("hf:llama")((MHA["seq"],), MHA["vocab"], **args)
    return GPT(GPTConfig(**args)) if kind == "gpt" else ResidualCNN(1, 10, width=8)


def _batches(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    if kind in ("gpt", "llama"):
        data = torch.randint(0, MHA["vocab"], (STEPS, BATCH, MHA["seq"] + 1), generator=g)
        return data[:, :, :-1], data[:, :, 1:]
    return torch.randn(STEPS, BATCH, 1, 8, 8, generator=g), torch.randint(
        0, 10, (STEPS, BATCH), generator=g
    )


def train(kind: str, args: dict[str, int], vocab_loss: bool, sequence: bool = False) -> Any:
    """20 AdamW steps on this rank's part (with `sequence`, by the model's sequence-parallel
    plan); returns (tp index, dp index, parameters, specs)."""
    rt = gradmesh.get_runtime()
    coords = rt.mesh.shape.coords(rt.rank)
    model = _model(kind, args).double()
    plan = dict(model.sp_plan if sequence else model.tp_plan)
    if vocab_loss:
        plan["head" if kind == "gpt" else "net.lm_head"] = "colwise"  # logits stay split
    model = gradmesh.parallelize(model, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dp = rt.mesh["dp"].size
    if dp > 1:
        opt = gradmesh.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    xs, ys = _batches(kind)
    xs = xs.double() if xs.is_floating_point() else xs
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


@pytest.fixture(scope="module")
def llama_reference() -> dict[str, torch.Tensor]:
    pytest.importorskip("transformers", reason="the hf extra is missing")
    return run_ranks(train, 1, "llama", LLAMA, False)[0][2]  # type: ignore[no-any-return]


CASES = {
    # name: (reference, kind, args, vocab-parallel loss, world, tp, sequence parallel)
    "gpt-tp2": ("mha", "gpt", MHA, False, 2, 2, False),
    "gpt-gqa-tp2-vocab-loss": ("gqa", "gpt", GQA, True, 2, 2, False),
    "gpt-dp2-tp2": ("mha", "gpt", MHA, False, 4, 2, False),
    "residual-cnn-tp2": ("cnn", "cnn", {}, False, 2, 2, False),
    "gpt-tp2-sequence": ("mha", "gpt", MHA, False, 2, 2, True),
    "gpt-gqa-dp2-tp2-sequence-vocab-loss": ("gqa", "gpt", GQA, True, 4, 2, True),
}


def test_a_hugging_face_llama_in_sequence_parallel_equals_one_process(
    llama_reference: dict[str, torch.Tensor],
) -> None:
    """`CausalLM.sp_plan` (built from Hugging Face's plan and the layers' norms): a Llama at
    tp 2 with its sequence split between the norms, and its loss on logits split by vocabulary,
    trains to the one-process weights (the simulator prices this layout's exchanges)."""
    _tensor_parallel_equals_one_process({"llama": llama_reference}, "llama", LLAMA, True, 2, 2)


@pytest.mark.parametrize("case", sorted(CASES))
def test_tensor_parallel_by_name_equals_one_process(
    case: str, references: dict[str, dict[str, torch.Tensor]]
) -> None:
    ref, kind, args, vocab_loss, world, tp, sequence = CASES[case]
    _tensor_parallel_equals_one_process(
        {kind: references[ref]}, kind, args, vocab_loss, world, tp, sequence
    )


def _tensor_parallel_equals_one_process(
    refs: dict[str, dict[str, torch.Tensor]],
    kind: str,
    args: dict[str, int],
    vocab_loss: bool,
    world: int,
    tp: int,
    sequence: bool = True,
) -> None:
    results = run_ranks(
        train, world, kind, args, vocab_loss, sequence, init={"tensor_parallel": tp}
    )
    replica = sorted((r for r in results if r[1] == 0), key=lambda r: r[0])
    specs = replica[0][3]
    assert specs, "nothing was split"
    want = refs[kind]
    assert sorted(replica[0][2]) == sorted(want)  # names kept; the tied weight is one parameter
    for name, whole in want.items():
        pieces = [r[2][name] for r in replica]
        got = unshard(pieces, *specs[name]) if name in specs else pieces[0]
        assert got.shape == whole.shape, name
        error = float((got - whole).abs().max() / whole.abs().max())
        assert error <= 1e-9, f"{name}: {error:.2e} of its largest value"
    for other in results:  # every data-parallel replica ends the same
        same = next(r for r in replica if r[0] == other[0])
        for name, tensor in other[2].items():
            torch.testing.assert_close(tensor, same[2][name], rtol=0, atol=1e-12)


def loss_of(kind: str) -> Any:
    """The batch's mean loss (the engines sum it over the samples; `step` scales to a mean)."""
    return lm_loss if kind == "gpt" else cross_entropy


def train_pipeline(
    kind: str,
    args: dict[str, int],
    schedule: str,
    points: list[str],
    recompute: str = "",
    zero: int = 0,
) -> Any:
    """20 AdamW steps in float64 with 4 micro-batches on this rank's stage (one process: the
    whole model; with a tp axis, the model split by its plan first; `zero` 1: the optimizer's
    state sharded over the replicas); returns (pp index, dp index, tp index, parameters by every
    name, aliases included, how each is split, the bytes this rank holds)."""
    rt = gradmesh.get_runtime()
    coords = rt.mesh.shape.coords(rt.rank)
    model = _model(kind, args).double()
    if recompute:
        assert checkpoint_blocks(model, recompute, kind)
    if rt.mesh["tp"].size > 1:
        model = gradmesh.parallelize(model, dict(model.tp_plan))
    split = shard_specs(model)
    by_id = {id(p): split[n] for n, p in model.named_parameters() if n in split}
    specs = {
        n: by_id[id(p)] for n, p in model.named_parameters(remove_duplicate=False) if id(p) in by_id
    }
    xs, ys = _batches(kind)
    xs = xs.double() if xs.is_floating_point() else xs
    dp = rt.mesh["dp"].size
    pp = rt.mesh["pp"].size
    passes = 1
    if pp == 1:
        module, step = model, None
    else:
        layout = LayoutConfig(  # interleaved: 2 stages per rank, 4 in all
            pipeline_parallel=pp, microbatches=4, schedule=schedule, stages=",".join(points)
        )
        engine = graph_pipeline(model, rt, xs[0], layout, loss_of(kind), kind)
        module, step, passes = engine.stage_module, engine.step, engine.backward_passes
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    if dp > 1:  # each micro-batch's backward accumulates into the step's gradient
        opt = gradmesh.DistributedOptimizer(
            opt,
            named_parameters=module.named_parameters(),
            backward_passes_per_step=passes,
            zero_stage=zero,
        )
    for i in range(STEPS):
        x, y = xs[i].chunk(dp)[coords["dp"]], ys[i].chunk(dp)[coords["dp"]]
        opt.zero_grad()
        if step is None:
            loss_of(kind)(module(x), y).backward()
        else:
            step(x, y, 1.0 / len(y))
        opt.step()
    params = module.named_parameters(remove_duplicate=False)
    state = {k: v.detach().clone() for k, v in params}
    held = state_bytes(module, opt)
    return coords["pp"], coords["dp"], coords["tp"], state, specs, held


@pytest.fixture(scope="module")
def references64() -> dict[str, dict[str, torch.Tensor]]:
    return {
        kind: run_ranks(train_pipeline, 1, kind, args, "gpipe", [])[0][3]
        for kind, args in (("gpt", DEEP), ("cnn", {}))
    }


DEEP = {**MHA, "depth": 4}
PIPELINES = {
    # name: (kind, args, schedule, split points, world[, tp])
    "gpt-pp2-gpipe": ("gpt", DEEP, "gpipe", ["blocks.2"], 2),
    "gpt-pp2-1f1b-balanced": ("gpt", DEEP, "1f1b", [], 2),
    "gpt-dp2-pp2": ("gpt", DEEP, "1f1b", ["blocks.1"], 4),
    "residual-cnn-pp2": ("cnn", {}, "1f1b", ["blocks.1"], 2),
    # rank 0 holds stages 0 and 2, rank 1 stages 1 and 3: the tied embedding and head are
    # on different ranks, and every micro-batch crosses between the two ranks three times
    "gpt-pp2-interleaved": ("gpt", DEEP, "interleaved", ["blocks.1", "blocks.2", "blocks.3"], 2),
    "gpt-pp2-interleaved-balanced": ("gpt", DEEP, "interleaved", [], 2),
    "residual-cnn-pp2-interleaved": ("cnn", {}, "interleaved", ["blocks.0", "blocks.1", "fc1"], 2),
    # split by the plan, then cut on the graph: each stage's tp exchanges are operators in its
    # graph; the tied embedding and head are split by vocabulary on both ends
    "gpt-tp2-pp2": ("gpt", DEEP, "1f1b", ["blocks.2"], 4, 2),
    "gpt-tp2-pp2-interleaved": (
        "gpt",
        DEEP,
        "interleaved",
        ["blocks.1", "blocks.2", "blocks.3"],
        4,
        2,
    ),
    "residual-cnn-tp2-pp2": ("cnn", {}, "gpipe", ["blocks.1"], 4, 2),
}


@pytest.mark.parametrize("case", sorted(PIPELINES))
def test_pipeline_cut_on_the_graph_equals_one_process(
    case: str, references64: dict[str, dict[str, torch.Tensor]]
) -> None:
    """Float64, so that the comparison sees the schedule's arithmetic, not float32 rounding that
    AdamW amplifies where a gradient cancels to about its eps (float32 gives 9e-5 on one
    element of blocks.1.mlp.fc1.weight for gpt-pp2-gpipe, and 1e-6 with SGD)."""
    kind, args, schedule, points, world, *tp = PIPELINES[case]
    init = {"pipeline_parallel": 2, "tensor_parallel": tp[0] if tp else 1}
    results = run_ranks(train_pipeline, world, kind, args, schedule, points, init=init)
    assert_equal_to(results, references64[kind], bool(tp))


@pytest.mark.parametrize(
    ("recompute", "init", "points"),
    [
        ("blocks", {"tensor_parallel": 2}, []),
        ("every:2", {"pipeline_parallel": 2}, ["blocks.2"]),
        ("attention", {"pipeline_parallel": 2}, []),
    ],
)
def test_activation_checkpointing_changes_no_step(
    recompute: str,
    init: dict[str, int],
    points: list[str],
    references64: dict[str, dict[str, torch.Tensor]],
) -> None:
    """Blocks (or only their attention) that recompute their activations in backward take the
    same steps, split by a plan or cut on the graph (the export traces through the recomputing
    modules)."""
    results = run_ranks(train_pipeline, 2, "gpt", DEEP, "1f1b", points, recompute, init=init)
    assert_equal_to(results, references64["gpt"], "tensor_parallel" in init)


def test_stage_1_shards_each_pipeline_stage_s_optimizer_state(
    references64: dict[str, dict[str, torch.Tensor]],
) -> None:
    """ZeRO stage 1 in a dp 2 x pp 2 pipeline (`DistributedOptimizer(..., zero_stage=1)` over a
    stage's parameters, the tied embedding and head on both ends): the same steps as one
    process, while the two replicas of a stage each hold a part of its AdamW state, the parts
    adding up to the whole (two moments of every parameter the stage holds)."""
    init = {"pipeline_parallel": 2}
    results = run_ranks(train_pipeline, 4, "gpt", DEEP, "1f1b", ["blocks.1"], "", 1, init=init)
    assert_equal_to(results, references64["gpt"], False)
    for stage in (0, 1):
        held = [r[5] for r in results if r[0] == stage]
        whole = 2 * held[0]["param_bytes"]
        assert sum(h["optimizer_bytes"] for h in held) == whole, held
        assert max(h["optimizer_bytes"] for h in held) <= 0.7 * whole, held


def assert_equal_to(results: list[Any], want: dict[str, torch.Tensor], split: bool) -> None:
    """Each stage's parameters, put together from the first replica's tp ranks, within 1e-9 of
    the one process's; every replica alike."""
    seen: set[str] = set()
    for stage in {r[0] for r in results}:  # the first replica's tp ranks of each stage
        group = sorted((r for r in results if r[0] == stage and r[1] == 0), key=lambda r: r[2])
        specs = group[0][4]
        for name, whole in want.items():
            if name not in group[0][3]:
                continue
            seen.add(name)
            pieces = [r[3][name] for r in group]
            got = unshard(pieces, *specs[name]) if name in specs else pieces[0]
            error = float((got - whole).abs().max() / whole.abs().max())
            assert error <= 1e-9, f"stage {stage} {name}: {error:.2e} of its largest value"
    assert seen == set(want)  # every parameter is on some stage; the tied head on both ends
    if split:
        assert group[0][4], "nothing was split"
    for other in results:  # every data-parallel replica ends the same
        same = next(r for r in results if r[0] == other[0] and r[2] == other[2] and r[1] == 0)
        for name, tensor in other[3].items():
            torch.testing.assert_close(tensor, same[3][name], rtol=0, atol=1e-12)


class Tagger(torch.nn.Module):
    """A model with two inputs, token ids and a mask, whose graph routes values every way a
    cut can: the mask's unsqueezed copy, made in stage 0, is used by every block; the
    embedding, made in stage 0, is used again by the head (so stages in between carry it); the
    mask itself is read again by the last stage from the model's inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))
        self.head = torch.nn.Linear(16, 5)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        e = self.embed(input_ids)
        m = attention_mask.unsqueeze(-1)
        h = e
        for block in self.blocks:
            h = h + torch.tanh(block(h)) * m
        return self.head(h + e) * attention_mask.unsqueeze(-1)


def tagger_loss(out: torch.Tensor, targets: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each sequence's weighted mean over its positions, averaged over the sequences."""
    per_token = F.cross_entropy(out.flatten(0, 1), targets["tags"].flatten(), reduction="none")
    weighted = per_token.view_as(targets["weight"]) * targets["weight"]
    return weighted.mean()


def train_tagger(kind: str, schedule: str) -> Any:
    """20 AdamW steps of the tagger on batches that are a dict (keyword inputs) or a tuple
    (positional), targets a dict; returns (pp index, parameters)."""
    rt = gradmesh.get_runtime()
    torch.manual_seed(0)
    model = Tagger().double()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 32, (STEPS, 8, 6), generator=g)
    masks = (torch.rand(STEPS, 8, 6, generator=g) > 0.2).double()
    tags = torch.randint(0, 5, (STEPS, 8, 6), generator=g)
    weights = torch.rand(STEPS, 8, 6, generator=g, dtype=torch.float64)

    def inputs(i: int) -> Any:
        if kind == "dict":
            return {"input_ids": ids[i], "attention_mask": masks[i]}
        return (ids[i], masks[i])

    step = None
    module: torch.nn.Module = model
    if rt.mesh["pp"].size > 1:
        layout = LayoutConfig(
            pipeline_parallel=rt.mesh["pp"].size, microbatches=4, schedule=schedule
        )
        engine = graph_pipeline(model, rt, inputs(0), layout, tagger_loss, "tagger")
        module, step = engine.stage_module, engine.step
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    for i in range(STEPS):
        targets = {"tags": tags[i], "weight": weights[i]}
        opt.zero_grad()
        if step is None:
            x = inputs(i)
            out = model(**x) if isinstance(x, dict) else model(*x)
            tagger_loss(out, targets).backward()
        else:
            step(inputs(i), targets, 1.0 / 8)
        opt.step()
    return rt.mesh["pp"].index, {k: v.detach().clone() for k, v in module.named_parameters()}


@pytest.mark.parametrize(("kind", "schedule"), [("dict", "1f1b"), ("tuple", "interleaved")])
def test_batches_and_targets_that_are_dicts_or_tuples_cross_a_pipeline(
    kind: str, schedule: str
) -> None:
    ((_, want),) = run_ranks(train_tagger, 1, kind, schedule)
    stages = run_ranks(train_tagger, 2, kind, schedule, init={"pipeline_parallel": 2})
    seen = set()
    for stage, params in stages:
        for name, tensor in params.items():
            seen.add(name)
            error = float((tensor - want[name]).abs().max() / want[name].abs().max())
            assert error <= 1e-9, f"stage {stage} {name}: {error:.2e} of its largest value"
    assert seen == set(want)


HYBRID_RESIDUAL = {"stem": "data", "blocks.*.conv*": "data", "fc1": "colwise", "fc2": "rowwise"}
"""Krizhevsky's placement on a residual CNN: convolutions data-parallel, classifier split."""


def train_hybrid() -> Any:
    """20 steps of SGD with momentum in float64 of the residual CNN under the hybrid plan (one
    process: whole); returns (tp index, dp index, parameters)."""
    from gradmesh.layout.tensor.hybrid import Plan

    rt = gradmesh.get_runtime()
    coords = rt.mesh.shape.coords(rt.rank)
    model = _model("cnn", {}).double()
    if rt.size > 1:
        model = gradmesh.parallelize(model, Plan("residual", 2, HYBRID_RESIDUAL))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if rt.size > 1:
        opt = gradmesh.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    xs, ys = _batches("cnn")
    dp = rt.mesh["dp"].size
    for i in range(STEPS):
        x, y = xs[i].double().chunk(dp)[coords["dp"]], ys[i].chunk(dp)[coords["dp"]]
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return coords["tp"], coords["dp"], {k: v.detach().clone() for k, v in model.named_parameters()}


@pytest.mark.parametrize("world", [2, 4])
def test_a_hybrid_plan_by_module_name_on_a_residual_cnn_equals_one_process(world: int) -> None:
    """The plan names modules of a model that is not a sequence of layers, with wildcards: the
    residual blocks run on each tp rank's half of the batch, the classifier pair is split; at
    tp 2 and dp 2 x tp 2 (float64; in float32 the trainer's run differs by up to 8e-4 of a
    tensor's largest value after 20 steps, rounding that max-pooling's choices amplify)."""
    ((_, _, want),) = run_ranks(train_hybrid, 1)
    results = run_ranks(train_hybrid, world, init={"tensor_parallel": 2})
    replica = sorted((r for r in results if r[1] == 0), key=lambda r: r[0])
    assert replica[0][2]["fc1.weight"].shape[0] * 2 == want["fc1.weight"].shape[0]
    for name, whole in want.items():
        pieces = [r[2][name] for r in replica]
        if name.startswith("fc1"):
            got = torch.cat(pieces, 0)
        elif name == "fc2.weight":
            got = torch.cat(pieces, 1)
        else:
            got = pieces[0]
        error = float((got - whole).abs().max() / whole.abs().max())
        assert error <= 1e-9, f"{name}: {error:.2e} of its largest value"
    for other in results:  # every replica and every tp rank's whole layers alike
        same = next(r for r in replica if r[0] == other[0])
        for name, tensor in other[2].items():
            torch.testing.assert_close(tensor, same[2][name], rtol=0, atol=1e-12)


class MatmulDtypes(TorchDispatchMode):
    """The dtypes the matrix products and convolutions run in (what autocast decides), seen
    below autograd: in exported graph stages too, where module hooks do not fire."""

    PRODUCTS = ("mm", "addmm", "bmm", "convolution")

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[torch.dtype] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in self.PRODUCTS:
            self.seen.add(out.dtype)
        return out


def bf16_steps(pp: int, kind: str) -> tuple[list[float], list[torch.dtype], bool]:
    """3 AdamW steps under --precision bf16, cut into `pp` stages (4 micro-batches) or whole:
    the losses (on the last stage), the dtypes of the steps' matrix products, and whether every
    weight and gradient stayed fp32."""
    from gradmesh.layout.config import LayoutConfig

    model = _model(kind, DEEP if kind == "gpt" else {})
    xs, ys = _batches(kind)
    layout = LayoutConfig(
        pipeline_parallel=pp,
        microbatches=4 if pp > 1 else 1,
        stages="blocks.2" if kind == "gpt" else "",
        precision="bf16",
    )
    split = gradmesh.parallelize(model, layout, example=xs[0], loss_fn=loss_of(kind), name=kind)
    opt = torch.optim.AdamW(split.module.parameters(), lr=1e-2)
    losses = []
    products = MatmulDtypes()
    for i in range(3):
        opt.zero_grad()
        with products:
            losses.append(float(split.engine.step(xs[i], ys[i], 1.0 / len(ys[i]))))
        opt.step()
    fp32 = all(
        p.dtype == torch.float32 and (p.grad is None or p.grad.dtype == torch.float32)
        for p in split.module.parameters()
    )
    return losses, sorted(products.seen, key=str), fp32


@pytest.mark.parametrize("kind", ["gpt", "cnn"])
def test_bf16_runs_through_a_pipeline_as_it_runs_whole(kind: str) -> None:
    """Each stage under bf16 autocast, fp32 across the stage boundaries (and in the weights,
    gradients and optimizer): the losses of a 2-stage pipeline follow one process's bf16 run
    to bf16's rounding (8 bits of mantissa)."""
    whole, seen, fp32 = run_ranks(bf16_steps, 1, 1, kind)[0]
    assert seen == [torch.bfloat16] and fp32
    ranks = run_ranks(bf16_steps, 2, 2, kind, init={"pipeline_parallel": 2})
    for _, seen_stage, fp32_stage in ranks:
        assert seen_stage == [torch.bfloat16] and fp32_stage
    piped = ranks[1][0]  # the last stage computes the loss
    for got, want in zip(piped, whole, strict=True):
        assert got == pytest.approx(want, rel=2e-2)
