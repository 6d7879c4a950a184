"""The simulator on transformers: the mesh planner's formulas on a profile counted on the meta
device, memory a GPU against the device, and the layout search."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

import gradmesh.simulate.mesh as mesh
from gradmesh.planner.mesh import Layout
from gradmesh.simulate.devices import DEVICES
from gradmesh.simulate.fabrics import FABRICS, fabric_terms
from gradmesh.simulate.mesh import meta_profile, price
from gradmesh.simulate.meta_count import Spec
from tests.harness import CLI

A100 = DEVICES.get("a100").at("bf16")
INTRA = fabric_terms(FABRICS.get("nvswitch-a100"))
INTER = fabric_terms(FABRICS.get("infiniband-hdr"), 8)
SMALL = Spec("gpt", {"dim": 128, "depth": 6, "heads": 4}, 256, 1000, "bf16")


LLAMA = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
HF = Spec("hf:llama", {**LLAMA, "intermediate_size": 128, "num_hidden_layers": 5}, 64, 500, "bf16")


@pytest.mark.parametrize("spec", [SMALL, HF], ids=["gpt", "hf-llama"])
def test_a_deep_model_counted_from_two_depths_is_the_whole_count(
    spec: Spec, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Alike blocks extrapolated from two and three (gradmesh's GPT, and a Hugging Face Llama,
    which runs on the meta device given its mask): every count the planner reads (the kernels
    by kind, the tp exchanges, what each block saves and receives, the parameters, the blocks'
    FLOPs and outputs) equals the count of the whole model."""
    if spec is HF:
        pytest.importorskip("transformers")
    extrapolated = meta_profile(spec, 8, 16, [1, 2], A100)
    monkeypatch.setattr(mesh, "deep", lambda _spec: 0)
    whole = meta_profile(spec, 8, 16, [1, 2], A100)
    for tp in (1, 2):
        a, b = extrapolated.counted[tp], whole.counted[tp]
        totals: dict[str, list[float]] = {}
        for kind, f, n in b.kernels:
            t = totals.setdefault(kind, [0.0, 0.0])
            t[0], t[1] = t[0] + f, t[1] + n
        assert {k: pytest.approx(v) for k, v in totals.items()} == {
            k: [f, n] for k, f, n in a.kernels
        }
        assert sorted(a.exchanges) == sorted(b.exchanges)
        assert a.saved.peak == pytest.approx(b.saved.peak, rel=0.02)  # extrapolated, not summed
        assert a.calls == pytest.approx(b.calls)
        assert (replace(a.saved, peak=0), a.block_param_bytes, a.rest_param_bytes) == (
            replace(b.saved, peak=0),
            b.block_param_bytes,
            b.rest_param_bytes,
        )
        assert (a.parameters, a.flops) == pytest.approx((b.parameters, b.flops))
    assert extrapolated.profile.blocks == pytest.approx(whole.profile.blocks)
    assert extrapolated.profile.boundary_bytes == whole.profile.boundary_bytes


def test_tensor_parallel_exchanges_are_counted_on_the_meta_device() -> None:
    """Each block's attention and MLP sum their row-parallel outputs in forward and their
    column-parallel inputs' gradients in backward: 4 allreduces of a block's activations (one
    sample: 256 tokens x 128 features in bf16), plus the embedding's and the head's."""
    meta = meta_profile(SMALL, 8, 16, [2], A100)
    made = meta.counted[2].exchanges
    activation = 256 * 128 * 2
    assert sum(1 for n, kind in made if n == activation and kind == "allreduce") >= 4 * 6
    assert meta.profile.slices[2].exchanges[3] == [(3 * n, k) for n, k in made]


