"""The simulator: models by layer shape on the meta device, its roofline fitted on the calibration
rows of `published.toml` and checked on the validation rows (set-ups as the sources state them),
transformers on the mesh formulas with their memory, and the layout search."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from gradmesh.collectives.cost import CostParams
from gradmesh.models.devices import SHEETS
from gradmesh.planner import Links
from gradmesh.simulate.devices import ACHIEVED, DEVICES
from gradmesh.simulate.fit import fit_devices
from gradmesh.simulate.profile import device_profile, model_layers
from gradmesh.simulate.published import PUBLISHED, load, validate
from gradmesh.simulate.strategies import Job, scaling
from tests.harness import CLI

KNOWN_MISSES = {"tt-8b-128k", "tt-8b-256k", "tt-405b-256k"}
"""Validation rows the model misses (docs/simulator.md says why): checked to stay missed, so
the day the model meets one, this set and the docs are brought up to date."""


def _job(
    device: str,
    per_node: int,
    intra_gbit: float,
    inter_gbit: float,
    latency: float,
    algorithm: str,
    fusion_mb: float = 25.0,
) -> Job:
    costs = model_layers("resnet50", 32)
    links = Links(
        CostParams(latency, 8 / (intra_gbit * 1e9), 0.0),
        CostParams(latency, 8 / (inter_gbit * 1e9), 0.0),
        per_node,
    )
    prof = device_profile(costs, DEVICES.get(device), 32, "resnet50")
    return Job(prof, 1, links, algorithm, fusion_mb)


def test_the_imagenet_models_have_their_published_sizes() -> None:
    # parameter counts as published (Inception V3 without its auxiliary head) and ResNet-50's
    # 4.1 G multiply-adds per 224x224 image forward; backward twice forward but the first layer
    expected = {
        "resnet50": 25_557_032,
        "resnet101": 44_549_160,
        "vgg16": 138_357_544,
        "inception3": 23_834_568,
        "alexnet-imagenet": 61_100_840,
    }
    for name, count in expected.items():
        layers = model_layers(name, 1).layers
        assert sum(layer.param_bytes for layer in layers) == 4 * count, name
    layers = model_layers("resnet50", 2).layers
    forward = sum(layer.fwd_flops for layer in layers)
    assert forward == pytest.approx(2 * 8.18e9, rel=0.01)
    backward = sum(layer.bwd_flops for layer in layers)
    assert backward == pytest.approx(2 * forward - layers[0].fwd_flops, rel=1e-6)
    assert layers[0].name == "0.0" and layers[-1].name == "20"  # forward order: stem .. fc


def test_kernels_are_counted_by_kind_with_their_bytes() -> None:
    """VGG-16's convolutions are all 3x3 stride 1 (Winograd's); ResNet-50's are mostly not, and
    its batch norms are memory-bound layers of their own; the counted FLOPs are the counter's."""
    vgg = model_layers("vgg16", 2)
    kinds = {k for la in vgg.layers for k, _, _ in la.kernels}
    assert "conv" not in kinds and {"conv3x3", "matmul", "memory"} <= kinds
    resnet = model_layers("resnet50", 2)
    conv = {
        k: sum(f for la in resnet.layers for kk, f, _ in la.kernels if kk == k)
        for k in ("conv", "conv3x3")
    }
    assert conv["conv"] > conv["conv3x3"] > 0
    assert sum(conv.values()) == pytest.approx(sum(la.fwd_flops for la in resnet.layers), rel=0.01)
    norms = [la for la in resnet.layers if la.fwd_flops == 0]
    assert norms and all(k == "memory" and b > 0 for la in norms for k, _, b in la.kernels)
    assert resnet.backward["memory"][1] > 0


def test_validation_rows_are_not_calibration_rows() -> None:
    table = load()
    calibration, validation = table.role("calibration"), table.role("validation")
    assert len(validation) >= 12 and len({r.source for r in validation}) >= 3
    assert not {r.id for r in calibration} & {r.id for r in validation}
    assert not {r.setup for r in calibration} & {r.setup for r in validation}
    assert all(r.fits for r in calibration) and not any(r.fits for r in validation)


def test_the_devices_fractions_are_the_fit_on_the_calibration_rows() -> None:
    fitted = fit_devices(load())
    assert fitted.keys() == ACHIEVED.keys()
    for device, fractions in ACHIEVED.items():  # stored to 3 decimals
        assert fitted[device] == pytest.approx(fractions, abs=2e-3), device


