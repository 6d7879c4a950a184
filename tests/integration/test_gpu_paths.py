"""What the GPU paths can show on a CPU: fp8's layers train (torchao runs them here too),
`--compile` composes with tensor parallelism, sharding and recomputation, and every GPU-only
choice is refused in one line before work starts (scripts/gpu_check.sh runs them on a GPU)."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gradmesh.layout.engine import PlainEngine
from gradmesh.layout.fp8 import eligible, fp8_problem, to_float8
from gradmesh.models.gpt import GPT, GPTConfig
from gradmesh.runtime.process import gpu_share_problem
from tests.integration.test_cli import gradmesh

GPT_TEXT = ["train", "--model", "gpt", "--dataset", "text", "--sequence-length", "256"]
GPT_TEXT += ["--model-args", "dim=32,depth=2,heads=4", "--batch-size", "64", "--epochs", "1"]


def _train(model: torch.nn.Module, data: torch.Tensor, held: torch.Tensor) -> float:
    """The mean token loss on `held` (samples of 33 tokens) after an AdamW step on each batch
    of `data` (steps x samples x 33 tokens), under bf16 autocast."""
    engine = PlainEngine(model, 1, half=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for batch in data:
        opt.zero_grad()
        engine.step(batch[:, :-1], batch[:, 1:], 1.0 / batch.shape[0])
        opt.step()
    logits = engine.predict(held[:, :-1])
    assert logits is not None
    return float(F.cross_entropy(logits.flatten(0, 1), held[:, 1:].flatten()))


def test_fp8_converts_the_blocks_linear_layers_and_trains_as_bf16() -> None:
    """The blocks' linear layers become torchao's Float8Linear (embeddings and the head stay),
    and after 30 steps the loss on held-out sequences is within 1 % of bf16's (issue 57's bar
    on a GPU). The sequences follow a fixed permutation of the 256 tokens from a random first
    one, so there is something to learn in 30 steps (from ln 256 = 5.55 to about 4.8; over
    seeds 0-4 fp8 and bf16 measured 0.06-0.37 % apart). Small (dim 32, 4 samples a step):
    torch multiplies fp8 on the CPU with a reference kernel, some 1,000x slower than bf16's."""
    pytest.importorskip("torchao.float8", reason="the fp8 extra (torchao) is not installed")
    torch.manual_seed(0)
    base = GPT(GPTConfig(vocab=256, seq=32, dim=32, depth=2, heads=4))
    g = torch.Generator().manual_seed(1)
    follows = torch.randperm(256, generator=g)
    tokens = [torch.randint(0, 256, (30 * 4 + 16,), generator=g)]
    for _ in range(32):
        tokens.append(follows[tokens[-1]])
    sequences = torch.stack(tokens, 1)
    data, held = sequences[: 30 * 4].view(30, 4, 33), sequences[30 * 4 :]
    fp8 = copy.deepcopy(base)
    names = to_float8(fp8)
    assert names == sorted(eligible(base)) and len(names) == 8  # qkv, proj, fc1, fc2 a block
    kinds = {type(fp8.get_submodule(n)).__name__ for n in names}
    assert kinds == {"Float8Linear"} and type(fp8.head).__name__ == "Linear"
    bf16, fp8_loss = _train(copy.deepcopy(base), data, held), _train(fp8, data, held)
    assert bf16 < 5.2  # it learned (ln 256 = 5.55 at the start; 4.8 measured)
    assert fp8_loss == pytest.approx(bf16, rel=0.01)


def test_gpu_only_choices_are_one_line_each(cli_line: Callable[..., str]) -> None:
    assert "fp8 with --tensor-parallel" in cli_line(
        [*GPT_TEXT, "--precision", "fp8", "--workers", "2", "--tensor-parallel", "2"]
    )
    assert "fp8 with --pipeline-parallel" in cli_line(
        [*GPT_TEXT, "--precision", "fp8", "--workers", "2", "--pipeline-parallel", "2"]
    )
    if not torch.cuda.is_available():
        assert cli_line([*GPT_TEXT, "--precision", "fp8"]).endswith(fp8_problem() or "")
        assert "needs an NVIDIA GPU" in (fp8_problem() or "")
    assert "--compile with --pipeline-parallel" in cli_line(
        [*GPT_TEXT, "--compile", "--workers", "2", "--pipeline-parallel", "2"]
    )