def test_mixed_precision_state_is_megatrons_and_fsdps_bytes_a_parameter() -> None:
    """bf16 parameters, fp32 gradients, AdamW's fp32 copy and two moments: 2 + 4 + 12 bytes a
    parameter on one GPU, Megatron's distributed optimizer's 6 + 12 / d with ZeRO-1, FSDP2's
    (4 + 4 + 8) / d with ZeRO-3; checkpointing keeps far less."""
    meta = meta_profile(SMALL, 8, 16, [1], A100)
    one = price(meta, Layout(1, 1, 1, 16), INTRA, INTER, 8, 256).prediction.memory
    assert one is not None
    params = meta.parameters
    assert one.param_bytes + one.grad_bytes + one.optimizer_bytes == pytest.approx(18 * params)
    zero1 = price(meta, Layout(8, 1, 1, 2, None, 1, 1), INTRA, INTER, 8, 256).prediction.memory
    assert zero1 is not None and zero1.state_bytes == pytest.approx((6 + 12 / 8) * params)
    sharded = price(meta, Layout(8, 1, 1, 2, None, 1, 3), INTRA, INTER, 8, 256).prediction.memory
    assert sharded is not None and sharded.state_bytes == pytest.approx(2 * params)
    kept = price(meta, Layout(8, 1, 1, 2, None, 1, 0, True), INTRA, INTER, 8, 256)
    full = price(meta, Layout(8, 1, 1, 2), INTRA, INTER, 8, 256)
    assert kept.prediction.memory.activation_bytes < full.prediction.memory.activation_bytes / 2  # type: ignore[union-attr]


def test_search_lays_out_gpt3_on_1024_a100s_within_their_memory(tmp_path: Path, cli: CLI) -> None:
    """A 175-billion-parameter GPT on 1,024 A100 80 GB GPUs, 8 a node on NVSwitch, 8 HDR
    InfiniBand ports a node: the fastest layout fits 80 GiB less 2 of context, keeps tensor
    parallelism within a node and uses every GPU; the alternatives follow slowest last."""
    out = tmp_path / "search.json"
    args = ["simulate", "--model", "gpt", "--model-args", "dim=12288,depth=96,heads=96"]
    args += ["--gpus", "1024", "--sequence-length", "2048", "--device", "a100"]
    args += ["--intra-fabric", "nvswitch-a100"]
    args += ["--inter-fabric", "infiniband-hdr", "--nics-per-node", "8", "--search"]
    args += ["--optimizer", "adamw"]
    args += ["--global-batch", "1536", "--json", str(out)]
    assert cli(args) == 0
    payload = json.loads(out.read_text())
    assert payload["parameters"] == pytest.approx(175e9, rel=0.01)
    rows = payload["rows"]
    best = rows[0]
    assert best["fits"] and best["memory"]["total_bytes"] <= (80 - 2) * 2**30  # less context
    assert best["tp"] <= 8 and best["dp"] * best["tp"] * best["pp"] == 1024
    assert 0.2 < best["mfu"] < 0.8
    steps = [r["step_s"] for r in rows]
    assert steps == sorted(steps) and len(rows) == 5


def test_context_gather_holds_every_rank_s_keys_and_values(tmp_path: Path, cli: CLI) -> None:
    """--context-gather prices ring attention as torchtitan ran it: the same layout and step,
    and every rank's keys and values held at once."""
    rows = {}
    for flags in ([], ["--context-gather"]):
        out = tmp_path / f"cp{len(flags)}.json"
        args = [*GPT, "--gpus", "8", "--context-parallel", "4", "--sequence-length", "256"]
        assert cli([*args, "--global-batch", "8", "--json", str(out), *flags]) == 0
        (rows[bool(flags)],) = json.loads(out.read_text())["rows"]
    ring, gathered = rows[False], rows[True]
    assert (ring["name"], gathered["name"]) == ("dp2xcp4", "dp2xcp4ag")
    assert gathered["step_s"] == ring["step_s"]
    # K, one call's keys and values at b = 4 samples a rank, 64 dims in fp16, 64 of 256
    # tokens: the gathered ring's (4 + 1) K and 3 fp32 gradient buffers (3 x 2 K) against the
    # passing ring's 2 K and 2 (2 x 2 K)
    extra = gathered["memory"]["activation_bytes"] - ring["memory"]["activation_bytes"]
    assert extra == pytest.approx(5 * 2 * 4 * 64 * 64 * 2)


