"""Failures fail fast and name the culprit, as a user sees them under `gradmesh run -np 2`: one
line naming the rank and the operation, no traceback from gradmesh, the job over soon after the
collective timeout (before it, when a rank dies or the ranks disagree), and no process left
behind (the leak fixture checks every test). Time bounds are the timeout itself (a job that
must end before it runs with a 30 s one, `FOUND_S`, many times what its ending takes), or the
timeout and the graces that follow it plus LATE_S: a busy machine moves neither."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from gradmesh.errors import PEER_FAILED_EXIT
from gradmesh.launch.ports import free_port
from gradmesh.runtime.ending import PEER_GRACE_S, STOP_GRACE_S
from tests.zygote import gradmesh

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "tests" / "integration" / "scripts" / "faulty.py")
TIMEOUT_S = 8
"""The collective timeout of a job that waits it out."""
FOUND_S = 30
"""The collective timeout of a job that must end before it: a failure found at once, then at most
a peer's and a stop's grace (PEER_GRACE_S + STOP_GRACE_S, 7 s) and the processes' exits."""
LATE_S = 15
"""How long after the timeout a job may take to end: starting and stopping Python processes on
a loaded machine, never the 30 minutes a call without a timeout would wait."""
GRADMESH = [sys.executable, "-m", "gradmesh.cli"]


class Job:
    """`gradmesh run -np 2 -- python faulty.py MODE ALGORITHM`, read line by line."""

    def __init__(
        self, mode: str, algorithm: str = "hvd", tmp: Path | None = None, timeout_s: int = FOUND_S
    ) -> None:
        self.timeout_s = timeout_s
        env = {**os.environ, "GRADMESH_TIMEOUT_S": str(timeout_s)}
        if tmp is not None:  # a launcher killed by SIGKILL cannot remove its log folder
            env["TMPDIR"] = str(tmp)
        command = [*GRADMESH, "run", "-np", "2", "--", "python", SCRIPT, mode, algorithm]
        self.proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT
        )
        self.lines: list[str] = []

    def until(self, pattern: str, count: int = 1) -> list[re.Match[str]]:
        """Read stdout until `count` lines match `pattern`; return the matches."""
        assert self.proc.stdout is not None
        found: list[re.Match[str]] = []
        while len(found) < count:
            line = self.proc.stdout.readline()
            assert line, f"the job ended before printing {pattern!r}: {self.lines}"
            self.lines.append(line)
            if m := re.search(pattern, line):
                found.append(m)
        return found

    def finish(self) -> tuple[int, str, float]:
        """(exit code, stderr, seconds from now until the job was over)."""
        started = time.monotonic()
        _, err = self.proc.communicate(timeout=self.timeout_s + 30)
        return self.proc.returncode, err, time.monotonic() - started


def gradmesh_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if "gradmesh" in line]


@pytest.mark.parametrize("mode", ["shape", "skip"])
def test_horovod_api_later_mismatch_and_skipped_call(mode: str) -> None:
    job = Job(mode, timeout_s=FOUND_S if mode == "shape" else TIMEOUT_S)
    job.until("agreed", 2)
    code, err, seconds = job.finish()
    assert code == PEER_FAILED_EXIT
    assert "Traceback" not in err
    assert seconds < job.timeout_s + PEER_GRACE_S + STOP_GRACE_S + LATE_S
    if mode == "shape":  # found by the coordinator's round at once, on both ranks
        want = (
            ": the ranks called different operations: rank 0: allreduce (average) of float32 "
            "(2, 3); rank 1: allreduce (average) of float32 (3, 2)"
        )
        for r in (0, 1):
            line = f"[{r}] gradmesh: rank {r}: allreduce 'allreduce.noname.3' on the global "
            assert f"{line}process set{want}" in err
        assert seconds < FOUND_S, "found by the signature check, not by the timeout"
        # both ranks stop at once: the launcher names whichever exit it sees first
        assert re.search(r"gradmesh run: rank [01] stopped: a collective with other ranks", err)
    else:  # rank 1 never comes: rank 0 gives up after the timeout, naming rank 1
        assert "[0] gradmesh: rank 0: allreduce 'allreduce.noname.3' on the global process " in err
        assert f"rank 1 did not take part within {TIMEOUT_S} s" in err
        assert "gradmesh run: rank 0 stopped: a collective with other ranks failed" in err


