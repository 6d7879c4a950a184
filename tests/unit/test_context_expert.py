"""Context and expert parallelism without processes: the chunks each cp rank holds, the ring's
schedule of block pairs, the mixture of experts' routing, the planner's prices of both axes,
and the refusals (one line each, before any rank starts)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from gradmesh.errors import GradmeshError
from gradmesh.layout.config import Layout, LayoutConfig, check_context_layout, check_expert_layout
from gradmesh.layout.context.chunks import check_length, positions, restore, take
from gradmesh.layout.context.ring import _pairs, ring_attention
from gradmesh.models.gpt import GPT, GPTConfig
from gradmesh.models.moe import MoE, _balance
from gradmesh.planner import MeshProfile, layouts, predict_mesh
from gradmesh.planner.axes_cost import Experts, Sequences, context_bytes, context_fits
from tests.unit.test_mesh_planner import LINKS, _profile

CPU = torch.device("cpu")


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_each_rank_holds_an_early_and_a_late_chunk_and_they_make_the_sequence(cp: int) -> None:
    x = torch.arange(2 * 24).view(2, 24)
    parts = [take(x, cp, i) for i in range(cp)]
    assert torch.equal(restore(parts), x)
    c = 24 // (2 * cp)
    assert positions(24, cp, 0, CPU).tolist() == [*range(c), *range(24 - c, 24)]
    assert sorted(torch.cat([positions(24, cp, i, CPU) for i in range(cp)]).tolist()) == list(
        range(24)
    )


def test_the_ring_computes_every_causal_block_once_and_each_rank_alike() -> None:
    for cp in range(1, 9):
        seen, work = [], []
        for rank in range(cp):
            mine = [(rank - s) % cp for s in range(cp)]
            pairs = [(rank, src, p) for src in mine for p in _pairs(cp, rank, src)]
            work.append(sum(0.5 if causal else 1.0 for *_, (_, _, causal) in pairs))
            ids = {0: rank, 1: 2 * cp - 1 - rank}
            for _, src, (a, b, causal) in pairs:
                q, k = ids[a], (src, 2 * cp - 1 - src)[b]
                assert (k == q) == causal and k <= q
                seen.append((q, k))
        wanted = [(q, k) for q in range(2 * cp) for k in range(q + 1)]
        assert sorted(seen) == wanted  # every causal pair of chunks once
        assert len(set(work)) == 1  # balanced: the same work on every rank


class _OneRank:
    """A ring of one rank (nothing to exchange): the attention's own arithmetic."""

    size, index, next, prev = 1, 0, 0, 0

    def channel(self, what: str) -> None:
        return None

    def start(self, ch: object, send: object) -> None:
        raise AssertionError("one rank exchanges nothing")

    def finish(self, ch: object, works: object) -> None: ...

    def count(self, ch: object) -> None: ...


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 0.1)])
def test_the_ring_in_low_precision_keeps_its_output_in_the_inputs_dtype(
    dtype: torch.dtype, tol: float
) -> None:
    """Output and gradients equal torch's causal attention's in the inputs' dtype (the output
    kept for backward as fused attention keeps it, its arithmetic in fp32)."""
    torch.manual_seed(0)
    qkv = [torch.randn(1, 2, 16, 8, dtype=dtype, requires_grad=True) for _ in range(3)]
    out = ring_attention(*qkv, 8**-0.5, _OneRank())  # type: ignore[arg-type]
    out.float().square().sum().backward()
    got = [t.grad for t in qkv]
    for t in qkv:
        t.grad = None
    want = torch.nn.functional.scaled_dot_product_attention(*qkv, is_causal=True)
    want.float().square().sum().backward()
    assert out.dtype == dtype
    torch.testing.assert_close(out, want, atol=tol, rtol=tol)
    for g, t in zip(got, qkv, strict=True):
        torch.testing.assert_close(g, t.grad, atol=tol, rtol=tol)


