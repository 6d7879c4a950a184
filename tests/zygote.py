"""`gradmesh ARGS` for the tests, forked from a process that imported torch once (the zygote).

A test's `gradmesh train` started as a new interpreter imports torch and torch._dynamo (about
3 s of CPU here) before its first line of its own; the suite runs some 200 of them, and on two
cores those imports were most of its time (a py-spy profile of its 60 slowest tests: 47 % of
the samples in imports). The zygote is one process per pytest worker that imports them and
gradmesh's launcher, then forks each `gradmesh` the tests ask for: a real process, with the
test's arguments, environment, folder and exit code, its output in files the test reads back.
It runs no torch op itself, so a fork may still fork its launcher's worker server from itself
(`gradmesh.launch.forked.start_early(..., torch_unused=True)`), as a fresh `gradmesh` does.

What a fork cannot be is a new interpreter: a run whose environment would change how Python or
torch starts (PYTHON*, OMP_*, TORCH*, ...: read once, at start or import) is started fresh, as
is one a test asks for with `fresh=True`. The zygote is a child subreaper, so a process a run
leaves behind (a worker outliving its launcher) comes back to it: the run fails naming it.

Emulated hosts too: a cluster's host runs `ip netns exec NS python -m gradmesh.cli ...`, a new
interpreter each (some 60 a suite). `on_host` forks those instead, into the host's namespace as
`ip netns exec` enters it (`_enter`): from the zygote for a test's own cluster
(tests/conftest.py puts `on_host` in `gradmesh.launch.emulate._start`), and for a `gradmesh
emulate` or `bench` run from a zygote that run forks of itself before its first op
(`_host_zygote`). The same rule holds: a host whose environment starts torch otherwise than
its zygote did (the cluster's OMP_NUM_THREADS, where the tests' one thread is not it) starts
as the cluster starts it.

The requests and answers are JSON lines on pipes (no pickle); the zygote ends with its pipe.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import io
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
STARTUP = ("PYTHON", "OMP_", "MKL_", "KMP_", "TORCH", "CUDA", "LD_", "GRADMESH_TEST_TAG")
"""Environment variables a fork cannot honour (read by Python or torch as they start), and the
leak-check tag, which the zygote must not carry."""
LATER = {"TORCHINDUCTOR_CACHE_DIR"}
"""Of those, what torch sets in a process's environment on first use and reads when it uses it
(after the start): a test process's inductor sets it, and its runs may differ from the
zygote there."""
LAUNCHER = {"TORCH_CPP_LOG_LEVEL"}
"""Of those, what every `gradmesh` launcher sets before it loads torch (`quiet_cpp_logs`: torch's
C++ logs at FATAL), as the zygote does: a run's own value reaches its exec'd workers
(GRADMESH_WORKER_TORCH_CPP_LOG_LEVEL), never its launcher."""
PRELOAD = [
    "torch",
    "torch._dynamo",
    "torch.distributed",
    "torch.distributed.elastic.agent.server.local_elastic_agent",
    "gradmesh.cli",
    "gradmesh.launch.run",
    "gradmesh.train.worker",
]
PR_SET_CHILD_SUBREAPER = 36
CLONE_NEWNET, CLONE_NEWNS = 0x40000000, 0x00020000
MS_BIND, MS_REC, MS_SLAVE, MNT_DETACH = 0x1000, 0x4000, 0x80000, 2
LINGER_S = 5.0
"""How long a run's last processes (its launcher's worker server) may take to end after it."""


def _child(request: dict[str, Any]) -> None:
    """In the fork: become `gradmesh ARGS` and end as the interpreter would."""
    code = 1
    try:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP):
            signal.signal(
                sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
            )
        for fd, path, flags in (
            (0, os.devnull, os.O_RDONLY),
            (1, request["out"], os.O_WRONLY | os.O_APPEND),
            (2, request["err"], os.O_WRONLY | os.O_APPEND),
        ):
            opened = os.open(path, flags)  # a pipe's end (`on_host`) waits for its reader
            os.dup2(opened, fd)
            os.close(opened)
        if request.get("namespace"):
            _enter(request["namespace"])
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        tempfile.tempdir = None  # the zygote's imports fixed it at its TMPDIR: the run's own
        from gradmesh import cli
        from gradmesh.launch import forked

        sys.argv = [cli.__file__, *request["argv"]]
        forked.PROGRAM = True
        if request["argv"][:1] in (["emulate"], ["bench"]):  # first: nothing of the next in it
            _host_zygote()
        if request["argv"][:1] in (["train"], ["bench"]):  # before the command runs an op
            forked.start_early([sys.executable, "-m", "gradmesh.train.worker"], 2, True)
        code = _as_the_interpreter(cli.program)
    except BaseException:  # noqa: BLE001 - a fork that failed before the command: said
        traceback.print_exc()
    finally:
        os._exit(code)


def _host_zygote() -> None:
    """For a run that may start emulated hosts (`gradmesh emulate`, the benchmarks): a zygote
    forked from it before it runs an op, from which its cluster forks them (`on_host`)."""
    from gradmesh.launch import emulate

    requests_r, requests_w = os.pipe()
    answers_r, answers_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(requests_w)
            os.close(answers_r)
            serve(requests_r, answers_w)  # ends with the run: its requests' pipe closes
        except BaseException:  # noqa: BLE001 - said, and it ends
            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    os.close(requests_r)
    os.close(answers_w)
    zygote = Zygote()
    zygote.attach(_Forked(pid, requests_w, answers_r), dict(os.environ))
    emulate._start = functools.partial(on_host, otherwise=emulate._start, zygote=zygote)


class _Forked:
    """A zygote forked by the run that uses it (`_host_zygote`): the part of `subprocess.Popen`
    a `Zygote` uses."""

    def __init__(self, pid: int, requests: int, answers: int) -> None:
        self.pid, self.returncode = pid, None
        self.stdin, self.stdout = open(requests, "wb"), open(answers, "rb")  # noqa: SIM115

    def poll(self) -> int | None:
        if self.returncode is None:
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(["zygote"], timeout or 0)
            time.sleep(0.05)
        return self.returncode  # type: ignore[return-value]

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)


def _enter(name: str) -> None:
    """What `ip netns exec NAME` does before its command: the network namespace NAME, a mount
    namespace of its own in which /sys shows that network and /etc/netns/NAME's files (the
    emulated hosts' names) lie over /etc's, and, as the cluster starts its hosts, a session of
    its own."""
    libc = ctypes.CDLL(None, use_errno=True)

    def check(code: int, what: str) -> None:
        if code != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"{what} for namespace {name}: {os.strerror(errno)}")

    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    check(libc.setns(fd, CLONE_NEWNET), "setns")
    os.close(fd)
    check(libc.unshare(CLONE_NEWNS), "unshare")
    check(libc.mount(b"none", b"/", None, MS_REC | MS_SLAVE, None), "mount --make-rslave /")
    libc.umount2(b"/sys", MNT_DETACH)  # as ip: none mounted is as good
    check(libc.mount(name.encode(), b"/sys", b"sysfs", 0, None), "mount /sys")
    etc = Path("/etc/netns", name)
    for entry in sorted(etc.iterdir()) if etc.is_dir() else []:
        target = f"/etc/{entry.name}".encode()
        check(libc.mount(str(entry).encode(), target, None, MS_BIND, None), f"bind {entry}")
    os.setsid()


def _as_the_interpreter(program: Any) -> int:
    """`sys.exit(program())` at a script's top level: the exit code, an uncaught exception
    through `sys.excepthook`, then what Python does on its way out (non-daemon threads
    joined, atexit handlers, output flushed)."""
    try:
        code = program()
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # noqa: BLE001 - as the interpreter reports it
        sys.excepthook(*sys.exc_info())
        code = 1
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    return int(code or 0)


def serve(requests: int, answers: int) -> None:
    """The zygote: fork a run per request line, answer `pid` when forked and `exit` when
    reaped (runs and the orphans it adopts alike)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)

    def answer(**fields: int) -> None:
        os.write(answers, json.dumps(fields).encode() + b"\n")

    pending = b""
    while True:
        ready, _, _ = select.select([requests], [], [], 0.05)
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            answer(exit=pid, code=os.waitstatus_to_exitcode(status))
        if not ready:
            continue
        chunk = os.read(requests, 65536)
        if not chunk:
            return  # the tests are done
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                os.close(requests)
                os.close(answers)
                _child(json.loads(line))
            answer(pid=pid)


