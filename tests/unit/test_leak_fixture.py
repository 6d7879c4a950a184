"""The leak fixture blames a test only for what it (or its processes) left behind, not for the
folders of another gradmesh job on the same machine."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.conftest import foreign, our_temp_dirs


def test_foreign_folders_are_ignored_and_ours_are_caught(tmp_path: Path) -> None:
    other = os.getppid()  # alive, and no process of this test: another job's
    exited = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead = int(exited.stdout)  # one of the test's own, gone
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        before = our_temp_dirs(str(tmp_path))
        expected = {  # folder -> whether it is another job's
            tempfile.mkdtemp(prefix=f"gradmesh-run-{other}x-", dir=tmp_path): True,
            tempfile.mkdtemp(prefix=f"gmesh-{other}x1f2e-tmp-", dir=tmp_path): True,
            # the launcher run in this process (the `cli` fixture)
            tempfile.mkdtemp(prefix=f"gradmesh-run-{os.getpid()}x-", dir=tmp_path): False,
            tempfile.mkdtemp(prefix=f"gradmesh-run-{child.pid}x-", dir=tmp_path): False,
            tempfile.mkdtemp(prefix=f"gmesh-{dead}x1f2e-tmp-", dir=tmp_path): False,
        }
        older = tempfile.mkdtemp(prefix="gradmesh-run-", dir=tmp_path)  # no owner: older gradmesh
        new = our_temp_dirs(str(tmp_path)) - before
        assert new == set(expected) and older not in new
        assert {d: foreign(d, [child.pid]) for d in new} == expected
    finally:
        child.kill()
        child.wait()
