"""Tensor and pipeline parallelism through `gradmesh train` and from a user's script."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from gradmesh.plan.mesh import flags as layout_flags
from tests.integration.test_cli import ROOT, gradmesh, merged_trace_spans, one_line_error

ALEXNET = [
    "train",
    "--model",
    "alexnet",
    "--dataset",
    "synthetic",
    "--synthetic-shape",
    "3x32x32",
    "--synthetic-samples",
    "400",
    "--batch-size",
    "32",
    "--epochs",
    "2",
    "--lr",
    "0.02",
    "--workers",
    "2",
]


def report(tmp_path: Path, name: str, *flags: str) -> dict:
    out = gradmesh(*ALEXNET, *flags, "--json", str(tmp_path / f"{name}.json"))
    assert out.returncode == 0, out.stderr
    return json.loads((tmp_path / f"{name}.json").read_text())


def test_split_layouts_train_the_data_parallel_loss_curve(tmp_path: Path) -> None:
    """Pipeline stages, and a hybrid plan file (the convolutions data-parallel over both
    ranks, the first fully connected pair split over tp 2, the last layer replicated; uniform
    tensor parallelism is the same split code, tested in tests/distributed), on 2 ranks (with
    replicas beside them: the distributed tests and the faults' tp 2 x pp 2 job)."""
    plan = tmp_path / "plan.json"
    layers = {"0": "data", "3": "data", "6": "data", "10": "colwise", "12": "rowwise"}
    layers["14"] = "replicate"
    plan.write_text(json.dumps({"model": "alexnet", "tensor_parallel": 2, "layers": layers}))
    dp = report(tmp_path, "dp")
    tp = report(tmp_path, "tp", "--plan", str(plan))
    trace = tmp_path / "pp-trace.json"
    pp = report(
        tmp_path, "pp", "--pipeline-parallel", "2", "--microbatches", "2", "--timeline", str(trace)
    )
    assert tp["layout"]["plan"] == layers
    for split in (tp, pp):
        assert split["loss_history"] == pytest.approx(dp["loss_history"], rel=1e-5)
        assert split["workers"] == 2
    assert (tp["layout"]["dp"], tp["layout"]["tp"], tp["layout"]["pp"]) == (1, 2, 1)
    assert (pp["layout"]["dp"], pp["layout"]["pp"], pp["layout"]["microbatches"]) == (1, 2, 2)
    # tp 2 holds little more than half the weights (the convolutions and last layer stay whole)
    assert 0.5 < tp["layout"]["param_bytes"] / dp["layout"]["param_bytes"] < 0.55
    assert tp["layout"]["tensor_parallel_bytes_per_step"] > 0
    assert pp["layout"]["pipeline_bytes_per_step"] > 0 and 0 < pp["layout"]["bubble"] < 1
    assert dp["layout"]["tensor_parallel_bytes_per_step"] == 0
    # every stage's timeline: forward and backward per microbatch, the optimizer's step
    spans = merged_trace_spans(json.loads(trace.read_text()), {r: f"rank {r}" for r in range(2)})
    steps = pp["steps"]
    for rank, events in spans.items():
        for name in ("forward", "backward"):
            micro = [e["args"]["microbatch"] for e in events if e["name"] == name]
            assert sorted(micro) == sorted([0, 1] * steps), (rank, name)
        assert sum(e["name"] == "step" for e in events) == steps, rank


def example_losses(*flags: str) -> list[float]:
    script = str(ROOT / "examples" / "model_parallel.py")
    out = gradmesh("run", "-np", "4", "--", "python", script, "--steps", "10", *flags)
    assert out.returncode == 0, out.stderr
    return [float(line.split()[-1]) for line in out.stdout.splitlines() if "loss" in line]


def test_users_script_splits_the_model_with_a_few_lines() -> None:
    """The script's tensor and pipeline parallelism together (tensor-parallel pairs in two
    GPipe stages; each alone is covered by `gradmesh train` above) follow data parallelism."""
    dp = example_losses()
    assert len(dp) == 2
    both = ["--tensor-parallel", "2", "--pipeline-parallel", "2"]
    split = example_losses(*both, "--microbatches", "4", "--schedule", "gpipe")
    assert split == pytest.approx(dp, rel=1e-5)


def any_model_losses(np: int, *flags: str) -> list[float]:
    script = str(ROOT / "examples" / "any_model.py")
    out = gradmesh("run", "-np", str(np), "--", "python", script, "--steps", "20", *flags)
    assert out.returncode == 0, out.stderr
    return [float(line.split()[-1]) for line in out.stdout.splitlines() if "loss" in line]


def test_users_own_gpt_is_split_by_its_plan_and_its_graph() -> None:
    """examples/any_model.py under `gradmesh run`: a plain-PyTorch GPT (tied head, fused
    q/k/v) cut at h.2 on its graph takes the steps of one process (every layout of a user's
    GPT, tp 2 x pp 2 included, in float64 from a script: tests/distributed/test_script_api.py
    and test_any_model.py; 2 ranks here keep the suite's time)."""
    one = any_model_losses(1)
    assert len(one) == 2
    piped = any_model_losses(2, "--pipeline-parallel", "2")
    assert piped == pytest.approx(one, rel=1e-4)


USER = "tests.integration.scripts.user_code"


@pytest.mark.parametrize("layout", [[], ["--pipeline-parallel", "2", "--microbatches", "2"]])
def test_train_imports_the_users_model_dataset_and_loss(tmp_path: Path, layout: list[str]) -> None:
    report = tmp_path / "run.json"
    out = gradmesh(
        "train",
        *(f"--model={USER}:model", "--model-args", "hidden=24"),
        *(f"--dataset={USER}:data", f"--loss={USER}:smooth_loss"),
        *("--epochs", "3", "--workers", "2", "--json", str(report), *layout),
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(report.read_text())
    assert result["test_accuracy"] >= 0.9  # 4 separated blobs: 0.99-1.00 measured
    assert result["layout"]["pp"] == (2 if layout else 1)


def test_train_takes_a_dataset_of_dicts_and_a_loss_over_them(tmp_path: Path) -> None:
    """`--dataset` returning dicts (the model's keyword inputs, the loss's targets), pipelined:
    it learns, and accuracy does not apply (a pipeline equal to one process on dict batches:
    tests/distributed/test_any_model.py)."""
    path = tmp_path / "pp.json"
    out = gradmesh(
        *("train", f"--model={USER}:weighted_model", f"--dataset={USER}:weighted_data"),
        *(f"--loss={USER}:weighted_loss", "--epochs", "2", "--workers", "2", "--lr", "0.05"),
        *("--pipeline-parallel", "2", "--microbatches", "2", "--json", str(path)),
    )
    assert out.returncode == 0, out.stderr
    assert "test accuracy n/a (targets are not class ids)" in out.stdout
    run = json.loads(path.read_text())
    assert run["test_accuracy"] is None and run["layout"]["pp"] == 2
    losses = run["loss_history"]
    assert losses[-1] < 0.5 * losses[0]  # 4 separated blobs: 0.378 -> 0.00097 measured


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--model", "no_such_pkg.models:gpt"], "cannot import no_such_pkg.models: ModuleNotFound"),
        ([f"--model={USER}:nothing"], "has no nothing"),
        (
            [f"--model={USER}:model", f"--dataset={USER}:data", f"--loss={USER}:per_sample_loss"],
            "returned shape (2,), not a scalar: return the batch's mean",
        ),
        (["--model", "gpt"], "model gpt and dataset digits do not fit"),
        (["--loss", "os:getcwd"], "loss os:getcwd cannot be called as fn(outputs, targets): ()"),
        (["--loss", "os:sep"], "loss os:sep is a str, not a function"),
        (
            ["--model", "gpt", "--dataset", "text", "--model-args", "heads=3"],
            "dim 64 must be a multiple of heads 3",
        ),
        (
            ["--model", "gpt", "--dataset", "text", "--pipeline-parallel", "2", "--stages", "x.1"],
            "split point 'x.1' is not a module of model gpt",
        ),
        (
            [
                "--zero-stage",
                "3",
                "--model",
                "gpt",
                "--dataset",
                "text",
                "--pipeline-parallel",
                "2",
            ],
            "--zero-stage 3 with --pipeline-parallel is not supported: FSDP2 gathers",
        ),
        (["--zero-stage", "2", "--strategy", "local-sgd"], "strategy local-sgd keeps its own"),
        (["--zero-stage", "3", "--compression", "int8"], "with FSDP2's own collectives; --comp"),
        (["--zero-stage", "2", "--tensorboard", "tb-never-made"], "with --tensorboard is not"),
        (["--reshard"], "--reshard: it needs --checkpoint-dir"),
        (["--precision", "fp16", "--strategy", "hogwild"], "--precision fp16 with --strategy hog"),
        (
            ["--reshard", "--checkpoint-dir", "ckpt-never-made", "--compression", "int8"],
            "--reshard: compression keeps state per fusion bucket",
        ),
        (
            ["--model", "gpt", "--dataset", "text", "--sequence-parallel"],
            "--sequence-parallel splits the sequence over the tensor-parallel ranks",
        ),
        (  # 2 ranks x 2 chunks: 4 stages, and the default gpt has 2 blocks
            ["--model", "gpt", "--dataset", "text", "--pipeline-parallel", "2"]
            + ["--schedule", "interleaved", "--microbatches", "4"],
            "a pipeline of 4 stages: model gpt has 2 blocks to cut into stages",
        ),
    ],
)
def test_bad_user_code_is_one_line_before_launch(
    flags: list[str], message: str, cli_line: Callable[..., str]
) -> None:
    assert message in cli_line(["train", "--workers", "2", *flags])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--workers", "3", "--tensor-parallel", "2"], "3 workers cannot hold replicas"),
        (
            ["--workers", "2", "--tensor-parallel", "2", "--model", "linear"],
            "has no tensor-parallel plan",
        ),
        (
            ["--workers", "3", "--tensor-parallel", "3", "--model", "cnn"],
            "--tensor-parallel 3 does not divide the 16 output channels of layer 0",
        ),
        (
            ["--workers", "2", "--pipeline-parallel", "2", "--model", "linear"],
            "more stages than the model's 1 layers with weights",
        ),
        (
            ["--workers", "2", "--pipeline-parallel", "2", "--microbatches", "5"],
            "cannot be cut into 5 equal micro-batches",
        ),
        (
            ["--workers", "2", "--tensor-parallel", "2", "--strategy", "hogwild"],
            "needs the whole model",
        ),
        (
            ["--workers", "2", "--pipeline-parallel", "2", "--stages", "12"],
            "--stages '12' must give 1 increasing indices",
        ),
        (["--microbatches", "2"], "use it with --pipeline-parallel > 1"),
    ],
)
def test_layouts_that_cannot_work_are_refused_before_launch(
    flags: list[str], message: str, cli_line: Callable[..., str]
) -> None:
    assert message in cli_line(["train", *flags, "--epochs", "1"])  # no worker's line


