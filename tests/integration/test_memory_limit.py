"""The per-rank memory limit the memory benchmark enforces (`gradmesh.launch.cgroup`): a process
that goes over its cgroup's limit is killed by the kernel and the kill is counted; one under it
runs, its peak read back; bad limits are one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable

import pytest

from gradmesh.launch import cgroup

ALLOCATE = """
import sys
from gradmesh.launch.cgroup import join
join(sys.argv[1])
block = bytearray(int(sys.argv[2]) << 20)  # zero pages: touched, so charged
block[:: 4096] = b"x" * len(block[:: 4096])
"""


@pytest.mark.skipif(cgroup.problem() is not None, reason=f"{cgroup.problem()}")
def test_a_process_over_its_limit_is_killed_and_counted_and_one_under_it_is_not() -> None:
    name = f"gmesh-test-{os.getpid()}"
    outcomes = []
    for mib in (256, 16):  # against a 128 MiB limit
        cgroup.create(name, 128 << 20)
        try:
            proc = subprocess.run([sys.executable, "-c", ALLOCATE, name, str(mib)], timeout=60)
            outcomes.append((proc.returncode, cgroup.usage(name)))
        finally:
            cgroup.remove(name)
    (over, over_use), (under, under_use) = outcomes
    assert over == -signal.SIGKILL and over_use["oom_kills"] >= 1
    assert under == 0 and under_use["oom_kills"] == 0
    assert 16 << 20 <= under_use["peak_bytes"] < 128 << 20


def test_a_bad_memory_limit_is_one_line(cli_line: Callable[..., str]) -> None:
    said = cli_line(["bench", "memory", "--world", "2", "--limit", "lots"])
    assert said.endswith("bad size 'lots': expected a number with KB, MB or GB, like 4MB")
    said = cli_line(["bench", "memory", "--limit", "1GB"])
    assert said.endswith("--limit holds each rank of a --world job: give --world 2 or more")


def test_a_context_parallel_layout_the_sequence_does_not_fit_is_one_line_before_launch(
    cli_line: Callable[..., str],
) -> None:
    """Checked as the trainer checks it, not found by every rank in a traceback."""
    flags = ["--world", "4", "--layouts", "dp,dpxcp4", "--sequence-length", "100"]
    said = cli_line(["bench", "memory", *flags])
    assert said.endswith(
        "layout dpxcp4: sequence of 100 tokens cannot be cut into 2 x --context-parallel 4 = "
        "8 equal chunks (context-parallel sizes that fit: 1, 2, 5, 10, 25, 50)"
    )
