"""SIGTERM from a launcher gives a worker a grace period to report a failure and exit with its
own code, then ends it by SIGTERM even when it is stuck: real processes, real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

PRELUDE = """
import sys, time
from gradmesh.runtime.ending import finish_reports_on_stop
assert finish_reports_on_stop(grace_s=GRACE)
"""

BUSY = "print('ready', flush=True)\nwhile True: sum(range(1000))\n"
REPORTS = """
print("ready", flush=True)
try:
    time.sleep(REPORT)  # on its way to the collective that fails
    raise RuntimeError("receive from rank 1 failed")
except RuntimeError as e:
    print(f"reported: {e}", file=sys.stderr, flush=True)
    sys.exit(75)
"""


def _stop(body: str, grace_s: float, report_s: float = 0.0) -> tuple[int, str, float]:
    """Start `body`, SIGTERM it once it says ready; its exit code, stderr and seconds to end."""
    code = PRELUDE.replace("GRACE", str(grace_s)) + body.replace("REPORT", str(report_s))
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    return proc.returncode, err, time.monotonic() - started


def test_a_rank_reports_its_failure_and_exits_with_its_own_code_within_the_grace() -> None:
    code, err, took = _stop(REPORTS, grace_s=30.0, report_s=0.5)
    assert "reported: receive from rank 1 failed" in err
    assert code == 75
    assert took < 15


@pytest.mark.parametrize("body", [BUSY, REPORTS], ids=["busy", "stuck-before-its-report"])
def test_a_rank_that_does_not_end_by_itself_ends_by_sigterm_after_the_grace(body: str) -> None:
    code, err, took = _stop(body, grace_s=1.0, report_s=60.0)
    assert code == -signal.SIGTERM
    assert "reported" not in err
    assert 0.9 < took < 30


def test_it_stays_out_of_a_process_that_handles_sigterm_itself() -> None:
    code = (
        "import signal\nfrom gradmesh.runtime.ending import finish_reports_on_stop\n"
        "signal.signal(signal.SIGTERM, lambda *a: None)\n"
        "assert not finish_reports_on_stop()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_rank_pausing_after_its_report_leaves_at_once_on_sigterm() -> None:
    """`exit_process(75)` pauses so that the launcher sees the rank that failed first end first;
    the launcher's SIGTERM says it has, and the pause ends with the rank's own code (a restart
    waits for it). The pause is made 30 s here, so ending by it could not pass."""
    body = (
        "import gradmesh.runtime.ending as ending\n"
        "ending.PEER_GRACE_S = 30.0\n"
        "print('ready', flush=True)\n"
        "ending.exit_process(75)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", PRELUDE.replace("GRACE", "30.0") + body],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    time.sleep(1.0)  # inside the pause by now (two lines after the print)
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 75
    assert time.monotonic() - started < 15


def test_interrupt_once_leaves_a_thread_alone() -> None:
    """Ray runs each rank's worker in a thread, where Python refuses signal handlers: the
    worker once failed there before training."""
    import threading

    from gradmesh.runtime.ending import interrupt_once

    failed: list[BaseException] = []

    def run() -> None:
        try:
            interrupt_once()
        except BaseException as exc:  # noqa: BLE001 - the test's verdict
            failed.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert not failed


@pytest.mark.parametrize(("kind", "code"), [("GradmeshError", 1), ("PeerFailure", 75)])
def test_a_benchmark_worker_s_bad_input_is_one_line_naming_its_rank(kind: str, code: int) -> None:
    """A benchmark's worker module (`jobs.worker_main`) that meets bad input its launcher could
    not see says so in one line naming its rank and exits 1, no traceback; a peer's failure
    exits 75, so that the launcher names the rank that caused it."""
    program = (
        "import sys\n"
        "sys.argv = ['w', '--config', '{}', '--out', 'unused.json']\n"
        f"from gradmesh.errors import {kind}\n"
        "from gradmesh.launch.jobs import worker_main\n"
        "def measure(config):\n"
        f"    raise {kind}('layout x: not this one')\n"
        "worker_main(measure)\n"
    )
    env = {**os.environ, "RANK": "3"}
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == code
    assert done.stderr == "gradmesh: rank 3: layout x: not this one\n"
