"""An option the run would not read is refused before launch, in one line (gradmesh.train.unread),
and the same option given where the run reads it passes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from gradmesh.errors import GradmeshError
from gradmesh.train.checks import check_train
from gradmesh.train.config import TrainConfig

PIPELINE = {"workers": 2, "pipeline_parallel": 2, "microbatches": 4}
REPLICA = {"replica_group": 0, "replica_groups": 2, "lighthouse": "h:1"}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"warmup_epochs": 2.0}, "--warmup-epochs: options of --lr-scaling linear"),
        ({"reference_batch": 256}, "--reference-batch: options of --lr-scaling linear"),
        (
            {"sync_every": 4},
            "--sync-every: not read by --strategy allreduce (options of --strategy diloco or "
            "local-sgd)",
        ),
        ({"servers": 4, "mode": "ssp"}, "--servers, --mode: not read by --strategy allreduce"),
        ({"strategy": "local-sgd", "allreduce": "ring"}, "--allreduce: not read by --strategy"),
        ({"strategy": "local-sgd", "outer_lr": 0.5}, "(options of --strategy diloco)"),
        ({"strategy": "hogwild", "fusion_mb": 4.0}, "--fusion-mb: not read by --strategy hogwild"),
        ({"lock": True}, "--lock: not read by --strategy allreduce (options of --strategy hogwild"),
        (
            {"zero_stage": 3, "fusion_mb": 4.0},
            "--fusion-mb: not read by --strategy allreduce at --zero-stage 3",
        ),
        (
            {"zero_stage": 2, "on_nonfinite": "skip"},
            "--on-nonfinite skip: not at --zero-stage 2, whose step on FSDP2's sharded",
        ),
        (
            {**REPLICA, "strategy": "diloco", "warmup_sync_steps": 3},
            "--warmup-sync-steps: not read by --strategy diloco in replica groups",
        ),
        ({"strategy": "ps", "optimizer": "adam"}, "--optimizer: not read by --strategy ps"),
        ({"strategy": "ps", "lr_scaling": "linear"}, "--lr-scaling: not read by --strategy ps"),
        (
            {"strategy": "ps", "server_optimizer": "adam", "momentum": 0.5},
            "--momentum: SGD's option; this run's servers use --server-optimizer adam",
        ),
        (
            {"strategy": "ps", "server_optimizer": "adarevision", "weight_decay": 0.1},
            "--weight-decay: not read by --server-optimizer adarevision",
        ),
        ({"strategy": "ps", "max_staleness": 5}, "--max-staleness: read by --mode ssp"),
        ({"strategy": "ps", "mode": "sync", "staleness_lr": True}, "--staleness-lr: --mode sync"),
        ({"optimizer": "adamw", "momentum": 0.5}, "--momentum: SGD's option, not --optimizer"),
        ({"compression_ratio": 0.1}, "--compression-ratio: --compression topk's option"),
        (
            {"compression": "topk", "compression_rank": 4},
            "--compression-rank: --compression powersgd's option, not --compression topk's",
        ),
        ({"error_feedback": "on"}, "--error-feedback: keeps what a compressor left out"),
        ({"schedule": "gpipe"}, "--schedule: options of a pipeline; this run has none"),
        ({**PIPELINE, "virtual_stages": 4}, "--virtual-stages: the interleaved schedule's"),
        ({"context_attention": "alltoall"}, "--context-attention: context parallelism's option"),
        ({"timeline_steps": 10}, "--timeline-steps: options of --timeline"),
        ({"keep_checkpoints": 5, "checkpoint_async": True}, "options of --checkpoint-dir"),
        ({"lighthouse": "h:1"}, "--lighthouse: options of replica groups"),
        ({"synthetic_classes": 100}, "--synthetic-classes: options of --dataset synthetic"),
        ({"sequence_length": 128}, "--sequence-length: options of token datasets"),
        ({"peak_tflops": 900.0}, "--peak-tflops: options of token datasets"),
    ],
)
def test_an_option_the_run_would_not_read_is_one_line(
    change: dict[str, object], message: str
) -> None:
    with pytest.raises(GradmeshError) as err:
        check_train(TrainConfig.of(**change))
    assert message in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "change",
    [
        {"lr_scaling": "linear", "warmup_epochs": 2.0, "reference_batch": 256},
        {"strategy": "local-sgd", "sync_every": 4, "averaging_algorithm": "ring"},
        {"strategy": "diloco", "warmup_sync_steps": 2, "outer_lr": 0.5, "outer_momentum": 0.5},
        {"strategy": "hogwild", "lock": True, "momentum": 0.5},
        {"allreduce": "ring", "fusion_mb": 4.0, "on_nonfinite": "skip", "zero_stage": 1},
        {"strategy": "ps", "servers": 2, "mode": "ssp", "max_staleness": 5, "momentum": 0.5},
        {"strategy": "ps", "mode": "async", "staleness_lr": True, "server_optimizer": "adam"},
        {**REPLICA, "strategy": "diloco", "sync_every": 4, "outer_lr": 0.5, "allreduce": "ring"},
        {**REPLICA, "on_lost_replica": "rescale", "quorum_timeout_s": 5.0},
        {"optimizer": "adam", "weight_decay": 0.1},
        {"compression": "topk", "compression_ratio": 0.1, "error_feedback": "off"},
        {"compression": "PowerSGD", "compression_rank": 4},
        {**PIPELINE, "schedule": "interleaved", "virtual_stages": 4},
        {**PIPELINE, "schedule": "gpipe"},
        {"workers": 2, "model": "gpt", "dataset": "text", "context_parallel": 2}
        | {"context_attention": "alltoall"},
        {"timeline": "t.json", "timeline_steps": 10, "timeline_per_rank": True},
        {"dataset": "synthetic", "synthetic_shape": "3x8x8", "synthetic_classes": 3},
        {"model": "gpt", "dataset": "text", "sequence_length": 32, "peak_tflops": 1.0},
    ],
)
def test_the_same_options_pass_where_the_run_reads_them(change: dict[str, object]) -> None:
    check_train(TrainConfig.of(**change))


def test_a_checkpoints_options_pass_with_its_folder(tmp_path: Path) -> None:
    check_train(
        TrainConfig.of(checkpoint_dir=str(tmp_path), keep_checkpoints=5, checkpoint_async=True)
    )


def test_a_toml_value_is_refused_as_a_flag_is(tmp_path: Path, cli_line: Callable[..., str]) -> None:
    config = tmp_path / "job.toml"
    config.write_text("[train]\nwarmup_epochs = 2\n")
    assert cli_line(["train", "--config", str(config)]) == (
        "gradmesh train: error: --warmup-epochs: options of --lr-scaling linear (the warm-up "
        "rises to the scaled rate); this run keeps --lr (--lr-scaling none)"
    )


BENCHES_ON_EMULATED_LINKS = (
    "allreduce",
    "compression",
    "dataparallel",
    "horovod-synthetic",
    "layout",
    "plan",
    "ps",
)


@pytest.mark.parametrize("bench", BENCHES_ON_EMULATED_LINKS)
def test_a_benchmarks_link_rate_without_emulated_hosts_is_one_line(
    bench: str, cli_line: Callable[..., str]
) -> None:
    """Without --emulate-hosts a benchmark runs on loopback: a --bandwidth would be read by
    nothing, and its figures taken for that rate's."""
    assert cli_line(["bench", bench, "--bandwidth", "10mbit"]) == (
        "gradmesh bench: error: --bandwidth: the emulated hosts' link rate; without "
        "--emulate-hosts this runs on loopback"
    )