@pytest.mark.parametrize(("mode", "code"), [("raise", 1), ("exit3", 3)])
def test_rank_0_failing_ends_the_job_at_once_and_is_named(mode: str, code: int) -> None:
    job = Job(mode)
    job.until("rank 1 pid")
    returncode, err, seconds = job.finish()
    assert returncode == code
    assert seconds < FOUND_S, "not a timeout: the failed rank left at once, rank 1 was stopped"
    assert (
        gradmesh_lines(err)[-1]
        == f"gradmesh run: rank 0 exited with code {code}; the job was stopped"
    )
    if mode == "exit3":
        assert "Traceback" not in err
    else:  # the user's own exception keeps its traceback; gradmesh adds none of its own
        assert err.count("Traceback") == 1 and "ValueError: the user's own bug" in err


def test_a_killed_rank_is_named_with_its_signal() -> None:
    job = Job("train")
    pids = {int(m[1]): int(m[2]) for m in job.until(r"rank (\d) pid (\d+) training", 2)}
    time.sleep(1)  # mid-training
    os.kill(pids[1], signal.SIGKILL)
    code, err, seconds = job.finish()
    assert code == 128 + signal.SIGKILL
    assert seconds < FOUND_S, "the launcher stopped the job, not the survivor's timeout"
    assert gradmesh_lines(err)[-1] == (
        "gradmesh run: rank 1 was killed by signal SIGKILL; the job was stopped"
    )


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return False
    return state != "Z"


def test_workers_never_outlive_a_killed_launcher(tmp_path: Path) -> None:
    job = Job("train", tmp=tmp_path)
    pids = [int(m[2]) for m in job.until(r"rank (\d) pid (\d+) training", 2)]
    job.proc.kill()  # SIGKILL: the launcher can pass nothing on
    job.proc.communicate(timeout=10)
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)], "workers outlived their launcher"


def test_a_plain_script_s_workers_never_outlive_a_killed_launcher(tmp_path: Path) -> None:
    """A command that never calls gradmesh (a plain torch script, any program) starts through
    `gradmesh.runtime.bound`, which binds it to the launcher before it becomes the command:
    the launcher killed by SIGKILL takes its workers along (they used to stay, as torchrun's)."""
    code = "import time; time.sleep(120)"
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # the killed launcher's log folder
    proc = subprocess.Popen(
        [*GRADMESH, "run", "-np", "2", "--", "python", "-c", code],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=ROOT,
    )  # fmt: skip
    deadline, workers = time.monotonic() + 60, []
    while len(workers) < 2:
        assert time.monotonic() < deadline and proc.poll() is None, "the workers did not start"
        time.sleep(0.1)
        workers = [p.pid for p in psutil.Process(proc.pid).children() if _runs(p, code)]
    proc.kill()
    proc.communicate(timeout=10)
    deadline = time.monotonic() + 10
    while any(alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in workers if alive(p)], "a plain script's workers outlived the launcher"


def test_a_plain_command_gets_its_arguments_as_typed() -> None:
    """torch elastic substitutes `${local_rank}` in a command's arguments with string.Template,
    which also turned `$$` into `$`; gradmesh passes every other `$` through."""
    args = ["a$$b", "$HOME", "${local_rank}", "$local_rank"]
    out = gradmesh(
        "run", "-np", "2", "--", sys.executable, "-c", "import sys; print(sys.argv[1:])", *args
    )
    assert out.returncode == 0, out.stderr
    for rank in (0, 1):
        assert f"[{rank}] {['a$$b', '$HOME', str(rank), str(rank)]}" in out.stdout, out.stdout


def _runs(proc: psutil.Process, code: str) -> bool:
    try:
        return code in proc.cmdline()
    except psutil.Error:  # it ended meanwhile
        return False


def test_an_unreachable_master_fails_within_the_timeout() -> None:
    port = free_port()
    started = time.monotonic()
    out = gradmesh(
        *("run", "-np", "1", "--nnodes", "2", "--node-rank", "1"),
        *("--master", f"127.0.0.1:{port}", "--timeout", "5", "--", "python", "-c", "pass"),
        timeout=60,
    )
    assert time.monotonic() - started < 5 + LATE_S  # the 5 s timeout, not torch's 15 minutes
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert out.stderr.strip() == (
        f"gradmesh run: error: node 1: rendezvous with master 127.0.0.1:{port} failed: nothing "
        "accepted a connection within 5 s (Connection refused)"
    )


