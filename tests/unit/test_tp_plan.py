"""Tensor-parallel plans by module name: wildcards, styles, and the one-line refusals that come
before any rank starts work."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradmesh.errors import GradmeshError
from gradmesh.layout.tensor.layers import shard, unshard
from gradmesh.layout.tensor.plan import check_plan, parse_style, resolve
from gradmesh.models.gpt import GPT, GPTConfig
from gradmesh.models.small import ResidualCNN


def gpt(**kw: int) -> GPT:
    return GPT(GPTConfig(**{"vocab": 64, "seq": 8, "dim": 32, "depth": 3, "heads": 4, **kw}))


def test_wildcards_match_one_segment_in_model_order() -> None:
    styles = resolve(gpt(), {"blocks.*.mlp.fc1": "colwise", "tok": "embedding"}, "gpt")
    assert list(styles) == ["tok", "blocks.0.mlp.fc1", "blocks.1.mlp.fc1", "blocks.2.mlp.fc1"]
    assert resolve(gpt(), {"blocks.1*.attn": "heads(heads)"}, "gpt") == {
        "blocks.1.attn": parse_style("heads(heads)", "")
    }


def test_styles_parse() -> None:
    assert parse_style("colwise(8,2,2)", "").chunks == (8, 2, 2)
    assert parse_style("colwise_rep", "").gather  # Hugging Face's name
    assert parse_style("heads(n_head, n_embd)", "").attrs == ("n_head", "n_embd")
    assert parse_style("rowwise", "").dim == 1
    assert parse_style("rowwise(seq)", "").mode == "seq"
    assert parse_style("sequence(gather)", "").mode == "gather"
    assert parse_style("sequence", "").mode == ""


@pytest.mark.parametrize("chunks", [(), (1, 1, 1), (4, 2, 2)])
def test_shard_then_unshard_is_the_whole(chunks: tuple[int, ...]) -> None:
    whole = torch.arange(48 * 3, dtype=torch.float32).reshape(48, 3)
    pieces = [shard(whole, 0, 2, i, chunks) for i in range(2)]
    assert all(p.shape == (24, 3) for p in pieces)
    assert torch.equal(unshard(pieces, 0, chunks), whole)
    if chunks == (1, 1, 1):  # rank 0 holds the first half of q, of k and of v
        assert pieces[0][:8].equal(whole[:8]) and pieces[0][8:16].equal(whole[16:24])


@pytest.mark.parametrize(
    ("model", "plan", "tp", "message"),
    [
        (
            gpt(),
            {"blocks.*.atn.qkv": "colwise"},
            2,
            "model gpt: its plan names no module 'blocks.*.atn.qkv' (nearest: blocks.*.attn.qkv",
        ),
        (
            gpt(),
            {"blocks.*.mlp.fc1": "diagonal"},
            2,
            "plan entry 'blocks.*.mlp.fc1': unknown style 'diagonal'",
        ),
        (
            gpt(dim=36, heads=6),
            {"blocks.*.mlp.fc1": "colwise"},
            5,
            "--tensor-parallel 5 does not divide the 144 output features of layer "
            "blocks.0.mlp.fc1 of model gpt (colwise); tensor-parallel sizes that fit: 1, 2, 3, 4",
        ),
        (
            gpt(heads=4, kv_heads=2),
            {"blocks.*.attn": "heads(heads,kv_heads)"},
            4,
            "--tensor-parallel 4 does not divide kv_heads=2 of layer blocks.0.attn of model gpt",
        ),
        (
            gpt(),
            {"blocks.0.ln1": "colwise"},
            2,
            "layer blocks.0.ln1 of model gpt is a LayerNorm; colwise splits Linear and",
        ),
        (
            gpt(),
            {"tok": "embedding"},
            2,
            "modules tok and head share one weight but the plan splits it differently",
        ),
        (
            gpt(),
            {"blocks.*.attn": "heads(n_head)"},
            2,
            "layer blocks.0.attn of model gpt has no integer attribute 'n_head'",
        ),
        (
            gpt(),
            {"blocks.*": "sequence", "blocks.*.mlp.fc1": "colwise"},
            2,
            "blocks.0 is sequence() but holds the split layer blocks.0.mlp.fc1",
        ),
        (gpt(), {"norm": "sequence(all)"}, 2, "style 'sequence(all)' takes no such arguments"),
        (
            ResidualCNN(1, 10, width=6),
            {"blocks.*.conv1": "colwise"},
            8,
            "--tensor-parallel 8 does not divide the 12 output channels of layer blocks.0.conv1",
        ),
    ],
)
def test_bad_plans_are_one_line(
    model: nn.Module, plan: dict[str, str], tp: int, message: str
) -> None:
    name = "gpt" if isinstance(model, GPT) else "residual"
    with pytest.raises(GradmeshError) as err:
        check_plan(model, plan, tp, name)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_the_models_declared_plans_fit() -> None:
    for model, tp in ((gpt(), 2), (gpt(), 4), (gpt(kv_heads=2), 2), (ResidualCNN(), 2)):
        styles = check_plan(model, model.tp_plan, tp, type(model).__name__)
        assert styles
    assert check_plan(gpt(), gpt().sp_plan, 2, "gpt")["blocks.0"].mode == "scatter"


def test_a_hugging_face_model_s_embedding_is_split_as_transformers_5_24_declares() -> None:
    """transformers 5.24 declares Llama's input embedding split by vocabulary, 5.17 did not:
    the same model and tp were a different split (and the simulator's torchtitan rows other
    figures) on a machine with the older release. The wrapper declares it as 5.24 does: where
    a plan is declared, and not on an embedding whose own forward a split would lose."""
    pytest.importorskip("transformers")
    from gradmesh.models.registry import MODELS

    args = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4}
    with torch.device("meta"):
        model = MODELS.get("hf:llama")((8,), 64, **args, intermediate_size=64)
    declared = dict(model.net._tp_plan)
    assert model.tp_plan["net.model.embed_tokens"] == "embedding_rowwise"
    declared.pop("model.embed_tokens", None)  # as an older transformers declares it
    model.net._tp_plan = declared
    assert model.tp_plan["net.model.embed_tokens"] == "embedding_rowwise"
    styles = check_plan(model, model.tp_plan, 2, "hf:llama")
    assert styles["net.model.embed_tokens"].kind == "embedding"
    model.net._tp_plan = {}  # no plan declared (gpt2's kind): none made up
    model.net.config.base_model_tp_plan = {}
    assert model.tp_plan == {}

    class Scaled(nn.Embedding):  # Gemma's kind: its forward multiplies the rows
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return super().forward(ids) * 2.0

    model.net._tp_plan = {**declared, "model.embed_tokens": "embedding_rowwise"}
    model.net.model.embed_tokens = Scaled(64, 32, device="meta")
    assert "net.model.embed_tokens" not in model.tp_plan  # kept whole: still the same function
    with pytest.raises(GradmeshError, match="is a Scaled; the embedding style splits a dense"):
        check_plan(model, {"net.model.embed_tokens": "embedding"}, 2, "hf:llama")
