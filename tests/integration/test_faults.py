"""Faults end to end: a worker killed with SIGKILL at a random step, the launcher restarting the
job, every rank resuming from its part of the newest complete checkpoint, and the outcome
bit-equal to a run that was never interrupted."""

from __future__ import annotations

import json
import os
import random
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.zygote import gradmesh

SMALL = ["--epochs", "2", "--checkpoint-every", "4", "--keep-checkpoints", "2"]
STEPS = 2 * 23  # digits: 1437 training samples, global batch 64


def train(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return gradmesh("train", *args, env=env, timeout=180)


def final_state(folder: Path) -> list[dict[str, torch.Tensor]]:
    """Every rank's model part (a parameter server's shard) in the newest complete checkpoint
    of `folder`."""
    newest = max(p for p in folder.iterdir() if (p / "meta.json").is_file())
    parts = sorted(newest.glob("rank-*.pt"))
    return [torch.load(part, weights_only=True)["model"] for part in parts]


@pytest.mark.parametrize(
    "case",
    [
        ["--compression", "int8", "--checkpoint-async"],
        # local SGD's Averager with DiLoCo's outer momentum on top: anchors, top-k residuals
        # and the outer SGD's state all come back
        ["--strategy", "diloco", "--sync-every", "3", "--compression", "topk"],
        ["--workers", "4", "--tensor-parallel", "2", "--pipeline-parallel", "2", "--model", "mlp"]
        + ["--microbatches", "2"],
        ["--strategy", "ps", "--mode", "sync"],
        # each replica of a stage writes its part of the stage's AdamW state, and loads it back
        ["--workers", "4", "--pipeline-parallel", "2", "--microbatches", "2", "--model", "mlp"]
        + ["--zero-stage", "1", "--optimizer", "adamw", "--lr", "0.001"],
    ],
    ids=[
        "allreduce-int8-async",
        "diloco-topk",
        "tensor-and-pipeline-parallel",
        "ps-sync",
        "zero-1-pipeline",
    ],
)
def test_a_worker_killed_at_a_random_step_recovers_bit_identically(
    case: list[str], tmp_path: Path
) -> None:
    """A parameter-server job loses its server (rank 0) instead: after its update of step S,
    before the workers could finish step S."""
    workers = int(case[case.index("--workers") + 1]) if "--workers" in case else 2
    ps = "ps" in case
    rank, step = 0 if ps else random.randrange(workers), random.randrange(1, STEPS)
    done = step - 1 if ps else step
    fault = f"kill:{rank}:{step}"
    clean = train(
        *SMALL, *case, "--checkpoint-dir", str(tmp_path / "a"), "--json", str(tmp_path / "a.json")
    )
    assert clean.returncode == 0, clean.stderr
    faulty = train(
        *SMALL,
        *case,
        "--max-restarts",
        "3",
        "--checkpoint-dir",
        str(tmp_path / "b"),
        "--json",
        str(tmp_path / "b.json"),
        env={"GRADMESH_FAULT": fault},
    )
    assert faulty.returncode == 0, f"{fault}: {faulty.stderr}"
    # a rank that lost its peer says so in a line, if the launcher did not stop it first
    assert "Traceback" not in faulty.stderr, faulty.stderr
    a = json.loads((tmp_path / "a.json").read_text())
    b = json.loads((tmp_path / "b.json").read_text())
    assert b["faults"]["restarts"] == 1, fault
    resumed = b["faults"]["resumed_from_step"]
    # the newest complete checkpoint: at most 4 steps back, 8 when the latest asynchronous
    # write was still in flight; rank 0 may have run up to 3 steps further (local SGD's
    # ranks meet every 3 steps), and the steps redone count from the furthest it reached
    assert resumed < step and done - resumed <= 8, fault
    assert 0 <= b["faults"]["steps_redone"] - (done - resumed) <= 3, fault
    assert b["loss_history"] == a["loss_history"], fault
    assert b["test_accuracy"] == a["test_accuracy"], fault
    for mine, theirs in zip(final_state(tmp_path / "a"), final_state(tmp_path / "b"), strict=True):
        assert mine.keys() == theirs.keys()
        for name in mine:
            assert torch.equal(mine[name], theirs[name]), f"{fault}: {name}"
    assert len([p for p in (tmp_path / "b").iterdir() if p.name.startswith("step-")]) == 2


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-restarts", "-1"], "--max-restarts must be >= 0, got -1"),
        (["--checkpoint-every", "0", "--checkpoint-dir", "x"], "--checkpoint-every must be >= 1"),
        (["--checkpoint-every", "5"], "--checkpoint-every needs --checkpoint-dir"),
        (["--keep-checkpoints", "0"], "--keep-checkpoints must be >= 1, got 0"),
        (["--strategy", "ps", "--max-restarts", "1"], "a ps job need --mode sync"),
    ],
)
def test_bad_fault_options_are_one_line(
    flags: list[str], message: str, cli_line: Callable[..., str]
) -> None:
    line = cli_line(["train", *flags])
    assert line.startswith("gradmesh train: error: ") and message in line


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--strategy", "local-sgd"], "needs --strategy allreduce without compression"),
        (["--compression", "int8"], "needs --strategy allreduce without compression"),
        (["--tensor-parallel", "2", "--model", "mlp"], "tensor and pipeline parallelism"),
        ([], "give it --checkpoint-dir and --max-restarts >= 1"),
    ],
)
def test_an_elastic_job_refuses_what_it_cannot_resume(
    flags: list[str], message: str, cli_line: Callable[..., str]
) -> None:
    """Under --nnodes MIN:MAX (here from the variable gradmesh emulate sets on each host)."""
    line = cli_line(["train", *flags], GRADMESH_NNODES="2:4", GRADMESH_NODE_RANK="0")
    assert line.startswith("gradmesh train: error: an elastic job") and message in line


