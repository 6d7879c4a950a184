"""`gradmesh train --strategy ps` end to end: servers and workers through the real launcher."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

import psutil
import pytest

from tests.integration.test_cli import (
    GRADMESH,
    ROOT,
    gradmesh,
    merged_trace_spans,
    tensorboard_scalars,
)


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_async_and_ssp_learn_digits_at_the_defaults(mode: str, tmp_path: Path) -> None:
    """Default hyperparameters (a gradient's step is lr / W: docs/parameter_server.md); ssp at
    this seed measured 0.961-0.983 over 10 runs (4 beside two busy cores), but asynchronous order
    is not seeded and fresh-clone CI runs, beside another test worker, gave 0.947 and 0.925; 0.85
    keeps 7.5 points below the lowest seen (chance is 0.1)."""
    out = gradmesh(
        "train",
        "--strategy=ps",
        "--servers=2",
        "--workers=2",
        f"--mode={mode}",
        "--seed=1",
        f"--timeline={tmp_path / 'trace.json'}",
        f"--tensorboard={tmp_path / 'tb'}",
        "--json",
        str(tmp_path / "r.json"),
    )
    assert out.returncode == 0, out.stderr
    got = json.loads((tmp_path / "r.json").read_text())
    info = got["strategy_info"]
    assert got["test_accuracy"] >= 0.85
    assert info["mode"] == mode and info["lost_workers"] == []
    assert len(info["server_stats"]) == 2
    for server in info["server_stats"]:
        assert server["bytes_in"] > 0 and server["bytes_out"] > 0 and server["request_rate"] > 0
        assert server["dropped_messages"] == 0
    if mode == "ssp":
        worst = max(int(s) for h in info["staleness_histogram"].values() for s in h)
        assert worst <= 2  # the default bound
    # one trace for the job: servers and workers, every applied gradient's staleness
    trace = json.loads((tmp_path / "trace.json").read_text())
    names = {0: "server 0", 1: "server 1", 2: "worker 0", 3: "worker 1"}
    spans = merged_trace_spans(trace, names)
    for server in (0, 1):
        applied = [e for e in spans[server] if e["name"] == "apply"]
        assert applied and all("staleness" in e["args"] for e in applied)
        assert {e["name"] for e in spans[server]} >= {"apply", "pull"}
    for worker in (2, 3):  # and each worker's timeline the staleness of every pull
        pulls = [e for e in spans[worker] if e["name"] == "pull"]
        assert pulls and all("staleness" in e["args"] for e in pulls)
        assert {"forward", "backward"} <= {e["name"] for e in spans[worker]}
    # TensorBoard: worker 0's steps, each server's request rate, the staleness histogram
    scalars = tensorboard_scalars(tmp_path / "tb")
    for server in info["server_stats"]:
        (rate,) = scalars[f"ps/request_rate_server{server['server']}"]
        assert rate.value == pytest.approx(server["request_rate"])
    (staleness,) = scalars["ps/staleness"]
    applied = sum(int(n) for h in info["staleness_histogram"].values() for n in h.values())
    assert staleness.histogram_value.num == applied > 0
    steps = [s.step for s in scalars["loss/rank0_step"]]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 20


def _training_workers(root: psutil.Process) -> dict[int, psutil.Process]:
    found = {}
    for proc in root.children(recursive=True):
        try:
            if "gradmesh.train.worker" in " ".join(proc.cmdline()):
                found[int(proc.environ()["GRADMESH_PS_WORKER"])] = proc
        except (psutil.NoSuchProcess, psutil.AccessDenied, KeyError):
            continue
    return found


def _lines(stream: IO[str]) -> tuple[list[str], threading.Thread]:
    """Read `stream` to its end in a thread, line by line, into the list returned."""
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(stream.readline, "")), daemon=True)
    reader.start()
    return lines, reader


def test_a_killed_async_worker_does_not_stop_the_job(tmp_path: Path) -> None:
    """Worker 2 is killed after its first epoch (so the server has heard it: it is lost after
    `lost_after_s`; a worker killed before its first message, which a CPU-time cue once let
    happen on a slow CI machine, is given the whole start-up timeout)."""
    report = tmp_path / "r.json"
    args = [
        "--strategy=ps",
        "--servers=1",
        "--workers=3",
        "--mode=async",
        "--epochs=80",
        "--staleness-lr",
        # a live worker's silence on a busy 2-core CI machine reached 2 s: it was declared
        # lost, the job ended without it and its next push failed; 10 s keeps a margin
        "--lost-after-s=10",
    ]
    job = subprocess.Popen(
        [*GRADMESH, "train", *args, "--json", str(report)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert job.stdout is not None and job.stderr is not None
    (out_lines, out_reader), (err_lines, err_reader) = _lines(job.stdout), _lines(job.stderr)
    try:
        deadline = time.monotonic() + 120
        victim_epoch = "[3] epoch 1/"  # launcher rank 3 = the one server, then workers 0, 1, 2
        while not any(line.startswith(victim_epoch) for line in list(err_lines)):
            assert job.poll() is None and time.monotonic() < deadline, "".join(err_lines[-30:])
            time.sleep(0.1)
        workers = _training_workers(psutil.Process(job.pid))
        assert sorted(workers) == [0, 1, 2], "the three training workers are not running"
        workers[2].kill()
        job.wait(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
        out_reader.join(timeout=10)
        err_reader.join(timeout=10)
    out, err = "".join(out_lines), "".join(err_lines)
    # the servers' lines (a worker declared lost, the summary) are on stdout
    assert job.returncode == 0, f"{out[-2000:]}\n{err[-3000:]}"
    assert "worker 2" in err and "killed by SIGKILL" in err
    lost = re.search(r"worker 2 lost \(silent for (\d+) s\)", out)
    assert lost and int(lost.group(1)) < 30, out  # lost_after_s (10 s), not the 60 s timeout
    got = json.loads(report.read_text())
    assert got["strategy_info"]["lost_workers"] == [2]
    assert got["test_accuracy"] > 0.9


def test_ps_options_are_checked_before_launch(cli_line: Callable[..., str]) -> None:
    assert "unknown --mode 'fast'" in cli_line(["train", "--strategy=ps", "--mode=fast"])
    assert "--mode sync pushes and pulls every step" in cli_line(
        ["train", "--strategy=ps", "--mode=sync", "--push-every=2"]
    )
    assert "unknown --server-optimizer 'sgdd'" in cli_line(
        ["train", "--strategy=ps", "--server-optimizer=sgdd"]
    )


def test_the_script_example_serves_and_trains_through_gradmesh_run() -> None:
    out = gradmesh("run", "-np", "3", "--", sys.executable, "examples/ps_digits.py")
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if "test accuracy" in x)
    # asynchronous (ssp): 0.967-0.981 over 5 runs, but the default job's ssp has dipped to 0.925
    # on CI beside another test worker; 0.85 keeps the same margin as test_async_and_ssp_...
    assert float(line.split("test accuracy ")[1].split()[0]) >= 0.85
    staleness = line.split("staleness ")[1]
    assert "'3'" not in staleness  # ssp with K = 2
