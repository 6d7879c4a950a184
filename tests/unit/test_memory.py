"""Activation checkpointing on one process: the same gradients, fewer bytes held in a step."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from gradmesh.errors import GradmeshError
from gradmesh.layout.memory import checkpoint_blocks, peak_bytes, saved_activations
from gradmesh.models.gpt import GPT, GPTConfig


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab=64, seq=32, dim=32, depth=4, heads=4))


def grads_and_peak(spec: str) -> tuple[dict[str, torch.Tensor], int, list[str]]:
    model = gpt()
    chosen = checkpoint_blocks(model, spec, "gpt") if spec else []
    x = torch.randint(0, 64, (8, 32), generator=torch.Generator().manual_seed(1))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)

    def step() -> None:
        out = model(x)
        F.cross_entropy(out.flatten(0, 1), x.flatten()).backward()

    peak = peak_bytes(step)
    return {n: p.grad.clone() for n, p in model.named_parameters()}, peak, chosen


def test_recomputed_blocks_give_the_same_gradients_for_less_memory() -> None:
    want, kept, _ = grads_and_peak("")
    half, half_peak, every_other = grads_and_peak("every:2")
    none, least, every = grads_and_peak("blocks")
    selective, selective_peak, attention = grads_and_peak("attention")
    assert every == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert every_other == ["blocks.0", "blocks.2"]
    assert attention == [f"blocks.{i}.attn" for i in range(4)]
    for grads in (half, none, selective):
        assert sorted(grads) == sorted(want)  # the names are the model's own
        for name, g in grads.items():
            torch.testing.assert_close(g, want[name], rtol=0, atol=0)  # recomputed exactly
    # measured on this model: every block 0.37x, every other 0.60x, attention only 0.79x of the
    # bytes kept without
    assert least < 0.45 * kept
    assert least < half_peak < 0.8 * kept
    assert half_peak < selective_peak < 0.9 * kept


def test_recomputation_per_operation_is_exact_and_priced_as_it_saves() -> None:
    """`ops` (torchtitan's per-operation policy): the same gradients bit for bit, fewer bytes
    than none and more than whole blocks; and the measured peak's saving is what
    `saved_activations` says each policy no longer keeps (the memory model's counts), less at
    most one block's recomputed tensors (live while that block's backward runs)."""
    want, kept, _ = grads_and_peak("")
    ops, ops_peak, every = grads_and_peak("ops")
    _, blocks_peak, _ = grads_and_peak("blocks")
    _, attention_peak, _ = grads_and_peak("attention")
    assert every == [f"blocks.{i}" for i in range(4)]
    for name, g in ops.items():
        torch.testing.assert_close(g, want[name], rtol=0, atol=0)
    assert blocks_peak < ops_peak < 0.85 * kept
    model = gpt()
    x = torch.randint(0, 64, (8, 32), generator=torch.Generator().manual_seed(1))
    counted = saved_activations(
        model, lambda: F.cross_entropy(model(x).flatten(0, 1), x.flatten()), x, peak=False
    )
    for mode, peak in (("ops", ops_peak), ("attention", attention_peak)):
        table, redone = counted.recomputed(mode)
        saving = sum(counted.blocks.values()) - sum(table.values())
        rebuilt = max(counted.blocks[n] - table[n] + counted.inputs[n] for n in table)
        assert saving - rebuilt <= kept - peak <= saving, mode
        assert 0 < sum(redone.values()) < sum(counted.block_flops.values())


def test_selective_recomputation_finds_a_hugging_face_model_s_attention() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(
        "llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config)
    chosen = checkpoint_blocks(model, "attention", "hf:llama")
    assert chosen == ["model.layers.0.self_attn", "model.layers.1.self_attn"]


def test_checkpointing_keeps_names_and_survives_a_copy() -> None:
    import copy

    model = gpt()
    names = [n for n, _ in model.named_parameters()]
    checkpoint_blocks(model, "blocks", "gpt")
    twin = copy.deepcopy(model)
    assert [n for n, _ in twin.named_parameters()] == names
    assert getattr(twin.blocks[0], "recomputed", False)  # the copy recomputes its own block
    x = torch.randint(0, 64, (2, 32))
    torch.testing.assert_close(twin(x), model(x))


@pytest.mark.parametrize(
    ("spec", "model", "message"),
    [
        ("every:0", gpt, "expected blocks (every block), every:K (every K-th block), ops"),
        ("some", gpt, "expected blocks (every block), every:K"),
        ("blocks", lambda: torch.nn.Linear(2, 2), "has no list of blocks to recompute"),
        (
            "attention",
            lambda: torch.nn.Sequential(*(torch.nn.Linear(2, 2) for _ in range(3))),
            "block 0 of model m has no attention module",
        ),
    ],
)
def test_bad_checkpointing_is_one_line(spec: str, model: object, message: str) -> None:
    with pytest.raises(GradmeshError, match=re.escape(message)) as err:
        checkpoint_blocks(model(), spec, "m")  # type: ignore[operator]
    assert "\n" not in str(err.value)


def test_bf16_runs_the_forward_in_bf16_and_keeps_weights_and_gradients_fp32() -> None:
    from gradmesh.layout.engine import PlainEngine
    from gradmesh.models.gpt import lm_loss

    model = gpt()
    seen: list[torch.dtype] = []
    model.blocks[0].mlp.fc1.register_forward_hook(lambda _m, _a, out: seen.append(out.dtype))
    x = torch.randint(0, 64, (8, 33), generator=torch.Generator().manual_seed(1))
    engine = PlainEngine(model, 1, lm_loss, half=torch.bfloat16)
    loss = engine.step(x[:, :-1], x[:, 1:], 1.0 / 8)
    assert seen == [torch.bfloat16]
    assert all(
        p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters()
    )
    assert loss.dtype == torch.float64 and torch.isfinite(loss)
    # the same step in fp32 gives nearly the same loss: bf16 keeps 8 bits of mantissa
    plain = gpt()
    want = PlainEngine(plain, 1, lm_loss).step(x[:, :-1], x[:, 1:], 1.0 / 8)
    assert float(loss) == pytest.approx(float(want), rel=0.02)
    assert engine.predict(x[:, :-1]).dtype == torch.float32