def test_a_layout_that_does_not_fit_is_marked_not_priced(
    tmp_path: Path, cli: CLI, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "fixed.json"
    args = ["simulate", "--model", "gpt", "--model-args", "dim=12288,depth=96,heads=96"]
    args += ["--gpus", "8,1024", "--sequence-length", "2048", "--device", "a100"]
    args += ["--tensor-parallel", "8"]
    args += ["--zero-stage", "3", "--microbatches", "8", "--global-batch", "1024"]
    args += ["--activation-checkpointing", "blocks", "--json", str(out)]
    assert cli(args) == 0
    small, large = json.loads(out.read_text())["rows"]
    assert not small["fits"] and small["step_s"] is None  # one replica: nothing to shard over
    assert small["memory"]["param_bytes"] > 40 * 2**30  # 349 GB of bf16 weights over 8 GPUs
    assert large["fits"] and large["step_s"] > 0
    assert "does not fit" in capsys.readouterr().out


GPT = ["simulate", "--model", "gpt", "--model-args", "dim=64,depth=2,heads=4", "--gpus", "16"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--inter-fabric", "token-ring"], "unknown fabric 'token-ring' (valid: "),
        (["--tensor-parallel", "3"], "16 GPUs do not divide into --tensor-parallel 3"),
        (["--search"], "--search needs --global-batch (samples a step)"),
        (["--device", "cpu"], "--device cpu measures an image model on this machine"),
        (["--strategy", "ps"], "a token model is priced on the mesh"),
        (
            ["--pipeline-parallel", "2", "--zero-stage", "3"],
            "--zero-stage 3 does not run with --pipeline-parallel in gradmesh (stage 1 does)",
        ),
        (
            ["--global-batch", "12", "--microbatches", "2"],
            "a batch of 12 samples does not divide into dp 16 x --microbatches 2 at 16 GPUs",
        ),
        (["--dtype", "fp8"], "fp8 needs a device with fp8 tensor cores and a fitted fp8 fraction"),
        (["--compile"], "--compile: no fitted fusion fraction for v100"),
        (["--expert-parallel", "2"], "--expert-parallel 2: model gpt has no mixture of experts"),
        (
            ["--pipeline-parallel", "4", "--microbatches", "2", "--global-batch", "64"],
            "a pipeline of 4 stages: model gpt has 2 blocks to cut into stages",
        ),
        (
            ["--model-args", "dim=64,depth=2,heads=4,experts=4,top_k=2"]
            + ["--pipeline-parallel", "2", "--microbatches", "2", "--global-batch", "64"],
            "--pipeline-parallel 2: model gpt has mixtures of experts, whose routing depends",
        ),
        (
            ["--model-args", "dim=64,depth=2,heads=4,experts=4,top_k=2", "--expert-parallel", "8"],
            "gpt's mixture of every block has 4 experts, which 8 ranks cannot hold equally",
        ),
        (
            ["--context-parallel", "2", "--pipeline-parallel", "2"],
            "--context-parallel 2 with --pipeline-parallel: a pipeline's stages are graphs",
        ),
        (["--loss-parallel"], "--loss-parallel splits the logits over the tensor-parallel ranks"),
        (["--context-gather"], "--context-gather prices ring attention's keys and values all"),
        (  # the trainer's refusals of a context-parallel layout, not a price
            ["--context-parallel", "4", "--sequence-length", "100"],
            "sequence of 100 tokens cannot be cut into 2 x --context-parallel 4 = 8 equal chunks",
        ),
        (
            ["--context-parallel", "8", "--context-attention", "alltoall"],
            "model gpt has 4 attention heads, which --context-parallel 8 does not divide",
        ),
        (
            ["--context-gather", "--context-parallel", "2", "--context-attention", "alltoall"],
            "it needs --context-parallel 2 or more and --context-attention ring",
        ),
        (
            ["--context-gather", "--search", "--global-batch", "16"],
            "--context-gather: --search looks for layouts gradmesh runs",
        ),
        (
            ["--activation-checkpointing", "every:2"],
            "--activation-checkpointing every:2: the simulator prices blocks, ops and attention",
        ),
    ],
)
def test_bad_transformer_input_is_one_line(
    flags: list[str], message: str, cli_line: Callable[..., str]
) -> None:
    assert message in cli_line([*GPT, "--device", "v100", *flags])


def test_a_model_that_reads_values_on_the_meta_device_is_one_line(
    cli_line: Callable[..., str],
) -> None:
    model = "tests.integration.scripts.user_code:value_reader"
    line = cli_line(["simulate", "--model", model, "--gpus", "8", "--device", "a100"])
    assert f"model {model} reads tensor values in its forward" in line


def test_a_hugging_face_model_is_priced_with_its_own_parameter_count(
    cli: CLI, tmp_path: Path
) -> None:
    """`hf:llama` on the meta device (once refused: its mask code reads values): the simulator
    prices it at tp 1 and 2 and counts the parameters the real model has."""
    transformers = pytest.importorskip("transformers")
    args = {**LLAMA, "intermediate_size": 128, "num_hidden_layers": 4}
    config = transformers.AutoConfig.for_model(
        "llama", vocab_size=500, max_position_embeddings=64, **args
    )
    real = transformers.AutoModelForCausalLM.from_config(config)
    flags = ",".join(f"{k}={v}" for k, v in args.items())
    reports = []
    for tp in (1, 2):
        out = tmp_path / f"tp{tp}.json"
        assert cli(["simulate", "--model", "hf:llama", "--model-args", flags, "--vocab", "500",
                    "--sequence-length", "64", "--gpus", "8", "--device", "a100",
                    "--tensor-parallel", str(tp), "--json", str(out)]) == 0  # fmt: skip
        reports.append(json.loads(out.read_text()))
    assert reports[0]["parameters"] == sum(p.numel() for p in real.parameters())
    (row,) = reports[1]["rows"]
    assert row["tp"] == 2 and row["fits"]
    assert row["tensor_parallel_s"] > 0 and row["step_s"] > row["compute_s"] > 0


def test_a_model_no_layout_fits_says_the_smallest_need(cli_line: Callable[..., str]) -> None:
    args = ["simulate", "--model", "gpt", "--model-args", "dim=25600,depth=128,heads=160"]
    args += ["--sequence-length", "2048", "--device", "a100", "--search", "--global-batch", "8"]
    line = cli_line([*args, "--gpus", "8"])
    want = "no layout of 8 GPUs fits the device's 80 GiB less 2 GiB of context: the smallest, "
    assert want in line
    assert "GiB a GPU, most of it" in line


@pytest.mark.parametrize(
    ("command", "model", "args", "want"),
    [
        ("simulate", "gpt", "dim=x", "model gpt: dim must be an integer, got 'x'"),
        ("train", "gpt", "tie=3", "model gpt: tie must be true or false, got 3"),
        ("train", "mlp", "width=x", "model mlp: width must be an integer, got 'x'"),
        ("simulate", "hf:llama", "hidden_size=x", "model hf:llama: Validation error for field"),
        ("simulate", "hf:nosuchkind", "", "model hf:nosuchkind: not a model type transformers"),
    ],
)
def test_a_model_argument_of_the_wrong_kind_is_one_line_naming_it(
    cli_line: Callable[..., str], command: str, model: str, args: str, want: str
) -> None:
    """Once a `dim=x` failed deep in the model ("not all arguments converted during string
    formatting"), and an unknown Hugging Face type printed every type transformers knows."""
    if model.startswith("hf:"):
        pytest.importorskip("transformers")
    data = ["--dataset", "digits" if model == "mlp" else "text"] if command == "train" else []
    line = cli_line([command, "--model", model, "--model-args", args, *data])
    assert want in line and len(line) < 300