def test_a_sequence_the_chunks_do_not_divide_is_one_line() -> None:
    with pytest.raises(
        GradmeshError,
        match=r"sequence of 30 tokens cannot be cut into 2 x "
        r"--context-parallel 4 = 8 equal chunks \(.*: 1, 3, 5, 15\)",
    ):
        check_length(30, 4)


def test_dropless_routing_sends_each_token_to_its_top_k_experts() -> None:
    torch.manual_seed(0)
    moe = MoE(8, 16, 4, 2).double()
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    y = moe(x)
    probs = torch.softmax(moe.router(x), -1)
    top, chosen = probs.topk(2, -1)
    want = torch.zeros_like(x)
    for b, t, j in itertools.product(range(3), range(5), range(2)):
        e = int(chosen[b, t, j])
        h = torch.nn.functional.gelu(x[b, t] @ moe.w1[e] + moe.b1[e]) @ moe.w2[e] + moe.b2[e]
        want[b, t] += top[b, t, j] / top[b, t].sum() * h
    assert torch.allclose(y, want, atol=1e-12)
    assert int(moe.counts.sum()) == 3 * 5 * 2
    # the balance loss is a mean over sequences: a batch's is the mean of its halves'
    whole = _balance(probs, chosen)
    halves = (_balance(probs[:1], chosen[:1]) + 2 * _balance(probs[1:], chosen[1:])) / 3
    assert torch.allclose(whole, halves)


def test_capacity_drops_the_slots_past_it() -> None:
    torch.manual_seed(0)
    moe = MoE(8, 16, 4, 1, capacity=0.5)
    moe(torch.randn(2, 16, 8))
    assert moe.dropped > 0  # 32 slots, 4 experts, at most 4 each


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"experts": 4, "top_k": 5}, r"a mixture of 4 experts cannot route each token to top_k 5"),
        ({"experts": 4, "capacity": -1.0}, r"capacity -1.0: give 0 \(dropless\) or a factor > 0"),
    ],
)
def test_bad_routing_is_one_line(args: dict[str, object], message: str) -> None:
    with pytest.raises(GradmeshError, match=message):
        GPT(GPTConfig(**args))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("layout", "pp", "zero", "message"),
    [
        ({"context_parallel": 2}, 2, 0, r"--context-parallel 2 with --pipeline-parallel"),
        (
            {"context_parallel": 2, "tensor_parallel": 2, "sequence_parallel": True},
            1,
            0,
            r"--context-parallel 2 with --sequence-parallel",
        ),
        ({"context_parallel": 2, "expert_parallel": 2}, 1, 0, r"not composed yet"),
        ({"expert_parallel": 2}, 2, 0, r"--expert-parallel 2 with --pipeline-parallel"),
        ({"expert_parallel": 2}, 1, 3, r"--expert-parallel 2 with --zero-stage 3"),
        ({"context_parallel": 0}, 1, 0, r"must be >= 1, got 0 and 1"),
    ],
)
def test_what_the_axes_do_not_compose_with_is_one_line(
    layout: dict[str, object], pp: int, zero: int, message: str
) -> None:
    config = LayoutConfig(**layout)  # type: ignore[arg-type]
    with pytest.raises(GradmeshError, match=message) as err:
        check_context_layout(config, pp, zero)
        check_expert_layout(config, pp, zero)
    assert "\n" not in str(err.value)


def _with_axes() -> MeshProfile:
    prof = _profile()
    # 4 attention calls of a 64-token sequence, 4 heads; 2 mixtures of 4 experts holding
    # 40 kB of parameters and half the blocks' FLOPs, loaded 10, 10, 10 and 30 slots
    prof.sequences = Sequences(4, 2 * 64 * 32 * 4, 64 * 32 * 4, 2.0 * 64 * 64 * 32, 4, 64)
    prof.experts = Experts(2, 4, 64 * 2 * 32 * 4, 40_000, 5.0, [10.0, 10.0, 10.0, 30.0])
    return prof


