"""The device table and the peak a run's MFU is against: picked by the CUDA device's name and
the run's precision, overridden by --peak-tflops, measured on a CPU, unknown otherwise (no GPU
needed: the picking is a function of names and flags); and the report's lines about them."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from gradmesh.models.devices import MEASURED, SHEETS, UNKNOWN, device_peak, pick_peak, sheet_of
from gradmesh.train.config import TrainConfig
from gradmesh.train.report import RankStats, RunFacts, RunReport


def never() -> float:
    raise AssertionError("a GPU's or an overridden peak is never measured")


@pytest.mark.parametrize(
    ("name", "entry"),
    [
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA A100 80GB PCIe", "a100"),
        ("Tesla V100-SXM2-32GB", "v100"),
        ("NVIDIA H100 NVL", None),  # other peaks than the SXM part's: not guessed
        ("NVIDIA H200 NVL", None),
        ("NVIDIA GH200 480GB", None),
        ("NVIDIA A10", None),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_a_cuda_name_finds_its_part_or_none(name: str, entry: str | None) -> None:
    sheet = sheet_of(name)
    assert (sheet.name if sheet else None) == entry


def test_a_gpu_peak_is_its_data_sheet_figure_at_the_runs_precision() -> None:
    peak, source = pick_peak("cuda", "NVIDIA H100 80GB HBM3", "bf16", False, 0.0, never)
    assert peak == 989e12
    assert source.startswith("h100 bf16") and "H100 SXM5" in source
    assert pick_peak("cuda", "NVIDIA H100 80GB HBM3", "fp8", False)[0] == 1979e12
    assert pick_peak("cuda", "NVIDIA H200", "fp16", False)[0] == 989e12
    assert pick_peak("cuda", "NVIDIA H100 PCIe", "bf16", False)[0] == 756.5e12
    # fp32 runs on the CUDA cores unless TF32 matmuls are on
    assert pick_peak("cuda", "NVIDIA A100-SXM4-80GB", "fp32", False)[0] == 19.5e12
    peak, source = pick_peak("cuda", "NVIDIA A100-SXM4-80GB", "fp32", True)
    assert peak == 156e12 and source.startswith("a100 tf32")


def test_an_unknown_gpu_or_precision_has_no_peak_and_names_the_flag() -> None:
    for args in (
        ("cuda", "NVIDIA H100 NVL", "bf16", False),
        ("cuda", "Tesla V100-SXM2-32GB", "bf16", False),  # Volta has no bf16
        ("cuda", "NVIDIA A100-SXM4-80GB", "fp8", False),
        ("mps", "", "fp32", False),
    ):
        peak, source = pick_peak(*args, measure=never)
        assert peak == 0.0, args
        assert source.startswith(UNKNOWN) and "--peak-tflops" in source, args


def test_the_flag_wins_and_a_cpu_keeps_its_measured_peak() -> None:
    assert pick_peak("cuda", "NVIDIA H100 NVL", "bf16", False, 835.0, never) == (
        835e12,
        "--peak-tflops 835",
    )
    assert pick_peak("cpu", "", "fp32", False, 0.5, never) == (0.5e12, "--peak-tflops 0.5")
    assert pick_peak("cpu", "", "bf16", False, 0.0, lambda: 1.5e11) == (1.5e11, MEASURED)
    # this machine's own device, read through torch: nothing CUDA is called
    assert device_peak(torch.device("cpu"), "fp32", 0.0, lambda: 2e11) == (2e11, MEASURED)


def test_every_part_has_its_peaks_in_known_precisions() -> None:
    for sheet in SHEETS.values():
        assert set(sheet.peak_tflops) <= {"fp32", "tf32", "bf16", "fp16", "fp8"}
        assert min(sheet.peak_tflops.values()) == sheet.peak_tflops["fp32"]
        assert sheet.memory_gib > 0 and sheet.bandwidth_gbs > 0


def report(peak: float, source: str, gpu_bytes: float) -> RunReport:
    """A language model's one-worker report with this peak and GPU memory."""
    config = TrainConfig.of(dataset="text", model="gpt")
    layout = {"peak_flops": [peak], "gpu_peak_memory_bytes": [gpu_bytes]}
    stats = RankStats([0.0], [1.0], [0], layout)
    facts = RunFacts(1, {}, 0.5, [2.0], 1.0, 1000, stats, flops_per_sample=1e9, peak_source=source)
    return RunReport.build(config, facts)


def test_the_report_says_where_the_peak_came_from() -> None:
    source = pick_peak("cuda", "NVIDIA H100 80GB HBM3", "bf16", False)[1]
    run = report(989e12, source, 3 * 2**30)
    assert run.mfu == pytest.approx(1000 * 1e9 / 989e12)
    text = run.summary()
    assert f"MFU {run.mfu:.1%}" in text and "989.0 TFLOP/s per worker, peak h100 bf16" in text
    assert "GPU peak memory 3.00 GiB" in text
    assert json.loads(run.to_json())["gpu_peak_memory_bytes"] == 3 * 2**30


def test_an_unknown_peak_is_said_and_a_cpu_run_has_no_gpu_memory() -> None:
    source = pick_peak("cuda", "NVIDIA H100 NVL", "bf16", False)[1]
    run = report(0.0, source, 0.0)
    assert run.mfu == 0.0
    assert "MFU n/a: the peak FLOP/s is unknown" in run.summary()
    assert "--peak-tflops" in run.summary()
    cpu = report(2e11, MEASURED, 0.0)
    assert "GFLOP/s per worker, peak measured on this CPU" in cpu.summary()
    assert "GPU peak memory" not in cpu.summary()
    assert json.loads(cpu.to_json())["gpu_peak_memory_bytes"] is None
    assert RunReport.load("run.json", dataclasses.asdict(cpu)) == cpu