@pytest.mark.parametrize("bench", BENCHES_ON_EMULATED_LINKS)
def test_a_benchmarks_link_rate_passes_with_emulated_hosts(bench: str) -> None:
    import importlib

    from gradmesh.bench.harness import check_link
    from gradmesh.cli import BENCHES

    config = importlib.import_module(BENCHES[bench][1]).Config
    hosts = True if bench == "ps" else 2  # one host each (a switch), or H hosts
    check_link(config(emulate_hosts=hosts, bandwidth="10mbit"))


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--latency", "1ms"], "--latency: not read by a plan on this host's loopback"),
        (
            ["--probe", "--bandwidth", "1gbit"],
            "--bandwidth: not read by a plan on --probe, which measures loopback",
        ),
        (
            ["--emulate-hosts", "2", "--ranks-per-host", "2"],
            "--ranks-per-host: not read by a plan on --emulate-hosts",
        ),
        (["--top", "3"], "--top: options of a mesh plan; model mlp is a sequence of layers"),
        (["--layouts", "dp"], "--layouts: options of --memory"),
    ],
)
def test_a_plan_option_the_planning_would_not_read_is_one_line(
    flags: list[str], message: str, cli_line: Callable[..., str]
) -> None:
    assert message in cli_line(["plan", "--model", "mlp", "--workers", "2", *flags])


