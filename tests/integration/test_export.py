"""`gradmesh export` of gradmesh's own GPT to its safetensors layout, and the one-line refusals
of pretrained directories and exports that cannot be (issue 61)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.integration.test_faults import train

GPT = ["--model", "gpt", "--dataset", "text", "--model-args", "dim=16,depth=1,heads=2"]


def test_a_gpt_checkpoint_exports_to_safetensors_and_builds_again(
    tmp_path: Path, cli_line: Callable[..., str], cli: Callable[[list[str]], int]
) -> None:
    from safetensors.torch import load_file

    from gradmesh.data.registry import DataOptions
    from gradmesh.data.text import make_text
    from gradmesh.models.registry import build_model
    from gradmesh.registry import parse_kwargs
    from gradmesh.train.checkpoint import load_whole

    ck = tmp_path / "ck"
    done = train(*GPT, "--workers", "2", "--tensor-parallel", "2", "--max-steps", "3",
                 "--sequence-length", "32", "--checkpoint-dir", str(ck),
                 "--json", str(tmp_path / "a.json"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    refused = cli_line(["export", str(ck), "--to", str(tmp_path / "hf"), "--format", "hf"])
    assert "holds model gpt, not a Hugging Face one" in refused
    assert not (tmp_path / "hf").exists()
    refused = cli_line(["export", str(ck), "--to", str(tmp_path / "hf"), "--max-shard-size", "1MB"])
    assert refused.endswith(
        "--max-shard-size: not read by --format safetensors, which writes one file (hf's shards)"
    )
    assert not (tmp_path / "hf").exists()  # once ignored: a folder written without shards
    assert cli(["export", str(ck), "--to", str(tmp_path / "out")]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["gradmesh_model"] == "gpt" and config["sequence_length"] == 32
    spec = make_text(DataOptions(sequence=config["sequence_length"]))
    rebuilt = build_model("gpt", spec, parse_kwargs(config["model_args"], "--model-args"))
    tensors = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert "head.weight" not in tensors  # tied to the embedding: stored once
    missing, _ = rebuilt.load_state_dict(tensors, strict=False)
    assert missing == ["head.weight"]
    whole = build_model("gpt", spec, parse_kwargs(config["model_args"], "--model-args"))
    load_whole(ck, whole)
    x = spec.test.x[:2]
    assert torch.equal(rebuilt(x), whole(x))
    again = cli_line(["export", str(ck), "--to", str(tmp_path / "out")])
    assert "exists and is not an empty folder: nothing is overwritten" in again
    _a_run_starts_from_the_export(tmp_path, cli_line)


def _a_run_starts_from_the_export(tmp_path: Path, cli_line: Callable[..., str]) -> None:
    """`--init-from` the export, in another layout (one worker, not tp 2), at a learning rate
    that moves nothing: the test loss is the exported run's to the last bit; another model's
    arguments and a checkpoint directory are one line each."""
    out, same = str(tmp_path / "out"), ["--sequence-length", "32", "--max-steps", "2"]
    done = train(*GPT, *same, "--workers", "1", "--optimizer", "adamw", "--lr", "1e-30",
                 "--init-from", out, "--json", str(tmp_path / "b.json"),
                 "--tensorboard", str(tmp_path / "tb"))  # fmt: skip
    # (TensorBoard's test accuracy is scored on a model built again: a skeleton, filled)
    assert done.returncode == 0, done.stderr
    scored = [json.loads((tmp_path / f).read_text())["test_loss"] for f in ("a.json", "b.json")]
    assert scored[1] == pytest.approx(scored[0], rel=1e-6)  # another layout: another sum order
    assert scored[0] < 5.45  # trained 3 steps (5.32): a fresh model scores about ln 256 = 5.55
    other = [*GPT[:-1], "dim=32,depth=1,heads=2"]
    said = cli_line(["train", *other, *same, "--init-from", out])
    assert "its weights are model gpt with arguments 'dim=16,depth=1,heads=2'" in said
    said = cli_line(["train", *GPT, *same, "--init-from", str(tmp_path / "ck")])
    assert "that is a checkpoint directory; `gradmesh export" in said


def test_pretrained_weights_that_do_not_match_the_config_are_one_line(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers", reason="the hf extra is missing")
    from gradmesh.errors import GradmeshError
    from gradmesh.models.registry import MODELS
    from gradmesh.train.pretrained import read_pretrained

    transformers.utils.logging.disable_progress_bar()
    shape = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
             "num_attention_heads": 2, "num_key_value_heads": 2}  # fmt: skip
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape)).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    skeleton = MODELS.get(f"hf:{tmp_path}")((8,), 64)
    with pytest.raises(GradmeshError) as caught:
        read_pretrained(skeleton, str(tmp_path), "cpu", (1, 0))
    said = str(caught.value)
    assert "mlp.gate_proj.weight does not match the model" in said and "\n" not in said
    with pytest.raises(GradmeshError, match="--model-args hidden_size cannot change a pretrained"):
        MODELS.get(f"hf:{tmp_path}")((8,), 64, hidden_size=8)
    with pytest.raises(GradmeshError, match="no such directory"):
        MODELS.get(f"hf:{tmp_path}/nothing")((8,), 64)