def test_the_planner_prices_both_axes() -> None:
    names = {lay.name for lay in layouts(4, 32, 4, [1, 2], [1, 2, 4], [1, 2])}
    assert {"dp2xcp2", "dp2xcp2a2a", "dp1xcp4", "dp2xep2", "dp1xtp2xcp2"} <= names
    prof = _with_axes()
    dp = predict_mesh(prof, Layout(2, 1, 1), LINKS)
    cp = predict_mesh(prof, Layout(2, 1, 1, cp=2), LINKS)
    a2a = predict_mesh(prof, Layout(2, 1, 1, cp=2, attention="alltoall"), LINKS)
    # the same samples a rank, half of each sequence's tokens: half the compute, and the
    # exchanges on top; the activations halve too
    assert cp.compute_s == pytest.approx(dp.compute_s / 2)
    assert cp.context_s > 0 and a2a.context_s > 0 and dp.context_s == 0
    assert cp.step_s == pytest.approx(
        cp.compute_s + cp.tensor_parallel_s + cp.sync_s + cp.update_s + cp.context_s
    )
    assert cp.memory is None  # (the made-up profile measured no activations)
    # bytes a step: the ring sends (3 cp - 2) K a call (K: its chunks' keys and values)
    b = Layout(2, 1, 1, cp=2).micro(32)
    k = 2 * 64 * 32 * 4 * b / 2
    assert context_bytes(prof.sequences, Layout(2, 1, 1, cp=2), b) == 4 * 4 * k
    # experts: 1/ep of their parameters; the busiest rank's load (40 of a mean 30) on their
    # half of the compute
    ep = predict_mesh(prof, Layout(2, 1, 1, ep=2), LINKS)
    plain = predict_mesh(prof, Layout(4, 1, 1), LINKS)
    assert ep.expert_s > 0 and plain.expert_s == 0
    assert ep.param_bytes_per_rank == plain.param_bytes_per_rank - 20_000
    assert ep.compute_s == pytest.approx(plain.compute_s * (1 + 0.5 * (40 / 30 - 1)))
    # what the axes cannot split is not searched
    assert not context_fits(prof.sequences, Layout(1, 1, 1, cp=3))  # 64 tokens, 6 chunks
    assert not context_fits(prof.sequences, Layout(1, 1, 1, cp=8, attention="alltoall"))
    assert context_fits(prof.sequences, Layout(1, 1, 1, cp=8))