def test_plan_memory_refuses_the_planning_options(cli_line: Callable[..., str]) -> None:
    said = cli_line(["plan", "--memory", "--model", "gpt", "--memory-limit", "1GB"])
    assert said.endswith(
        "--memory-limit: not read by --memory, which counts bytes and plans nothing"
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["ps", "--micro", "--servers", "2"], "--servers: not read by --micro"),
        (["ps", "--seconds", "0.5"], "--seconds: options of --micro"),
        (["memory", "--layouts", "dp"], "--layouts: options of a --world job (2 or more ranks)"),
        (["memory", "--world", "2", "--modes", "blocks"], "--modes: options of one process"),
        (["loader", "--file", "x.bin", "--tokens", "1000"], "--tokens: the size of the file"),
        (["layout", "--layouts", "dp,tp2", "--microbatches", "4"], "--microbatches: options of"),
        (["layout", "--layouts", "dp,pp2i", "--schedule", "gpipe"], "--schedule: the schedule of"),
        (["layout", "--layouts", "dp,pp2", "--virtual-stages", "3"], "--virtual-stages: the inte"),
        (
            ["compression", "--engines", "none,int8", "--ratio", "0.1"],
            "--ratio: topk's option; --engines none,int8 has none that reads it",
        ),
        (
            ["compression", "--engines", "none,topk", "--rank", "2"],
            "--rank: powersgd's option; --engines none,topk has none that reads it",
        ),
    ],
)
def test_a_benchmarks_option_its_mode_would_not_read_is_one_line(
    flags: list[str], message: str, cli_line: Callable[..., str]
) -> None:
    assert message in cli_line(["bench", *flags])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["diloco", "--outer-lr", "0"], "--outer-lr must be > 0"),
        (["compression", "--momentum", "2"], "--momentum must be in [0, 1), got 2.0"),
        (["overhead", "--lr", "-1"], "--lr must be > 0, got -1.0"),
        # counts under 1: tracebacks (a division by zero, a median of nothing) or runs of nothing
        (["hogwild", "--epochs", "0"], "--epochs must be >= 1, got 0"),
        (["checkpoint", "--every", "0"], "--every must be >= 1, got 0"),
        (["allreduce", "--warmup", "-1"], "--warmup must be >= 0, got -1"),
        (["memory", "--rounds", "0"], "--rounds must be >= 1, got 0"),
        (["layout", "--microbatches", "0"], "--microbatches must be >= 1, got 0"),
        (["loader", "--batch", "-1"], "--batch must be >= 1, got -1"),
        (["compression", "--target", "0"], "--target is a test accuracy: in (0, 1], got 0.0"),
        (["diloco", "--compression", "nosuch"], "unknown compressor 'nosuch'"),
        (["replicas", "--methods", "none,nosuch"], "unknown compressor 'nosuch'"),
        (["replicas", "--methods", "none,diloco:0:int8"], "--sync-every must be >= 1"),
    ],
)
def test_a_benchmarks_bad_job_option_is_one_line_before_its_first_job(
    flags: list[str], message: str, cli_line: Callable[..., str]
) -> None:
    """Each of these once failed after the benchmark had started: a job after the other jobs
    had run for minutes, or torch's optimizer in a traceback (or never, with a momentum of 2).
    The jobs' `gradmesh train` flags are now checked first, as `gradmesh train` checks them."""
    assert message in cli_line(["bench", *flags])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--batch", "0"], "--batch must be >= 1, got 0"),
        (["--tensor-parallel-max", "-1"], "--tensor-parallel-max must be >= 1, got -1"),
        (["--emulate-hosts", "0"], "--emulate-hosts must be >= 1, got 0"),
        (["--memory", "--model", "gpt", "--workers", "0"], "--workers must be >= 1, got 0"),
        (["--memory", "--model", "gpt", "--sequence-length", "0"], "--sequence-length must be"),
    ],
)
def test_a_plans_count_under_one_is_one_line(
    flags: list[str], message: str, cli_line: Callable[..., str]
) -> None:
    """Once a traceback (a negative tensor dimension, an empty min(), a division by zero) or a
    plan of nothing (0 taken for not given)."""
    assert message in cli_line(["plan", "--model", "mlp", *flags])