def test_a_flag_s_mistake_comes_before_the_machine_s_limit(
    cli_line: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a one-GPU host, two ranks are refused, but only once every flag is known good: the
    checks that build the model (a model's argument, context and expert layouts) and a
    benchmark's jobs come first, so a mistake reads as on a CPU. Before, an H200 named its one
    GPU first, and 31 unit tests that pass on a CPU failed there."""
    monkeypatch.setattr("gradmesh.runtime.process.visible_gpus", lambda: 1)
    two = ["--workers", "2", "--max-steps", "1"]
    assert "2 ranks on this host but 1 GPU" in cli_line([*GPT_TEXT, *two])
    tie = cli_line([*GPT_TEXT, *two, "--model-args", "dim=32,depth=2,heads=4,tie=3"])
    assert tie.endswith("model gpt: tie must be true or false, got 3"), tie
    experts = [*two, "--expert-parallel", "2", "--model-args", "dim=32,depth=2,heads=4,experts=3"]
    assert "has 3 experts, which 2 ranks" in cli_line([*GPT_TEXT, *experts])
    assert "--outer-lr must be > 0" in cli_line(["bench", "diloco", "--outer-lr", "0"])
    assert "ranks on this host but 1 GPU" in cli_line(["bench", "diloco"])


def test_more_ranks_than_gpus_is_refused() -> None:
    line = gpu_share_problem(4, 2, "")
    assert line is not None and "4 ranks on this host but 2 GPUs" in line
    assert "--workers 2" in line and "GRADMESH_BACKEND=gloo" in line
    assert gpu_share_problem(2, 2, "") is None  # one GPU each
    assert gpu_share_problem(4, 0, "") is None  # no GPU: the CPU trains
    assert gpu_share_problem(4, 2, "gloo") is None  # asked for the CPU


@pytest.mark.slow
def test_compile_composes_with_tp_zero3_and_recomputation(tmp_path: Path) -> None:
    """tp 2 with ZeRO stage 3 (FSDP2's units and hooks on a data axis of one) and recomputed
    blocks, each block compiled (through aot_eager: the graphs without generated kernels), in
    the recipe's order, takes one uncompiled process's steps. 2 ranks keep the suite's time;
    ZeRO-3 over real replicas is tests/distributed/test_sharded.py's. 8 of the epoch's 24
    steps: the compiled graphs are the same at every step after the first (the losses measured
    bit-equal at 8 steps), and the steps, not the compiling, were most of the test's time.
    At a world of one without recomputation the whole model is compiled instead (nothing sits
    at the blocks' seams there), and takes the same steps."""
    flags = [*GPT_TEXT, "--optimizer", "adamw", "--lr", "0.003", "--max-steps", "8"]
    split = ["--workers", "2", "--tensor-parallel", "2", "--zero-stage", "3", "--compile"]
    split += ["--activation-checkpointing", "blocks"]
    runs = {}
    whole = ["--workers", "1", "--compile"]
    for name, extra in (("one", ["--workers", "1"]), ("compiled", split), ("whole", whole)):
        path = tmp_path / f"{name}.json"
        env = {"GRADMESH_COMPILE_BACKEND": "aot_eager"}
        out = gradmesh(*flags, *extra, "--json", str(path), env=env, timeout=300)
        assert out.returncode == 0, out.stderr
        runs[name] = json.loads(path.read_text())
    assert runs["compiled"]["layout"]["compiled"] == "2 blocks"
    assert runs["whole"]["layout"]["compiled"] == "the whole model"
    assert "compiled" not in runs["one"]["layout"]
    for name in ("compiled", "whole"):
        assert runs[name]["loss_history"] == pytest.approx(runs["one"]["loss_history"], rel=1e-4)