def test_fp32_products_run_at_the_cuda_cores_fraction_where_one_is_fitted() -> None:
    # an H100 in fp32 without TF32 multiplies on its CUDA cores: gpt-h100-fp32 fits their
    # fraction of the fp32 peak, apart from the tensor cores' in bf16 or tf32
    h100, v100 = DEVICES.get("h100"), DEVICES.get("v100")
    fp32, bf16 = h100.at("fp32"), h100.at("bf16")
    assert fp32.fraction("matmul") == ACHIEVED["h100"]["fp32"] != bf16.fraction("matmul")
    assert fp32.fraction("attention") == ACHIEVED["h100"]["fp32"]
    tensor_cores = ACHIEVED["h100"]["matmul"]
    assert bf16.fraction("matmul") == h100.at("tf32").fraction("matmul") == tensor_cores
    assert fp32.fraction("conv") == ACHIEVED["h100"]["conv"]  # no row separates convolutions
    # a device with no fp32 fraction of its own (fitted in fp32 already) keeps its kinds'
    assert v100.at("fp32").fraction("matmul") == ACHIEVED["v100"]["matmul"]
    one = [("matmul", 1e12, 0.0)]
    assert fp32.seconds(one) == pytest.approx(1e12 / (67e12 * ACHIEVED["h100"]["fp32"]))


def test_the_simulators_peaks_are_the_shared_device_tables() -> None:
    # one table serves the simulator and the train report's MFU (gradmesh.models.devices);
    # the simulator prices fp32, tf32, bf16 and fp16 (and fp8 for float8's products), with the
    # figures it was fitted on
    for name in ACHIEVED:
        sheet = SHEETS[name]
        device = DEVICES.get(name)
        assert device.peak_tflops == sheet.peak_tflops
        assert (device.bandwidth_gbs, device.memory_gib) == (sheet.bandwidth_gbs, sheet.memory_gib)
    assert DEVICES.get("h100").peak_tflops == {
        "fp32": 67,
        "tf32": 495,
        "bf16": 989,
        "fp16": 989,
        "fp8": 1979,
    }


def test_kernels_are_priced_on_the_flops_their_tiles_issue() -> None:
    """A convolution of 48 output channels issues 64's work; its backward pads the input
    gradient's 48 input channels as well; a depthwise convolution and a 128-wide product pad
    nothing; and the counter's useful FLOPs stay torch's."""
    from torch import nn

    from gradmesh.models.flops import KernelCounter

    def counted(make: Callable[[], nn.Module], *shape: int) -> tuple[dict[str, float], float]:
        counter = KernelCounter()
        with torch.device("meta"):
            net, x = make(), torch.randn(*shape, requires_grad=True)
            with counter:
                net(x).sum().backward()
        kinds: dict[str, float] = {}
        for costs in counter.costs.values():
            for kind, (f, _) in costs.items():
                kinds[kind] = kinds.get(kind, 0.0) + f
        return kinds, counter.useful

    kinds, useful = counted(lambda: nn.Conv2d(48, 48, 1, bias=False), 2, 48, 8, 8)
    assert kinds["conv"] == pytest.approx(useful * 64 / 48)
    depthwise = lambda: nn.Conv2d(48, 48, 3, padding=1, groups=48, bias=False)  # noqa: E731
    kinds, useful = counted(depthwise, 2, 48, 8, 8)
    assert kinds["conv3x3"] == pytest.approx(useful)
    kinds, useful = counted(lambda: nn.Linear(128, 128, bias=False), 64, 128)
    assert kinds["matmul"] == pytest.approx(useful)
    kinds, useful = counted(lambda: nn.Linear(128, 96, bias=False), 64, 128)
    assert kinds["matmul"] > useful * 1.1


def test_the_validation_rows_are_within_tolerance() -> None:
    results, good = validate(load())
    outside = {r["id"] for r in results if r["role"] == "validation" and not r["within"]}
    assert outside == KNOWN_MISSES and good is not bool(KNOWN_MISSES)
    rows = {r["id"]: r for r in results}
    # what the issue named: VGG-16's 512-GPU efficiency is no longer optimistic beyond tolerance,
    # and its single-P100 step (a calibration row) is the published one
    assert abs(rows["horovod-vgg16-512"]["error"]) <= 0.10
    assert abs(rows["tf-p100-vgg16"]["error"]) <= 0.15