HANDMADE = '''
import torch
from torch import nn


class Handmade(nn.Module):
    """A model whose attention is written out by hand (scores, a causal mask, softmax)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(256, 16), nn.Embedding(64, 16)
        self.qkv, self.head = nn.Linear(16, 48), nn.Linear(16, 256)

    def forward(self, ids, positions=None):
        t = ids.shape[1]
        where = torch.arange(t, device=ids.device) if positions is None else positions
        x = self.tok(ids) + self.pos(where)
        q, k, v = self.qkv(x).split(16, -1)
        mask = torch.ones(t, t, dtype=torch.bool, device=ids.device).triu(1)
        return self.head(torch.softmax((q @ k.transpose(1, 2)).masked_fill(mask, -1e9), -1) @ v)


def build():
    return Handmade()
'''


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--workers", "3", "--context-parallel", "3"],
            "--context-parallel: model gpt: sequence of 64 tokens cannot be cut into 2 x "
            "--context-parallel 3 = 6 equal chunks",
        ),
        (
            ["--model", "handmade:build", "--workers", "2", "--context-parallel", "2"],
            "model handmade:build never calls torch's scaled_dot_product_attention",
        ),
        (
            ["--workers", "2", "--expert-parallel", "2", "--model-args", "experts=3"],
            "--expert-parallel 2: gpt's mixture blocks.0.mlp has 3 experts, which 2 ranks "
            "cannot hold equally",
        ),
        (
            ["--workers", "2", "--pipeline-parallel", "2", "--model-args", "experts=4"],
            "--pipeline-parallel 2: model gpt has mixtures of experts, whose routing depends",
        ),
        (
            ["--model-args", "experts=4,top_k=5"],
            "a mixture of 4 experts cannot route each token to top_k 5 of them",
        ),
        (
            ["--workers", "4", "--context-parallel", "2", "--pipeline-parallel", "2"],
            "--context-parallel 2 with --pipeline-parallel: a pipeline's stages",
        ),
        (
            ["--workers", "2", "--context-parallel", "2", "--context-attention", "alltoall"]
            + ["--model-args", "heads=3,dim=48"],
            "--context-attention alltoall: model gpt has 3 attention heads, which "
            "--context-parallel 2 does not divide",
        ),
    ],
)
def test_bad_context_or_expert_input_is_one_line_before_any_rank_starts(
    args: list[str],
    message: str,
    cli_line: Callable[..., str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    (tmp_path / "handmade.py").write_text(HANDMADE)
    monkeypatch.syspath_prepend(str(tmp_path))
    line = cli_line(["train", "--model", "gpt", "--dataset", "text", *args])
    assert message in line


def test_the_rings_tiles_give_torchs_attention_and_its_gradients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a ring of one (this process), tiles of 3 query rows (a block is several tiles, the
    diagonal block's masked at an offset) against torch's own attention, in float64."""
    import gradmesh
    import gradmesh.layout.context.ring as ring
    from gradmesh.layout.context.parallel import TORCH_ATTENTION

    monkeypatch.setattr(ring, "TILE", 3 * 8)  # 3 rows of a chunk of 8 keys
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 16, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    rt = gradmesh.init()  # a world of one, left as the other tests expect it
    try:
        mine = ring.ring_attention(q, k, v, 0.5, ring.Ring(rt.mesh["cp"]))
        grad = torch.randn_like(mine)
        ours = torch.autograd.grad(mine, (q, k, v), grad)
    finally:
        gradmesh.shutdown()
    theirs = TORCH_ATTENTION(q, k, v, is_causal=True, scale=0.5)
    want = torch.autograd.grad(theirs, (q, k, v), grad)
    assert torch.allclose(mine, theirs, atol=1e-12)
    assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(ours, want, strict=True))


def test_the_simulator_searches_context_and_expert_parallelism() -> None:
    """On the meta device (an even load on the experts): a GPT's search holds cp layouts of
    both forms, a mixture's ep layouts and no pipeline, each priced with its exchanges."""
    from gradmesh.simulate.devices import DEVICES
    from gradmesh.simulate.fabrics import FABRICS, fabric_terms
    from gradmesh.simulate.mesh import meta_profile, search
    from gradmesh.simulate.meta_count import Spec

    h100 = DEVICES.get("h100").at("bf16")
    intra = fabric_terms(FABRICS.get("nvswitch-h100"))
    inter = fabric_terms(FABRICS.get("infiniband-hdr"), 8)
    gpt = Spec("gpt", {"dim": 128, "depth": 4, "heads": 4}, 1024, 1000, "bf16")
    priced = search(meta_profile(gpt, 8, 8, [1, 2], h100), intra, inter, 8, 1024)
    names = {p.prediction.layout.name for p in priced}
    assert {"dp4xcp2", "dp4xcp2a2a", "dp1xcp8"} <= names
    ring = next(p for p in priced if p.prediction.layout.name == "dp1xcp8")
    assert ring.prediction.context_s > 0
    moe = Spec("gpt", {"dim": 128, "depth": 4, "heads": 4, "experts": 8}, 256, 1000, "bf16")
    meta = meta_profile(moe, 8, 8, [1], h100)
    assert meta.profile.experts is not None and meta.profile.experts.imbalance(4) == 1.0
    laid = [p.prediction.layout for p in search(meta, intra, inter, 8, 256)]
    assert any(lay.ep == 8 for lay in laid) and all(lay.pp == 1 for lay in laid)
