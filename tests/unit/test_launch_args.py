"""Launcher input checks that need no processes."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from gradmesh.errors import GradmeshError
from gradmesh.launch.run import LaunchSpec, _check, parse_master, parse_nnodes, resolve_command


def test_parse_master_forms() -> None:
    assert parse_master("10.0.0.5:1234", 2) == ("10.0.0.5", 1234)
    assert parse_master("node0", 2) == ("node0", 29500)
    host, port = parse_master(None, 1)
    assert host == "127.0.0.1" and 0 < port < 65536
    with pytest.raises(GradmeshError, match="--master HOST"):
        parse_master(None, 2)
    with pytest.raises(GradmeshError, match="port must be a number"):
        parse_master("node0:http", 2)


def test_parse_nnodes_forms() -> None:
    assert parse_nnodes("4") == (None, 4)
    assert parse_nnodes("2:4") == (2, 4)
    assert parse_nnodes("3:3") == (3, 3)
    for bad, problem in [
        ("4:2", "MIN 4 is more than MAX 2"),
        ("2:x", "expected N or MIN:MAX"),
        ("0:2", "host counts must be >= 1"),
        ("", "expected N or MIN:MAX"),
    ]:
        with pytest.raises(GradmeshError, match=problem):
            parse_nnodes(bad)


def test_resolve_command(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("pass\n")
    assert resolve_command(["python", str(script), "--x"]) == [sys.executable, str(script), "--x"]
    assert resolve_command(["python", "-c", "pass"]) == [sys.executable, "-c", "pass"]
    with pytest.raises(GradmeshError, match="script .*missing.py does not exist"):
        resolve_command(["python", str(tmp_path / "missing.py")])
    with pytest.raises(GradmeshError, match="command 'no-such-binary-x' not found"):
        resolve_command(["no-such-binary-x"])
    with pytest.raises(GradmeshError, match="no command to run"):
        resolve_command([])


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (LaunchSpec(nproc=0), "-np must be >= 1"),
        (LaunchSpec(nproc=1, nnodes=2, node_rank=2), "--node-rank 2 is not in 0..1"),
        (LaunchSpec(nproc=1, timeout_s=0), "--timeout must be > 0"),
        # once each rank's Gloo said it at rendezvous ("ifa != nullptr. Unable to find ...")
        (LaunchSpec(nproc=1, iface="nosuch0"), r"--iface nosuch0: no such network interface"),
    ],
)
def test_spec_checks(spec: LaunchSpec, message: str) -> None:
    with pytest.raises(GradmeshError, match=message):
        _check(spec)


def test_port_in_use_is_detected() -> None:
    from gradmesh.launch.ports import check_port_free

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(GradmeshError, match=f"master port {port} is already in use"):
            check_port_free("127.0.0.1", port)


def test_a_free_port_is_one_no_outgoing_connection_can_take() -> None:
    """Ports are drawn below the ephemeral range: a connect() from there to a store's port that
    is not listening yet can self-connect and hold it (a CI run's EADDRINUSE)."""
    from gradmesh.launch import ports

    drawn = {ports.free_port() for _ in range(20)}
    assert all(1024 <= port < ports._ephemeral_start() for port in drawn), drawn
    assert len(drawn) > 1, "the same port every time: concurrent jobs would collide"
    for port in drawn:
        ports.check_port_free("127.0.0.1", port)


def test_only_gradmesh_modules_of_a_launcher_program_are_forked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gradmesh.launch import forked

    worker = [sys.executable, "-m", "gradmesh.train.worker", "--config", "{}"]
    monkeypatch.delenv(forked.WORKER_START_ENV, raising=False)
    monkeypatch.setattr(forked, "PROGRAM", False)  # main() inside another program: never
    assert forked.forkable(worker, 2) is None
    monkeypatch.setattr(forked, "PROGRAM", True)
    monkeypatch.setattr("gradmesh.runtime.process.visible_gpus", lambda: 0)
    assert forked.forkable(worker, 2) == ("gradmesh.train.worker", ["--config", "{}"])
    # here torch is imported (and may have run ops on threads a fork would not have): the
    # server would be a new interpreter
    assert "torch" in sys.modules and not forked.server_forks()
    # unless the caller knows no op ran since the import (the tests' zygote, tests/zygote.py)
    assert forked.server_forks(torch_unused=True) == (sys.version_info < (3, 14))
    # one worker: forked where the server is a fork of the launcher (it shares the launcher's
    # torch), not where it would be a new interpreter (nothing to share)
    monkeypatch.setattr(forked, "server_forks", lambda: True)
    assert forked.forkable(worker, 1) == ("gradmesh.train.worker", ["--config", "{}"])
    monkeypatch.setattr(forked, "server_forks", lambda: False)
    assert forked.forkable(worker, 1) is None
    assert forked.forkable(worker, 2) == ("gradmesh.train.worker", ["--config", "{}"])
    assert forked.forkable([sys.executable, "train.py"], 4) is None  # the user's own command
    assert forked.forkable([sys.executable, "-m", "mypkg.train"], 4) is None
    monkeypatch.setattr("gradmesh.runtime.process.visible_gpus", lambda: 1)
    assert forked.forkable(worker, 2) is None  # a GPU host imports in every worker
    monkeypatch.setattr("gradmesh.runtime.process.visible_gpus", lambda: 0)
    monkeypatch.setenv(forked.WORKER_START_ENV, "exec")
    assert forked.forkable(worker, 2) is None
    monkeypatch.setenv(forked.WORKER_START_ENV, "vfork")
    with pytest.raises(GradmeshError, match="GRADMESH_WORKER_START='vfork': use fork or exec"):
        forked.forkable(worker, 2)


def test_a_forked_worker_gets_the_launchers_environment_as_it_is_when_it_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An elastic agent sets the rendezvous round in its environment before each start; a
    forked worker's copy is taken when the agent pickles its arguments, at that start (a copy
    taken at launch hung a restarted round: ranks waited under different rounds' keys)."""
    import pickle

    from gradmesh.launch.forked import LauncherEnvironment
    from gradmesh.runtime.process import ROUND_ENV

    passed = LauncherEnvironment()
    for round_ in ("3", "4"):
        monkeypatch.setenv(ROUND_ENV, round_)
        assert pickle.loads(pickle.dumps(passed))[ROUND_ENV] == round_
