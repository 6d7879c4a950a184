"""A pretrained Hugging Face model in, a Hugging Face model directory out (issue 61).

A tiny Llama (grouped-query attention, its head tied to its embedding) saved by
`save_pretrained` in sharded safetensors is read by the trainer (`--model hf:DIR`) into each
rank's part at dp 2, tp 2, pp 2 and ZeRO-3 (FSDP2's shards), and a GPT-NeoX (one fused q/k/v
projection, its head renamed in its files) at tp 2; each is trained 20 AdamW steps on a token
file through the trainer's own loop (with checkpoints), exported by `gradmesh export`, and loaded
back by `AutoModelForCausalLM.from_pretrained`: before training the layout's logits are the original
model's, after it the reloaded model's are the layout's, each to 1e-5."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.harness import run_ranks
from tests.zygote import gradmesh

transformers = pytest.importorskip("transformers", reason="the hf extra is missing")

VOCAB, SEQ, STEPS = 96, 16, 20
LLAMA = {
    "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32,
}  # fmt: skip
NEOX = {  # one fused query_key_value projection; its head is `embed_out` in the files
    "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "max_position_embeddings": 32,
}  # fmt: skip
LAYOUTS = {
    "llama-dp2": {},
    "llama-tp2": {"tensor_parallel": 2},
    "llama-pp2": {"pipeline_parallel": 2},
    "llama-zero3": {"zero_stage": 3},
    "neox-tp2": {"tensor_parallel": 2},
}


def probe() -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The saved models (the Llama's head tied: stored once) and a token file for them."""
    from gradmesh.data.tokens import write_tokens

    root = tmp_path_factory.mktemp("pretrained")
    transformers.utils.logging.disable_progress_bar()  # no tqdm monitor thread left behind
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**LLAMA, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(root / "llama", max_shard_size="40KB")  # shards, and their index
    assert len(list((root / "llama").glob("model-*.safetensors"))) > 1
    transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**NEOX)).save_pretrained(
        root / "neox"
    )
    tokens = np.random.default_rng(0).integers(0, VOCAB, size=40_000)
    return root, write_tokens(root / "tokens.bin", tokens)


def train_and_probe(directory: str, tokens: str, checkpoints: str, layout: dict[str, int]) -> Any:
    """On each rank: the trainer's setup reads the weights into this rank's part; the layout's
    logits on the probe before and after 20 steps of the trainer's loop (None where this
    rank does not hold them)."""
    import gradmesh
    from gradmesh.train.config import TrainConfig
    from gradmesh.train.loop import loop
    from gradmesh.train.resume import resume
    from gradmesh.train.setup import attach, setup

    flags = {
        "model": f"hf:{directory}", "dataset": f"tokens:{tokens}", "sequence_length": SEQ,
        "batch_size": 8, "max_steps": STEPS, "optimizer": "adamw", "lr": 3e-3, "workers": 2,
        "checkpoint_dir": checkpoints, **layout,
    }  # fmt: skip
    config = TrainConfig.from_mapping(flags, "test")
    job = setup(config, gradmesh.get_runtime())
    attach(job)
    resume(job)
    before = job.split.engine.predict(probe())
    loop(job)
    after = job.split.engine.predict(probe())
    return before, after


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_pretrained_in_trained_exported_reloaded(
    name: str, pretrained: tuple[Path, Path], tmp_path: Path
) -> None:
    root, tokens = pretrained
    directory, layout = root / name.partition("-")[0], LAYOUTS[name]
    mesh = {"tp": layout.get("tensor_parallel", 1), "pp": layout.get("pipeline_parallel", 1)}
    (tmp_path / "ck").mkdir()  # as `gradmesh train` makes it before launch
    results = run_ranks(
        train_and_probe, 2, str(directory), str(tokens), str(tmp_path / "ck"), layout,
        timeout=120, init={"mesh": mesh},
    )  # fmt: skip
    before, after = next(r for r in results if r[0] is not None)
    original = transformers.AutoModelForCausalLM.from_pretrained(directory)
    with torch.no_grad():
        expected = original(input_ids=probe()).logits
    assert torch.allclose(before, expected, rtol=0, atol=1e-5), (before - expected).abs().max()
    assert (after - before).abs().max() > 1e-2  # it trained
    out = tmp_path / "exported"
    done = gradmesh("export", str(tmp_path / "ck"), "--to", str(out))
    assert done.returncode == 0, done.stderr
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        logits = reloaded(input_ids=probe()).logits
    assert torch.allclose(logits, after, rtol=0, atol=1e-5), (logits - after).abs().max()