def test_spent_restarts_a_rerun_a_torn_checkpoint_and_another_run(
    tmp_path: Path, cli_line: Callable[..., str]
) -> None:
    """Without restarts a killed worker ends the job, naming it; the same command resumes from
    the checkpoint it left; a torn newest checkpoint falls back to the one before it; another
    run's checkpoints are refused."""
    out = train(*SMALL, "--checkpoint-dir", str(tmp_path), env={"GRADMESH_FAULT": "kill:1:10"})
    assert out.returncode == 137
    assert "gradmesh run: rank 1 was killed by signal SIGKILL; the job was stopped" in out.stderr
    again = train(*SMALL, "--checkpoint-dir", str(tmp_path), "--json", str(tmp_path / "r.json"))
    assert again.returncode == 0, again.stderr
    faults = json.loads((tmp_path / "r.json").read_text())["faults"]
    assert (faults["resumed_from_step"], faults["steps_redone"], faults["restarts"]) == (8, 2, 0)
    newest, previous = sorted(p for p in tmp_path.iterdir() if p.name.startswith("step-"))[::-1]
    torn = newest / "rank-00001.pt"
    torn.write_bytes(torn.read_bytes()[:100])
    # one epoch more, checkpoints at the default cadence (after each epoch, and the last step)
    more = ["--epochs", "3", "--keep-checkpoints", "2"]
    third = train(*more, "--checkpoint-dir", str(tmp_path), "--json", str(tmp_path / "r.json"))
    assert third.returncode == 0, third.stderr
    warning = f"warning: cannot load checkpoint {torn}: "
    assert warning in third.stderr and f"falling back to {previous.name}" in third.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["faults"]["resumed_from_step"] == int(previous.name.split("-")[1])
    assert len(report["loss_history"]) == 3
    kept = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-"))
    assert kept == [f"step-{STEPS:08d}", f"step-{STEPS * 3 // 2:08d}"]
    other = cli_line(["train", *SMALL, "--workers", "3", "--checkpoint-dir", str(tmp_path)])
    assert other.endswith(
        "belongs to another run: workers=2 (now 3) (--reshard resumes it in this layout)"
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_full_disk_ends_the_job_naming_the_file_and_leaves_no_checkpoint(
    tmp_path: Path,
) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", str(disk)], check=True)
    try:
        out = train(*SMALL, "--checkpoint-dir", str(disk / "ck"))
        assert out.returncode != 0 and "Traceback" not in out.stderr
        assert f"cannot write checkpoint {disk}/ck/step-00000004/rank-0000" in out.stderr
        assert "No space left on device" in out.stderr
        assert not list((disk / "ck").glob("step-*/meta.json"))
        assert not list((disk / "ck").rglob("*.tmp"))
    finally:
        subprocess.run(["umount", str(disk)], check=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_an_unwritable_folder_is_refused_before_launch(
    tmp_path: Path, cli_line: Callable[..., str]
) -> None:
    """As root every folder passes os.access: a read-only mount is what root cannot write."""
    disk = tmp_path / "ro"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(disk)], check=True)
    try:
        line = cli_line(["train", "--checkpoint-dir", str(disk / "ck")])
        assert line == (
            f"gradmesh train: error: --checkpoint-dir {disk}/ck cannot be created: "
            "Read-only file system"
        )
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_straggler_is_named_in_the_report(tmp_path: Path) -> None:
    out = train(
        "--epochs",
        "1",
        "--workers",
        "3",
        "--json",
        str(tmp_path / "r.json"),
        env={"GRADMESH_FAULT": "slow:2:40"},  # 15 ms was within noise of a step here (1.97x once)
    )
    assert out.returncode == 0, out.stderr
    slowest = json.loads((tmp_path / "r.json").read_text())["slowest"]
    assert slowest["rank"] == 2 and slowest["ratio_to_median"] > 2
    assert f"straggler: rank 2 computed {slowest['compute_s']:.2f} s" in out.stdout


def test_bench_checkpoint_measures_sizes_stalls_and_a_restart(tmp_path: Path) -> None:
    out = gradmesh(
        *("bench", "checkpoint", "--model", "cnn", "--rounds", "1", "--epochs", "1"),
        *("--modes", "async", "--json", str(tmp_path / "b.json")),
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads((tmp_path / "b.json").read_text())
    assert result["restart_ok"] and result["restart_to_first_step_s"] > 0
    assert result["checkpoint_bytes"] == 2 * result["rank_file_bytes"] > 0
    assert set(result["modes"]) == {"none", "async"}  # the synchronous save: the bench's default
    entry = result["modes"]["async"]
    assert entry["saves"] == 5 and entry["stall_s_median"] > 0
    assert entry["limit"] in ("cpu", "disk-or-compute")
    assert "restart to first step" in out.stdout