def test_a_row_that_gathers_a_ring_it_does_not_run_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], cli: CLI
) -> None:
    text = PUBLISHED.read_text()
    start = text.index('[[rows]]\nid = "goyal-resnet50-256"')
    row = text[start : text.index("[[rows]]", start + 1)]
    table = tmp_path / "rows.toml"
    table.write_text(text[: text.index("# -- calibration")] + row + "context_gather = true\n")
    assert cli(["simulate", "--validate", "--published", str(table)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "row goyal-resnet50-256: context_gather prices the ring of context_parallel 2" in err


def test_validate_exits_non_zero_when_a_row_is_outside(tmp_path: Path, cli: CLI) -> None:
    """A table of the sources and one row, Goyal et al.'s: within tolerance it exits 0; with the
    published figure moved out of reach, 1, and the JSON names the row."""
    text = PUBLISHED.read_text()
    start = text.index('[[rows]]\nid = "goyal-resnet50-256"')
    row = text[start : text.index("[[rows]]", start + 1)]
    table = tmp_path / "rows.toml"
    table.write_text(text[: text.index("# -- calibration")] + row)
    assert cli(["simulate", "--validate", "--published", str(table)]) == 0
    table.write_text(table.read_text().replace("published = 0.90", "published = 0.50"))
    out = tmp_path / "v.json"
    assert cli(["simulate", "--validate", "--published", str(table), "--json", str(out)]) == 1
    rows = json.loads(out.read_text())["rows"]
    assert [r["id"] for r in rows if not r["within"]] == ["goyal-resnet50-256"]


def test_communication_overlaps_backward_and_slow_links_show() -> None:
    fast = _job("v100", 8, 1000, 400, 5e-6, "ring")
    slow = _job("v100", 8, 1000, 1, 5e-6, "ring")
    alone = scaling("allreduce", fast, [1])[0]["step_s"]
    sync = 2 * 15 / 16 * 25_557_032 * 4 * 8 / 1e9  # the whole gradient's ring at 1 Gbit/s
    overlapped = scaling("allreduce", slow, [16])[0]["step_s"]
    # buckets leave during backward: the step is less than compute then the whole sync ...
    assert alone < overlapped < alone + sync
    # ... and more than the sync alone, which cannot start before the last layer's gradient
    assert overlapped > sync
    # two levels: hierarchical sends one vector per node over the slow links
    flat = scaling("allreduce", slow, [256])[0]["step_s"]
    two_level = scaling("allreduce", _job("v100", 8, 1000, 1, 5e-6, "hierarchical"), [256])
    assert two_level[0]["step_s"] < flat


def test_servers_on_their_own_hosts_are_reached_over_the_slow_link() -> None:
    """One worker whose server has a host of its own (the scaling bench's ps jobs) pays the link
    between nodes; a server on the worker's own node does not; a fitted point-to-point link,
    where there is one, prices the messages."""
    slow = _job("v100", 1, 1000, 1, 5e-6, "ring")
    together = scaling("ps", dataclasses.replace(slow, servers=1), [1])[0]["step_s"]
    apart = dataclasses.replace(slow, servers=1, servers_apart=True)
    alone = scaling("ps", apart, [1])[0]["step_s"]
    assert alone > together + 25_557_032 * 4 * 8 / 1e9  # at least the push at 1 Gbit/s
    faster = dataclasses.replace(slow.links, point_to_point=CostParams(5e-6, 8 / 10e9, 0.0))
    assert scaling("ps", dataclasses.replace(apart, links=faster), [1])[0]["step_s"] < alone


def test_simulate_writes_json_for_1024_gpus(tmp_path: Path, cli: CLI) -> None:
    out = tmp_path / "sim.json"
    args = [
        "simulate",
        "--model",
        "vgg16",
        "--gpus",
        "8,1024",
        "--strategy",
        "allreduce,ps",
        "--algorithm",
        "hierarchical",
        "--json",
        str(out),
    ]
    assert cli(args) == 0
    payload = json.loads(out.read_text())
    rows = payload["strategies"]["allreduce"]
    assert [r["gpus"] for r in rows] == [8, 1024] and rows[1]["efficiency"] <= 1.0
    assert payload["strategies"]["ps"][1]["step_s"] > rows[1]["step_s"]


def test_splitting_the_fully_connected_layers_pays_across_slow_links(
    tmp_path: Path, cli: CLI
) -> None:
    """Krizhevsky's trick, simulated with the planner's cost model: ImageNet AlexNet's 244 MB of
    gradients (94% in the fully connected layers) across 10 Gbit/s links. Within one node (8
    GPUs on NVLink) data parallelism is already right, and the planner keeps it; across nodes
    it splits, several times faster than data parallelism and than the model's own uniform
    tensor-parallel plan (which replicates the convolutions on 8x the samples)."""
    out = tmp_path / "sim.json"
    flags = ["--model", "alexnet-imagenet", "--gpus", "8,16,64", "--tensor-parallel", "8"]
    flags += ["--json", str(out)]
    args = ["simulate", *flags, "--inter-node-bandwidth", "10gbit", "--strategy"]
    assert cli([*args, "allreduce,tensor,hybrid"]) == 0
    got = {
        s: [r["step_s"] for r in rows]
        for s, rows in json.loads(out.read_text())["strategies"].items()
    }
    assert got["hybrid"][0] == pytest.approx(got["allreduce"][0])
    for n in (1, 2):
        assert got["hybrid"][n] < got["allreduce"][n] / 4
        assert got["hybrid"][n] < got["tensor"][n] / 2


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_pipeline_is_simulated_action_by_action(schedule: str) -> None:
    """4 equal stages (1 ms forward, 2 ms backward per GPU's batch), 8 micro-batches, free
    links: each micro-batch takes 3 ms x 4/8 on a stage, and the step is (m + p - 1) of them:
    the bubble of (p - 1) / (m + p - 1) that docs/model_parallel.md states. One micro-batch
    runs the stages one after another; a link that costs time delays every hand-over."""
    from gradmesh.planner import Profile, Unit
    from gradmesh.simulate.profile import Split
    from gradmesh.simulate.strategies import STRATEGIES

    units = [
        Unit(str(i), "Linear", 0, 0, 4, 4, 4, (1, 1), {"data": 1e-3}, {"data": 2e-3})
        for i in range(4)
    ]
    prof = Profile("toy", 1, 32, units, 0, 1, 0.0)
    free = CostParams(0.0, 0.0, 0.0)
    job = Job(
        prof,
        4,
        Links(free, free, 4),
        split=Split(prof, None, None),
        pipeline_parallel=4,
        microbatches=8,
    )
    pipeline = STRATEGIES.get("pipeline")
    job = dataclasses.replace(job, schedule=schedule)
    assert pipeline(job) == pytest.approx((8 + 4 - 1) * 3e-3 * 4 / 8)
    assert pipeline(dataclasses.replace(job, microbatches=1)) == pytest.approx(4 * 3e-3 * 4)
    slow = Links(CostParams(1e-3, 0.0, 0.0), free, 4)  # 1 ms per message within the node
    # each micro-batch's activations cross 3 boundaries forward and 3 back, one after another
    assert pipeline(dataclasses.replace(job, links=slow, microbatches=1)) == pytest.approx(
        4 * 3e-3 * 4 + 6e-3
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--model", "resnet"], "unknown model 'resnet' (valid: alexnet, alexnet-imagenet,"),
        (
            ["--model", "linear", "--strategy", "tensor"],
            "model linear declares no tensor-parallel plan",
        ),
        (
            ["--model", "resnet50", "--strategy", "hybrid"],
            "model resnet50: layer 0 is a Sequential; the planner places Linear and Conv2d",
        ),
        (
            ["--device", "tpu"],
            "unknown device 'tpu' (valid: a100, h100, h100-96gb, p100, v100, cpu)",
        ),
        (["--gpus", "12"], "GPU count 12 is not a multiple of --gpus-per-node 8"),
        (["--inter-node-bandwidth", "0gbit"], "bandwidth '0gbit' is too low"),
        (["--intra-node-bandwidth=-5gbit"], "bad bandwidth '-5gbit'"),
        (["--strategy", "gossip"], "unknown simulated strategy 'gossip'"),
        # an option the pricing asked for would not read is refused, never dropped
        (
            ["--model", "resnet50", "--context-parallel", "2"],
            "--context-parallel: options of token models (gpt, hf:..., a factory); model resnet50",
        ),
        (
            ["--model", "gpt", "--input-shape", "3x32x32"],
            "--input-shape: options of image models; model gpt is priced on the mesh",
        ),
        (["--validate"], "--gpus: not read by --validate, which prices the published runs"),
        (["--published", "rows.toml"], "--published: the table --validate prices"),
        (["--model", "gpt", "--top", "3"], "--top: options of --search (the layouts it prints)"),
        (["--top", "3"], "--top: options of token models (gpt, hf:..., a factory); model cnn"),
        (["--nics-per-node", "0"], "--nics-per-node must be >= 1, got 0"),
        (
            ["--model", "resnet50", "--servers", "4", "--microbatches", "4"],
            "--servers, --microbatches: not read by --strategy allreduce (options of --strategy "
            "pipeline or ps)",
        ),
    ],
)
def test_bad_simulate_input_is_one_line(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str], cli: CLI
) -> None:
    assert cli(["simulate", "--gpus", "8", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--strategies", "allreduce,gossip"], "unknown simulated strategy 'gossip'"),
        (["--hosts", "0,2"], "every host count must be >= 1, got 0,2"),
        (["--epochs", "0"], "--batch-per-worker, --epochs and --rounds must be >= 1"),
    ],
)
def test_bad_scaling_bench_input_is_one_line_before_any_job(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str], cli: CLI
) -> None:
    assert cli(["bench", "scaling", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