def _forked_workers(launcher: int, count: int) -> dict[int, int]:
    """{rank: pid} of `gradmesh train`'s workers: the children of the launcher's forkserver,
    each known by its stderr, the agent's log file of its rank (.../<rank>/stderr.log)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found: dict[int, int] = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                parent = stat.read_text().rpartition(")")[2].split()[1]
                grandparent = Path(f"/proc/{parent}/stat").read_text().rpartition(")")[2]
                stderr = os.readlink(stat.parent / "fd" / "2")
            except (OSError, IndexError):
                continue
            if grandparent.split()[1] == str(launcher):
                rank = re.search(r"/(\d+)/stderr\.log$", stderr)
                found[int(rank[1]) if rank else 0] = int(stat.parent.name)
        if len(found) == count:
            return found
        time.sleep(0.2)
    raise AssertionError(f"{count} forked workers of launcher {launcher} did not start")


@pytest.mark.parametrize("kill", ["rank", "launcher"])
def test_forked_workers_are_named_when_killed_and_end_with_their_launcher(
    kill: str, tmp_path: Path
) -> None:
    # `gradmesh train` forks its workers from its launcher's forkserver (gradmesh.launch.forked):
    # the grandchildren of the launcher, not its children; both guarantees still hold
    env = {**os.environ, "GRADMESH_TIMEOUT_S": str(TIMEOUT_S), "TMPDIR": str(tmp_path)}
    command = [*GRADMESH, "train", "--workers", "2", "--epochs", "1000", "--batch-size", "8"]
    if kill == "launcher":  # a launcher that checks a checkpoint (builds the model) forks too
        command += ["--checkpoint-dir", str(tmp_path / "checkpoints")]
    proc = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT
    )
    workers = _forked_workers(proc.pid, 2)
    if sys.version_info < (3, 14):  # the server is a fork of the launcher: torch imported once
        server = Path(f"/proc/{workers[0]}/stat").read_text().rpartition(")")[2].split()[1]
        launcher = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert Path(f"/proc/{server}/cmdline").read_bytes() == launcher
    time.sleep(1)  # mid-training
    if kill == "rank":
        os.kill(workers[1], signal.SIGKILL)
        _, err = proc.communicate(timeout=TIMEOUT_S + 30)
        assert proc.returncode == 128 + signal.SIGKILL
        assert gradmesh_lines(err)[-1] == (
            "gradmesh run: rank 1 was killed by signal SIGKILL; the job was stopped"
        )
    else:
        proc.kill()
        proc.communicate(timeout=10)
    deadline = time.monotonic() + 10
    while any(alive(p) for p in workers.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in workers.values() if alive(p)], "forked workers outlived the job"


def test_a_script_whose_init_refuses_its_mesh_says_one_line() -> None:
    """The hook that prints a gradmesh error as its line is installed before `init` checks
    anything: it once came after, so `init`'s own refusals were a traceback."""
    code = "import gradmesh; gradmesh.init(tensor_parallel=3)"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "gradmesh: rank 0: 1 workers cannot hold replicas of pipeline stages 1 x expert-parallel "
        "ranks 1 x context-parallel ranks 1 x tensor-parallel ranks 3 = 3 ranks: their product "
        "must divide the worker count (1)"
    ]


@pytest.mark.parametrize("strategy", ["allreduce", "ps"])
def test_ctrl_c_ends_a_training_job_in_one_line(strategy: str) -> None:
    """Ctrl-C reaches every process of the terminal's group, and the launcher passes its own
    on: each rank (and a ps job's servers and supervisors) once printed a KeyboardInterrupt
    traceback, some two. Now the launcher's line is the job's only word on it."""
    proc = subprocess.Popen(
        [*GRADMESH, "train", "--epochs", "1000", "--strategy", strategy],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        start_new_session=True,  # its own group, as a terminal's foreground job
        # a suite started in the background inherits SIGINT ignored: Ctrl-C must reach it
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # noqa: PLW1509
    )
    assert proc.stderr is not None
    while "epoch 2/" not in proc.stderr.readline():  # its progress goes to stderr
        assert proc.poll() is None, "the job ended before its second epoch"
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert gradmesh_lines(err)[-1] == "gradmesh run: stopped by SIGINT; every worker was ended"
