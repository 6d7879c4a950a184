"""Fixtures every test gets: no process may outlive the test that started it."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

TAG = "GRADMESH_TEST_TAG"


def tagged_processes(tag: str) -> list[int]:
    """PIDs (other than ours) whose environment carries `TAG=tag`."""
    needle = f"{TAG}={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:  # gone, or not ours to read
            continue
    return found


@pytest.fixture(scope="session", autouse=True)
def rank_forkserver() -> None:
    """The long-lived process the test harness forks ranks from, started before any test."""
    from tests.harness import start_forkserver

    start_forkserver()


def our_temp_dirs() -> set[str]:
    """Launcher log folders and emulated-host temp folders in the temp directory."""
    import glob
    import tempfile

    root = tempfile.gettempdir()
    return {*glob.glob(f"{root}/gradmesh-run-*"), *glob.glob(f"{root}/gmesh-*")}


def emulated_namespaces() -> set[str]:
    from gradmesh.launch import emulate

    return set(emulate.our_namespaces()) if emulate.missing_capability() is None else set()


@pytest.fixture(autouse=True)
def no_leaked_processes() -> Iterator[str]:
    """Tag every process a test starts; fail (and kill them) if any is alive afterwards, and
    fail if the test left an emulated host's namespace behind."""
    tag = uuid.uuid4().hex
    namespaces_before = emulated_namespaces()
    temp_before = our_temp_dirs()
    previous = os.environ.get(TAG)
    os.environ[TAG] = tag
    try:
        yield tag
    finally:
        if previous is None:
            del os.environ[TAG]
        else:
            os.environ[TAG] = previous
    deadline = time.monotonic() + 5.0  # a process that was just told to exit may take a moment
    while (leaked := tagged_processes(tag)) and time.monotonic() < deadline:
        time.sleep(0.1)
    children = [p for p in multiprocessing.active_children() if p.is_alive()]
    for pid in leaked:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for child in children:
        child.kill()
    left_namespaces = emulated_namespaces() - namespaces_before
    for name in left_namespaces:
        subprocess.run(["ip", "netns", "del", name], check=False)
    left_temp = our_temp_dirs() - temp_before
    assert not leaked, f"processes left behind by the test: {leaked}"
    assert not left_temp, f"temporary folders left behind: {sorted(left_temp)}"
    assert not left_namespaces, f"network namespaces left behind: {sorted(left_namespaces)}"
    assert not children, f"child processes left behind by the test: {children}"
