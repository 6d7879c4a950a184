"""The tests' `gradmesh` runs forked from the zygote (tests/zygote.py) end as a new interpreter's
would, and what a run leaves behind or a run that overstays is caught, not lost."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from tests.zygote import ZYGOTE, gradmesh

SLEEP = "import time; time.sleep(60)"
SLEEPER = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {SLEEP!r}])"


def all_ended() -> bool:
    """Whether the zygote's children have all ended (a killed one is reaped within 0.05 s)."""
    assert ZYGOTE.proc is not None
    deadline = time.monotonic() + 5
    while psutil.Process(ZYGOTE.proc.pid).children():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_fork_answers_as_a_new_interpreter_does() -> None:
    args = ("train", "--workers", "0")
    forked, fresh = gradmesh(*args), gradmesh(*args, fresh=True)
    assert forked.returncode == fresh.returncode == 2
    assert forked.stderr == fresh.stderr and forked.stdout == fresh.stdout == ""
    assert "--workers must be >= 1" in forked.stderr
    done = gradmesh("run", "-np", "1", "--", sys.executable, "-c", "print('fine'); exit(3)")
    assert done.returncode != 0 and "fine" in done.stdout


def test_what_a_fork_cannot_honour_runs_fresh() -> None:
    same = dict(os.environ)
    assert ZYGOTE.forks(same)
    assert not ZYGOTE.forks({**same, "OMP_NUM_THREADS": "2"})  # torch reads it at import
    assert not ZYGOTE.forks({**same, "PYTHONPATH": "/elsewhere"})
    assert ZYGOTE.forks({**same, "GRADMESH_FAULT": "kill:0:3"})  # read by the run itself


def test_a_process_a_run_leaves_behind_fails_it_and_is_ended() -> None:
    with pytest.raises(AssertionError, match="left processes behind: .*time.sleep"):
        gradmesh("run", "-np", "1", "--", sys.executable, "-c", SLEEPER)
    assert all_ended()


def test_a_run_past_its_timeout_is_ended_with_everything_it_started() -> None:
    with pytest.raises(subprocess.TimeoutExpired):
        gradmesh("run", "-np", "1", "--", sys.executable, "-c", SLEEP, timeout=3)
    assert all_ended()
