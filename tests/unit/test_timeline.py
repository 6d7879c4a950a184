"""The timeline's pieces without a job: the ring of steps, the clock read from rank 0."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import pytest

from gradmesh.observe.timeline import Timeline, _answer_time, measure_offset, write_trace
from tests.harness import CLI


def test_a_timeline_keeps_its_setup_and_its_last_steps(tmp_path: Path) -> None:
    timeline = Timeline(tmp_path / "t.json", 0, "rank 0", max_steps=2)
    now = time.perf_counter()
    timeline.add("load", "io", now, now + 0.001)
    for step in range(5):
        timeline.new_step()
        timeline.add("forward", "compute", now, now + 0.002, step=step)
    path = timeline.save()
    trace = json.loads(path.read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in spans] == ["load", "forward", "forward"]
    assert [e["args"]["step"] for e in spans[1:]] == [3, 4]
    other = trace["otherData"]
    assert other["kept"] == "the last 2 steps of each process"
    assert other["steps"] == {"0": 5} and other["dropped_steps"] == {"0": 3}


def test_the_clock_offset_is_read_within_its_uncertainty() -> None:
    """A responder whose clock starts 5 s before this process's perf_counter reads: the offset
    measured is its origin's, give or take the uncertainty reported."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()
    origin = time.perf_counter() - 5.0
    threading.Thread(target=_answer_time, args=(listener, origin, stop), daemon=True).start()
    offset, uncertainty = measure_offset("127.0.0.1", listener.getsockname()[1], 5.0)
    stop.set()
    assert 0 < uncertainty < 0.01
    assert abs(offset - (-origin)) <= uncertainty + 1e-4


def test_a_merged_trace_names_processes_and_threads(tmp_path: Path) -> None:
    parts = [
        {
            "pid": pid,
            "name": f"server {pid}",
            "events": [
                {"name": "apply", "cat": "serve", "ph": "X", "tid": tid, "ts": 1.0, "dur": 2.0}
            ],
            "start_us": 0.0,
            "uncertainty_us": 3.0,
            "steps": 1,
            "dropped_steps": 0,
        }
        for pid, tid in ((1, "serving"), (0, "communication"))
    ]
    write_trace(tmp_path / "m.json", parts, 0, [2])
    trace = json.loads((tmp_path / "m.json").read_text())
    meta = [(e["pid"], e["name"], e["args"]) for e in trace["traceEvents"] if e["ph"] == "M"]
    assert (0, "process_name", {"name": "server 0"}) in meta
    assert (1, "thread_name", {"name": "serving"}) in meta
    assert (0, "thread_name", {"name": "communication"}) in meta
    assert trace["otherData"]["missing_ranks"] == [2]
    assert trace["otherData"]["kept"] == "every step"


def test_report_refuses_what_is_neither_a_report_nor_a_timeline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], cli: CLI
) -> None:
    cases = {
        "text.json": ("not json", "is not JSON"),
        "list.json": ("[1, 2]", "is not a gradmesh run report (gradmesh train --json) or timeline"),
        "empty.json": ('{"traceEvents": []}', "the timeline has no spans to plot"),
    }
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        assert cli(["report", str(tmp_path / name), "--plot", str(tmp_path / "p.png")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    assert cli(["report", str(tmp_path / "missing.json")]) == 2
    assert "cannot read" in capsys.readouterr().err