def test_a_dying_stage_stops_the_pipeline_naming_it() -> None:
    script = str(ROOT / "tests" / "integration" / "scripts" / "dying_stage.py")
    started = time.monotonic()
    out = gradmesh("run", "-np", "2", "--timeout", "40", "--", "python", script, timeout=90)
    assert out.returncode != 0
    assert time.monotonic() - started < 40, "stopped when the stage died, not by the timeout"
    assert "rank 1 exited with code 3" in out.stderr
    assert "pipeline stage 0" in out.stderr and "rank 1" in out.stderr


def test_plan_probes_its_own_ranks_and_writes_the_plan(tmp_path: Path) -> None:
    """`gradmesh plan --probe` fits the link on the job's ranks (both group sizes' curves are
    kept, with positive figures), times a real data-parallel step, and writes a plan file that
    `gradmesh train --plan` accepts; the file records the figures the plan was priced on."""
    path = tmp_path / "plan.json"
    out = gradmesh(
        "plan", "--model", "cnn", "--dataset", "digits", "--workers", "2", "--probe",
        "--json", str(path),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "predicted step" in out.stdout and "data parallel" in out.stdout
    plan = json.loads(path.read_text())
    assert plan["model"] == "cnn" and plan["workers"] == 2
    alpha, beta = plan["predicted"]["link_inter"]
    assert alpha >= 0 and beta > 0 and plan["predicted"]["step_ms"] > 0


def test_bench_layout_measures_a_gpt_in_tokens_beside_the_planners_predictions(
    tmp_path: Path,
) -> None:
    """`gradmesh bench layout --model gpt`: each layout trains on the text dataset and reports
    tokens/s beside the mesh planner's prediction; a split holds fewer parameter bytes per rank
    than data parallelism; the planner's choice is measured too, calibrated on the rows that are
    its calibration layouts, and checked against the fastest."""
    report = tmp_path / "layout.json"
    out = gradmesh(
        *("bench", "layout", "--model", "gpt", "--model-args", "dim=32,depth=2"),
        *("--world", "2", "--layouts", "dp,tp2,pp2,plan", "--batch", "8", "--microbatches", "4"),
        *("--sequence-length", "16", "--steps", "2", "--warmup", "1", "--rounds", "1"),
        *("--json", str(report)),
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(report.read_text())
    layouts = result["layouts"]
    for name, r in layouts.items():
        assert r["tokens_per_s"] == pytest.approx(8 * 16 / r["step_s"]), name
        assert r["predicted_step_s"] > 0
        assert r["prediction_error"] == pytest.approx(r["predicted_step_s"] / r["step_s"] - 1)
    assert layouts["tp2"]["param_fraction_vs_dp"] < 0.75
    assert layouts["pp2"]["bytes_per_step"]["pipeline"] > 0
    # dp2, dp1 x tp2 and dp1 x pp2 with 4 micro-batches are the calibration layouts
    assert all(layouts[n]["calibration_layout"] for n in ("dp", "tp2", "pp2"))
    plan = result["plan"]
    assert set(plan["calibration"]["fitted_on"]) == {"dp2", "dp1xtp2", "dp1xpp2xm4"}
    chosen = plan["predicted"][0]
    assert chosen["step_s"] == min(p["step_s"] for p in plan["predicted"])
    assert (layouts["plan"]["tp"], layouts["plan"]["pp"]) == (chosen["tp"], chosen["pp"])
    fastest = min(r["step_s"] for r in layouts.values())
    assert plan["plan_over_fastest"] == pytest.approx(layouts["plan"]["step_s"] / fastest)
    assert plan["ok"] == (plan["plan_over_fastest"] <= 1 + plan["stated_error"])


def test_bench_memory_per_rank_state_under_sharding_beside_its_prediction(
    tmp_path: Path,
) -> None:
    """`gradmesh bench memory --world 4`: what a rank holds at rest under plain data
    parallelism, stage 3 and dp 2 x tp 2, each beside the formula, and `gradmesh plan --memory`
    (the meta device's count, before launch) beside each rank's measured peak (bytes: no
    machine in the thresholds). The GPT of docs/memory.md: at widths under 128 the buffers of
    collectives in flight are a fifth of a rank's peak, which no model of tensors predicts."""
    path = tmp_path / "memory.json"
    shape = ("--model-args", "dim=128,depth=8,heads=4", "--batch", "16", "--sequence-length", "128")
    out = gradmesh(
        *("bench", "memory", "--world", "4", "--layouts", "dp,zero3,dpxtp2", *shape),
        *("--steps", "1", "--warmup", "1", "--rounds", "1", "--json", str(path)),
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    layouts = json.loads(path.read_text())["layouts"]
    for name, r in layouts.items():
        assert abs(r["prediction_error"]) < 0.1, (name, r)  # measured within 1.4%
        assert r["peak_bytes"] > 0 and r["step_s"] > 0
    # AdamW: parameters, gradients and two slots; stage 3 keeps a quarter of each on 4 ranks
    assert layouts["dp"]["optimizer_bytes"] == 2 * layouts["dp"]["param_bytes"]
    assert layouts["zero3"]["state_vs_dp"] <= 0.3
    # what a step adds (activations; under FSDP2 the gathered units too), predicted from one
    # process's profile beside what the profiler saw on rank 0 of the job
    assert abs(layouts["dp"]["step_peak_error"]) < 0.1  # -0.004% measured
    gathered = {n: r["predicted"]["gathered_bytes"] for n, r in layouts.items()}
    assert gathered["zero3"] > 0 == gathered["dp"]
    # `gradmesh plan --memory`: the same layouts counted on the meta device, in seconds, each
    # rank's peak (state + step) near what the job measured: +1.3 %, +4.0 %, -4.3 % on a quiet
    # machine; under a second test worker dp 2 x tp 2's measured peak rose by 4 MB of
    # collective buffers in flight (-10.4 %), which no count of tensors predicts: 15 % here
    planned = tmp_path / "planned.json"
    said = gradmesh(
        *("plan", "--memory", "--model", "gpt", "--workers", "4", "--layouts", "dp,zero3,dpxtp2"),
        *shape, *("--optimizer", "adamw", "--json", str(planned)),
        timeout=120,
    )  # fmt: skip
    assert said.returncode == 0, said.stderr
    for name, predicted in json.loads(planned.read_text()).items():
        measured = layouts[name]["state_bytes"] + layouts[name]["peak_bytes"]
        assert abs(predicted["peak"] / measured - 1) < 0.15, (name, predicted, measured)
        assert predicted["fits"] is True


def test_bench_tp_styles_runs_gradmesh_and_dtensor_on_the_same_model(tmp_path: Path) -> None:
    report = tmp_path / "styles.json"
    out = gradmesh(
        *("bench", "tp-styles", "--dim", "32", "--steps", "2", "--warmup", "1", "--rounds", "1"),
        *("--sequence-length", "16", "--json", str(report)),
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(report.read_text())
    assert set(result["results"]) == {"gradmesh", "dtensor"}
    assert result["dtensor_over_gradmesh"] == pytest.approx(
        result["results"]["dtensor"]["step_s"] / result["results"]["gradmesh"]["step_s"]
    )


def test_plan_chooses_data_tensor_and_pipeline_degrees_for_a_gpt(tmp_path: Path) -> None:
    """`gradmesh plan --model gpt`: every layout of the world priced from one rank's measured
    slice, the fastest first, with the flags that run it; with a memory limit, the layouts
    predicted to fit it; one line when none does."""
    path = tmp_path / "mesh.json"
    out = gradmesh(
        *("plan", "--model", "gpt", "--model-args", "dim=32,depth=2", "--workers", "2"),
        *("--batch", "8", "--sequence-length", "16", "--json", str(path)),
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    plan = json.loads(path.read_text())
    assert plan["kind"] == "mesh" and plan["model"] == "gpt"
    names = [r["name"] for r in plan["layouts"]]
    assert {"dp2", "dp1xtp2", "dp1xpp2xm2", "dp1xpp2xm4", "dp1xpp2xm8"} <= set(names)
    steps = [r["step_s"] for r in plan["layouts"]]
    assert steps == sorted(steps) and plan["choice"] == plan["layouts"][0]
    assert f"plan: {names[0]}: gradmesh train" in out.stdout
    row = {r["name"]: r for r in plan["layouts"]}
    assert row["dp1xtp2"]["tensor_parallel_s"] > 0 and row["dp2"]["tensor_parallel_s"] == 0
    assert row["dp1xtp2"]["param_bytes_per_rank"] < 0.75 * row["dp2"]["param_bytes_per_rank"]
    assert row["dp1xpp2xm2"]["bubble"] == pytest.approx(1 / 3)
    # within a memory limit (the predictions, bytes: dp2 867 KiB, every block recomputed 672
    # KiB, pp2 with 4 micro-batches 525 KiB): only what fits, ZeRO and recomputation searched
    # too, the plain layouts preferred
    limited = gradmesh(
        *("plan", "--model", "gpt", "--model-args", "dim=32,depth=2", "--workers", "2"),
        *("--batch", "8", "--sequence-length", "16", "--json", str(path)),
        *("--memory-limit", "700KB"),
        timeout=300,
    )
    assert limited.returncode == 0, limited.stderr
    plan = json.loads(path.read_text())
    fits = {r["name"]: r for r in plan["layouts"]}
    assert all(r["memory"]["total_bytes"] <= 700 * 1024 for r in fits.values())
    assert "dp2" not in fits and {"dp2xac", "dp2xz1xac", "dp1xpp2xm4"} <= set(fits)
    assert (plan["choice"]["zero_stage"], plan["choice"]["checkpointing"]) == (0, False)
    assert row["dp2"]["memory"]["total_bytes"] > fits["dp2xac"]["memory"]["total_bytes"]
    assert "--zero-stage 1 --activation-checkpointing blocks" in layout_flags(fits["dp2xz1xac"])
    refused = one_line_error(
        gradmesh(
            *("plan", "--model", "gpt", "--model-args", "dim=32,depth=2", "--workers", "2"),
            *("--batch", "8", "--sequence-length", "16", "--memory-limit", "100KB"),
        )
    )
    assert "no layout of 2 workers fits --memory-limit 0.1 MiB a rank: the smallest, " in refused
    assert "most of it" in refused


def test_a_language_model_reports_perplexity_tokens_and_mfu(tmp_path: Path) -> None:
    """`gradmesh train --model gpt --dataset text`: perplexity, tokens/s and MFU, whose FLOPs
    are the transformer's own arithmetic (forward: the blocks' matmuls, attention's two
    products over all 64 positions, the head; backward twice that) counted by torch."""
    report = tmp_path / "run.json"
    out = gradmesh(
        "train", "--model", "gpt", "--dataset", "text", "--workers", "2", "--epochs", "1",
        "--max-steps", "20", "--json", str(report),
    )  # fmt: skip  # 20 of the epoch's 94 steps: 5 warm-up steps, then the steady rate's 15
    assert out.returncode == 0, out.stderr
    result = json.loads(report.read_text())
    d, depth, seq, vocab = 64, 2, 64, 256  # gpt's defaults on the byte-level text dataset
    block = 2 * d * 3 * d + 2 * d * d + 2 * 2 * d * 4 * d + 2 * 2 * seq * d
    forward = seq * (depth * block + 2 * d * vocab)
    assert result["tokens_per_sample"] == seq
    assert result["flops_per_sample"] == pytest.approx(3 * forward, rel=0.01)
    assert result["peak_flops"] > 0
    assert result["peak_source"].startswith("measured on this CPU")
    assert result["gpu_peak_memory_bytes"] is None  # a CPU run: no CUDA call, a null
    assert result["steady_samples_per_s"] > 0  # the rate after the first steps: MFU's
    rate = result["steady_samples_per_s"] * result["flops_per_sample"]
    assert result["mfu"] == pytest.approx(rate / (2 * result["peak_flops"]), rel=1e-6)
    assert 0 < result["mfu"] < 1
    assert "perplexity" in out.stdout and f"MFU {result['mfu']:.1%}" in out.stdout


def test_a_hybrid_plan_by_module_name_trains_the_residual_cnn(tmp_path: Path) -> None:
    """`--plan` on a model that is not a sequence of layers, with a wildcard: the residual
    blocks data-parallel over all 4 workers, the classifier split over 2, trains as pure data
    parallelism does (the same loss to float32 rounding: measured equal to 4 decimals)."""
    plan = tmp_path / "plan.json"
    layers = {"stem": "data", "blocks.*.conv*": "data", "fc1": "colwise", "fc2": "rowwise"}
    plan.write_text(json.dumps({"model": "residual", "tensor_parallel": 2, "layers": layers}))
    reports = []
    for extra in ([], ["--plan", str(plan)]):
        report = tmp_path / f"run{len(reports)}.json"
        out = gradmesh(
            "train", "--model", "residual", "--workers", "4", "--epochs", "1",
            "--json", str(report), *extra,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        reports.append(json.loads(report.read_text()))
    plain, hybrid = reports
    assert hybrid["layout"]["tp"] == 2 and hybrid["layout"]["plan"] == layers
    assert hybrid["final_loss"] == pytest.approx(plain["final_loss"], rel=1e-3)


def test_bench_memory_measures_what_recomputation_saves(tmp_path: Path) -> None:
    """`gradmesh bench memory`: each mode's step time and peak activation bytes; recomputing
    every block keeps a fraction of what keeping every activation does (0.18x measured on the
    default GPT), every other block about half (0.55x)."""
    result = tmp_path / "memory.json"
    out = gradmesh(
        "bench", "memory", "--model-args", "dim=32,depth=4,heads=4", "--batch", "4",
        "--sequence-length", "32", "--steps", "1", "--warmup", "1", "--rounds", "1",
        "--json", str(result),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    modes = json.loads(result.read_text())["modes"]
    assert set(modes) == {"none", "every:2", "blocks"}
    assert all(m["step_s"] > 0 for m in modes.values())
    assert modes["blocks"]["peak_bytes"] < 0.5 * modes["none"]["peak_bytes"]
    assert (
        modes["blocks"]["peak_bytes"] < modes["every:2"]["peak_bytes"] < modes["none"]["peak_bytes"]
    )


def test_a_hugging_face_model_trains_from_the_cli_with_its_mfu(tmp_path: Path) -> None:
    """`--model hf:llama` built from a config (random weights, no download) trains on text under
    tensor parallelism by its declared plan, and the report gives its MFU (its FLOPs counted on
    a real copy: a Llama's forward reads a value back, which the meta device cannot)."""
    pytest.importorskip(
        "transformers", reason="the hf extra (pip install 'gradmesh[hf]') is missing"
    )
    report = tmp_path / "run.json"
    args = "hidden_size=32,intermediate_size=64,num_hidden_layers=2,num_attention_heads=4,"
    args += "num_key_value_heads=2"
    out = gradmesh(
        "train", "--model", "hf:llama", "--model-args", args, "--dataset", "text",
        "--sequence-length", "32", "--workers", "2", "--tensor-parallel", "2", "--epochs", "1",
        "--max-steps", "20", "--json", str(report),
    )  # fmt: skip  # 20 of the epoch's 187 steps: 5 warm-up steps, then the steady rate's 15
    assert out.returncode == 0, out.stderr
    # torchao's import noise (its CUDA extensions, torch's pytree; gradmesh.models.quiet) is not
    # the run's: none of it on stderr, from the launcher or either rank
    assert "torchao" not in out.stderr and "_pytree" not in out.stderr, out.stderr
    result = json.loads(report.read_text())
    assert result["layout"]["tp"] == 2
    assert result["flops_per_sample"] > 0 and 0 < result["mfu"] < 1
    assert "perplexity" in out.stdout and "MFU" in out.stdout


def test_stage_1_checkpoints_each_replica_s_part_and_resumes_whole_elsewhere(
    tmp_path: Path,
) -> None:
    """ZeRO stage 1 on 2 workers: each rank writes its part of AdamW's state (no rank gathers
    the whole). A rank is killed and the job restarts from the checkpoint before, at the same
    layout: it ends at the uninterrupted run's epoch loss, to the bit. Resumed from the last
    checkpoint but one with --reshard without ZeRO, the optimizer state is put back together
    from both replicas' parts: the last step's loss and update agree to float rounding (with
    a part missing, that update would restart Adam's moments: the weights would differ)."""
    from gradmesh.train import checkpoint
    from gradmesh.train.config import TrainConfig
    from gradmesh.train.setup import load_data, model_of

    args = ["--model", "gpt", "--dataset", "text", "--model-args", "dim=32,depth=1,heads=2"]
    args += ["--sequence-length", "32", "--batch-size", "256", "--epochs", "1", "--workers", "2"]
    args += ["--optimizer", "adamw", "--lr", "0.003", "--zero-stage", "1"]
    args += ["--checkpoint-every", "23", "--keep-checkpoints", "2"]
    plain = tmp_path / "plain.json"
    assert gradmesh("train", *args[:-4], "--json", str(plain)).returncode == 0
    first = tmp_path / "first"
    done = gradmesh(
        *("train", *args, "--checkpoint-dir", str(first), "--json", str(tmp_path / "a")),
        *("--max-restarts", "1"),
        env={"GRADMESH_FAULT": "kill:1:30"},  # restarted from step 23
    )
    assert done.returncode == 0, done.stderr
    a = json.loads((tmp_path / "a").read_text())
    assert (a["faults"]["restarts"], a["faults"]["resumed_from_step"]) == (1, 23)
    assert a["loss_history"] == json.loads(plain.read_text())["loss_history"]
    moved = tmp_path / "moved"
    shutil.copytree(first / "step-00000046", moved / "step-00000046")
    report = tmp_path / "moved.json"
    flags = ["--zero-stage", "0", "--reshard", "--checkpoint-dir", str(moved)]
    out = gradmesh("train", *args, *flags, "--json", str(report))
    assert out.returncode == 0, out.stderr
    resumed = json.loads(report.read_text())
    assert resumed["faults"]["resumed_from_step"] == 46
    assert abs(a["loss_history"][-1] - resumed["loss_history"][-1]) < 1e-7
    config = TrainConfig.of(model="gpt", dataset="text", model_args="dim=32,depth=1,heads=2")
    config = config.with_options(sequence_length=32)
    whole = {}
    for name in ("first", "moved"):  # the last update, read back whole
        whole[name] = model_of(config, load_data(config))
        assert checkpoint.load_whole(tmp_path / name, whole[name]).step == 47
    for (key, x), y in zip(
        whole["first"].state_dict().items(), whole["moved"].state_dict().values(), strict=True
    ):
        assert torch.allclose(x, y, atol=1e-6), key


def test_a_sharded_checkpoint_resumes_in_its_layout_and_resharded_in_another(
    tmp_path: Path,
) -> None:
    """The GPT (q, k, v fused: a chunked split; a vocabulary-parallel embedding) trained at
    dp 4 with ZeRO stage 3, each rank writing its shards, a checkpoint before the last step.
    A rank is killed on the way and the job restarted from the checkpoint before (the others'
    FSDP2 collectives failing in a line each). Resumed from it at the same layout, the last step
    is the same to the bit; resumed at
    dp 2 x tp 2 (stage 3 again: each tp slice sharded over 2 replicas) with --reshard, the same
    to float rounding: the epoch loss and the weights, each run's final checkpoint read back
    whole by one process."""
    from gradmesh.train import checkpoint
    from gradmesh.train.config import TrainConfig
    from gradmesh.train.setup import load_data, model_of

    args = ["--model", "gpt", "--dataset", "text", "--model-args", "dim=32,depth=1,heads=2"]
    args += ["--sequence-length", "32", "--batch-size", "256", "--epochs", "1", "--workers", "4"]
    args += ["--checkpoint-every", "23", "--keep-checkpoints", "2", "--zero-stage", "3"]
    first = tmp_path / "first"  # 47 steps: checkpoints 46 and 47 kept
    done = gradmesh(
        *("train", *args, "--checkpoint-dir", str(first), "--json", str(tmp_path / "a")),
        *("--max-restarts", "1"),
        env={"GRADMESH_FAULT": "kill:2:30"},  # restarted from step 23
    )
    assert done.returncode == 0, done.stderr
    # the other ranks' FSDP2 collectives failed, each in a line, before the restart
    assert "Traceback" not in done.stderr, done.stderr
    runs = {}
    for name, flags in [("same", []), ("moved", ["--tensor-parallel", "2", "--reshard"])]:
        folder = tmp_path / name
        shutil.copytree(first / "step-00000046", folder / "step-00000046")
        if flags:  # without --reshard, another layout is one line naming it
            said = one_line_error(
                gradmesh("train", *args, *flags[:2], "--checkpoint-dir", str(folder))
            )
            assert said.endswith(
                "belongs to another run: tensor_parallel=1 (now 2) (--reshard resumes it in "
                "this layout)"
            )
        report = tmp_path / f"{name}.json"
        out = gradmesh(
            "train", *args, *flags, "--checkpoint-dir", str(folder), "--json", str(report)
        )
        assert out.returncode == 0, out.stderr
        runs[name] = json.loads(report.read_text())
        assert runs[name]["faults"]["resumed_from_step"] == 46
    a = json.loads((tmp_path / "a").read_text())
    assert (a["faults"]["restarts"], a["faults"]["resumed_from_step"]) == (1, 23)
    assert runs["same"]["loss_history"] == a["loss_history"]
    # one step of 47 differs, by float rounding at most: measured 2e-11 apart (dp4 -> dp2 x tp2)
    assert abs(a["loss_history"][-1] - runs["moved"]["loss_history"][-1]) < 1e-7
    config = TrainConfig.of(model="gpt", dataset="text", model_args="dim=32,depth=1,heads=2")
    config = config.with_options(sequence_length=32)
    whole = {}
    for name in ("first", "same", "moved"):
        whole[name] = model_of(config, load_data(config))
        assert checkpoint.load_whole(tmp_path / name, whole[name]).step == 47
    for (key, x), y, z in zip(
        whole["first"].state_dict().items(),
        whole["same"].state_dict().values(),
        whole["moved"].state_dict().values(),
        strict=True,
    ):
        assert torch.equal(x, y), key
        assert torch.allclose(x, z, atol=1e-6), key  # 3e-8 measured