class Run:
    """A `gradmesh` run forked from the zygote: the part of `subprocess.Popen` the tests use
    (pid, poll, wait, signals), its output in files (`out`, `err`)."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str], out: Path, err: Path) -> None:
        self.zygote, self.pid, self.args, self.out, self.err = zygote, pid, args, out, err
        self.returncode: int | None = None
        self.stdout: Any = None
        self.stderr: Any = None
        """Where its output is read as it comes (`on_host`), as a Popen's pipes."""

    def poll(self) -> int | None:
        if self.returncode is None:
            self.zygote.collect(0)
            self.returncode = self.zygote.exits.get(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        while self.poll() is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            self.zygote.collect(min(left, 1.0))
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def end(self) -> None:
        """End it if it still runs: SIGTERM (a launcher stops its workers and removes its
        folder), SIGKILL after 10 s."""
        self.terminate()
        try:
            self.wait(10)
        except subprocess.TimeoutExpired:
            self.kill()
            self.wait(10)


class Zygote:
    """The test side: start the zygote (once), send it runs, collect their ends."""

    def __init__(self) -> None:
        self.proc: Any = None
        """The zygote: a `subprocess.Popen`, or the `_Forked` a run attached."""
        self.attached = False
        self.env: dict[str, str] = {}
        self.exits: dict[int, int] = {}
        self.forked: list[int] = []
        self.running: set[int] = set()
        self.pending = b""

    def attach(self, proc: _Forked, env: dict[str, str]) -> None:
        """Use `proc`, a zygote started with `env`, from now on."""
        self.proc, self.env, self.attached = proc, env, True
        self.exits, self.forked, self.running, self.pending = {}, [], set(), b""

    def start(self) -> Any:
        if not self.attached and (self.proc is None or self.proc.poll() is not None):
            self.env = {k: v for k, v in os.environ.items() if not k.startswith(STARTUP[-1])}
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.zygote"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                cwd=ROOT,
                env=self.env,
            )
            self.exits, self.forked, self.running, self.pending = {}, [], set(), b""
        return self.proc

    def forks(self, env: dict[str, str]) -> bool:
        """Whether a run in `env` can be a fork: what it starts with is the zygote's."""
        keys = {k for k in (*env, *self.env) if k.startswith(STARTUP[:-1])} - LATER - LAUNCHER
        return all(env.get(k) == self.env.get(k) for k in keys)

    def spawn(
        self, argv: list[str], env: dict[str, str], cwd: Path, out: Path, err: Path, netns: str = ""
    ) -> Run:
        """Fork `gradmesh ARGV` with `env` in `cwd`, its output appended to `out` and `err`
        (in network namespace `netns`, where given, as `ip netns exec` runs it)."""
        proc = self.start()
        assert proc.stdin is not None
        for path in (out, err):
            path.touch()
        request = {"argv": argv, "env": env, "cwd": str(cwd), "out": str(out), "err": str(err)}
        request["namespace"] = netns
        proc.stdin.write(json.dumps(request).encode() + b"\n")
        proc.stdin.flush()
        deadline = time.monotonic() + 60
        while not self.forked:
            if time.monotonic() > deadline:
                raise RuntimeError("the zygote forked nothing within 60 s")
            self.collect(1.0)
        pid = self.forked.pop(0)
        return Run(self, pid, ["gradmesh", *argv], out, err)

    def collect(self, seconds: float) -> None:
        """Read the zygote's answers that come within `seconds`: pids forked, exits."""
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        ready, _, _ = select.select([fd], [], [], seconds)
        if not ready:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the zygote ended with code {self.proc.returncode}")
            return
        chunk = os.read(fd, 65536)
        if not chunk:
            raise RuntimeError("the zygote closed its answers")
        self.pending += chunk
        while b"\n" in self.pending:
            line, self.pending = self.pending.split(b"\n", 1)
            answer = json.loads(line)
            if "pid" in answer:  # always before that pid's exit: a pid reused starts afresh
                self.forked.append(answer["pid"])
                self.running.add(answer["pid"])
                self.exits.pop(answer["pid"], None)
            else:
                self.exits[answer["exit"]] = answer["code"]
                self.running.discard(answer["exit"])

    def left_behind(self) -> list[str]:
        """With no run going, the zygote's children still alive `LINGER_S` after (processes
        runs left behind, adopted by it): named, and killed."""
        import psutil

        assert self.proc is not None
        deadline = time.monotonic() + LINGER_S
        while not self.running:
            self.collect(0)
            try:
                alive = [
                    p
                    for p in psutil.Process(self.proc.pid).children()
                    if p.status() != psutil.STATUS_ZOMBIE
                ]
            except psutil.NoSuchProcess:
                return []
            if not alive or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        else:
            return []
        return [_killed(process) for process in alive]

    def leftovers(self) -> list[str]:
        """What a test's runs leave when it ends: runs still going and the processes runs
        left behind, named and killed (tests/conftest.py)."""
        if self.proc is None or self.proc.poll() is not None:
            return []
        import psutil

        while select.select([self.proc.stdout], [], [], 0)[0]:  # exits already told
            self.collect(0)
        named = []
        for pid in list(self.running):
            with contextlib.suppress(psutil.NoSuchProcess):
                root = psutil.Process(pid)
                if root.ppid() == self.proc.pid:  # the run (not another that took its pid)
                    named.append(_killed(root))
        deadline = time.monotonic() + 10
        while self.running and time.monotonic() < deadline:
            self.collect(0.1)
        return named + self.left_behind()

    def close(self) -> None:
        if self.proc is not None and self.proc.stdin is not None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _killed(process: Any) -> str:
    """Kill a psutil process and everything it started; its pid and command line."""
    import psutil

    name = str(process.pid)
    with contextlib.suppress(psutil.NoSuchProcess):
        name += " " + " ".join(process.cmdline())[:120]
        for p in [process, *process.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
    return name


def _text(data: bytes) -> str:
    """As `subprocess.run(text=True)` decodes: the locale's encoding, universal newlines."""
    return io.TextIOWrapper(io.BytesIO(data)).read()


ZYGOTE = Zygote()
GRADMESH_CLI = [sys.executable, "-m", "gradmesh.cli"]


def on_host(
    command: list[str], env: dict[str, str], otherwise: Any, zygote: Zygote = ZYGOTE
) -> Any:
    """`gradmesh.launch.emulate._start` for the tests' clusters (tests/conftest.py): a
    `gradmesh` command on an emulated host (`ip netns exec NS python -m gradmesh.cli ARGS`)
    forked from `zygote` into that namespace, its output through named pipes that the cluster
    reads as it reads a process's pipes; anything else started `otherwise` (the cluster's way)."""
    namespace, argv = command[3], command[4:]
    zygote.start()  # its environment is what `forks` compares
    if argv[:3] != GRADMESH_CLI or Path.cwd() != ROOT or not zygote.forks(env):
        return otherwise(command, env)
    folder = Path(tempfile.mkdtemp(prefix="zygote-host-"))
    try:
        out, err = folder / "out", folder / "err"
        os.mkfifo(out)
        os.mkfifo(err)
        run = zygote.spawn(argv[3:], env, ROOT, out, err, netns=namespace)
        run.stdout = open(out)  # noqa: SIM115 - each waits for the fork to open its end
        run.stderr = open(err)  # noqa: SIM115 - read to their end by the cluster, as pipes
    finally:
        shutil.rmtree(folder)
    return run


def gradmesh(
    *args: str,
    timeout: float = 120,
    env: dict[str, str] | None = None,
    cwd: Path = ROOT,
    fresh: bool = False,
) -> subprocess.CompletedProcess[str]:
    """`gradmesh ARGS` with `env` added to this process's environment: forked from the zygote,
    or (`fresh`, or an environment a fork cannot honour) a new interpreter."""
    full = {**os.environ, **(env or {})}
    if fresh or cwd != ROOT or not ZYGOTE.forks(full):  # sys.path[0]: the zygote's folder
        return subprocess.run(
            [sys.executable, "-m", "gradmesh.cli", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=cwd,
            env=full,
        )
    with tempfile.TemporaryDirectory(prefix="zygote-") as folder:
        run = ZYGOTE.spawn(list(args), full, cwd, Path(folder, "out"), Path(folder, "err"))
        try:
            run.wait(timeout)
        except subprocess.TimeoutExpired:
            run.end()
            ZYGOTE.left_behind()
            raise subprocess.TimeoutExpired(
                run.args, timeout, run.out.read_bytes(), run.err.read_bytes()
            ) from None
        left = ZYGOTE.left_behind()  # first: what its last processes write is its output too
        stdout, stderr = (_text(path.read_bytes()) for path in (run.out, run.err))
    assert not left, f"`{' '.join(run.args)}` left processes behind: {left}\n{stderr[-2000:]}"
    return subprocess.CompletedProcess(run.args, run.wait(), stdout, stderr)


def main() -> None:
    import importlib

    requests, answers = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)  # a stray print of an import is no answer
    from gradmesh.launch.logs import quiet_cpp_logs

    quiet_cpp_logs()  # before torch loads, as `gradmesh` does
    for module in PRELOAD:
        importlib.import_module(module)
    serve(requests, answers)


if __name__ == "__main__":
    main()
