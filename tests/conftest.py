"""Fixtures every test gets: nothing a test starts or changes may outlive it.

Modelled on Lightning Fabric's leak fixtures: a test fails if it leaves behind a process (found by
a tag in its environment, so grandchildren count too), a child process, a Python thread, a
changed environment variable, a network namespace of an emulated host, or a temporary folder of
the launcher."""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import re
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

# One thread per process, set before torch loads, for every rank and job the tests start: they
# share the machine's cores, and torch's own threads only add contention there (the whole suite
# took 905 s with torch's default threads and 798 s with one, on 2 cores). Ranks pin it too.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Every rank and job the tests start, and this process, refuse a tensor that gradmesh makes
# without naming its device (gradmesh/runtime/device_guard.py): what a GPU would catch.
os.environ.setdefault("GRADMESH_DEVICE_GUARD", "1")

import pytest  # noqa: E402

from gradmesh.runtime import device_guard  # noqa: E402
from tests.harness import CLI, kept_environment
from tests.zygote import ZYGOTE, on_host

device_guard.install()

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


@pytest.fixture
def cli() -> Iterator[CLI]:
    """`gradmesh ARGS...` run in this process; what the command sets in its process's
    environment (its log levels, an engine's driver settings) is put back after the test."""
    from gradmesh.cli import main

    with kept_environment():
        yield main


@pytest.fixture
def cli_line(
    cli: CLI, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> Callable[..., str]:
    """`cli_line(args, **env)`: `gradmesh ARGS` in this process with `env` set, which must exit
    with code 2, one line on stderr (no traceback) and nothing on stdout; that line. Bad input
    is refused before anything starts, so this process's run is the command's (without a second
    interpreter's start and torch's import: about 2 s a case)."""

    def run(args: list[str], **env: str) -> str:
        capsys.readouterr()
        with monkeypatch.context() as patch:
            for key, value in env.items():
                patch.setenv(key, value)
            try:
                code = cli(args)
            except SystemExit as exc:  # argparse's own errors
                code = exc.code  # type: ignore[assignment]
        out, err = capsys.readouterr()
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1 and "Traceback" not in err, (code, err)
        assert out == "", out  # refused before anything ran
        return lines[0]

    return run


@pytest.fixture(scope="session", autouse=True)
def rank_forkserver() -> Iterator[None]:
    """The long-lived processes the test harness forks ranks and `gradmesh` runs from, started
    before any test (tests/harness.py, tests/zygote.py)."""
    from tests.harness import start_forkserver

    start_forkserver()
    ZYGOTE.start()
    yield
    ZYGOTE.close()


@pytest.fixture(autouse=True)
def hosts_forked() -> Iterator[None]:
    """A test's emulated cluster forks its hosts' `gradmesh` commands from the zygote
    (tests/zygote.py `on_host`) rather than starting a new interpreter on each. Not through
    `monkeypatch`: a test's own would then be undone after the environment check."""
    from gradmesh.launch import emulate

    start = emulate._start
    emulate._start = functools.partial(on_host, otherwise=start)
    yield
    emulate._start = start


def our_temp_dirs(root: str | None = None) -> set[str]:
    """Launcher log folders and emulated-host temp folders in the temp directory (or `root`).
    A launcher folder without its owner's pid (`gradmesh-run-abc123`) is an older gradmesh's,
    run beside the suite (this code always names the owner): never a test's leak."""
    import glob
    import tempfile

    root = root or tempfile.gettempdir()
    return {*glob.glob(f"{root}/gradmesh-run-[0-9]*x-*"), *glob.glob(f"{root}/gmesh-*")}


def emulated_namespaces() -> set[str]:
    from gradmesh.launch import namespaces

    return set(namespaces.our_namespaces()) if namespaces.missing_capability() is None else set()


OWNER = re.compile(r"(?:gmesh|gradmesh-run)-(\d+)x")
"""The owner's pid in a namespace's or temporary folder's name: `gmesh-<pid>x...` (an emulated
cluster's namespaces and folders), `gradmesh-run-<pid>x...` (the launcher's log folder)."""


def foreign(name: str, ours: list[int]) -> bool:
    """Whether namespace or folder `name` belongs to a live process outside this test (another
    test session or gradmesh job on the machine): its owner's pid is in its name, and is neither
    this process nor one of the test's own. Such a thing is not this test's leak, and deleting it
    would break the other job. A name without an owner, or whose owner is gone, is the test's."""
    match = OWNER.match(os.path.basename(name))
    if match is None:
        return False
    pid = int(match.group(1))
    if pid == os.getpid() or pid in ours:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


THREAD_GRACE_S = 5.0
"""How long a thread a test told to stop may take to end before it counts as leaked."""


def leaked_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    """Threads started during the test that are still alive after a grace period."""
    deadline = time.monotonic() + THREAD_GRACE_S
    while True:
        alive = [t for t in threading.enumerate() if t not in before and t.is_alive()]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


OWN_ENVIRONMENT = {
    TAG,
    "PYTEST_CURRENT_TEST",  # pytest's own
    "TORCHINDUCTOR_CACHE_DIR",  # torch memoises its cache folder here on first use
    # scikit-learn and joblib set these at their first import, which a test of Hugging Face
    # models can be where another library pulls them in (a GPU host's transformers did)
    "KMP_DUPLICATE_LIB_OK",
    "KMP_INIT_AT_FORK",
}
"""Variables the harness or a library sets, which no test is to blame for."""


def changed_environment(before: dict[str, str]) -> list[str]:
    """Names of environment variables the test added, removed or changed (put back here)."""
    changed = sorted(
        name
        for name in (set(before) | set(os.environ)) - OWN_ENVIRONMENT
        if before.get(name) != os.environ.get(name)
    )
    for name in changed:
        if name in before:
            os.environ[name] = before[name]
        else:
            del os.environ[name]
    return changed


@pytest.fixture(autouse=True)
def no_leaked_threads_or_environment() -> Iterator[None]:
    """Fail a test that leaves a thread running or the environment changed (monkeypatch's
    changes are undone before this check runs, so they do not count)."""
    threads = set(threading.enumerate())
    environment = dict(os.environ)
    yield
    changed = changed_environment(environment)
    alive = leaked_threads(threads)
    assert not alive, f"threads left running by the test: {[t.name for t in alive]}"
    assert not changed, f"environment variables changed by the test: {changed}"


@pytest.fixture(autouse=True)
def no_leaked_processes() -> Iterator[str]:
    """Tag every process a test starts; fail (and kill them) if any is alive afterwards, and
    fail if the test left an emulated host's namespace or a launcher's temporary folder behind
    (not one of another job's, which `foreign` tells by the owner's pid in its name)."""
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
    new_namespaces = emulated_namespaces() - namespaces_before
    left_namespaces = {n for n in new_namespaces if not foreign(n, leaked)}
    children = [p for p in multiprocessing.active_children() if p.is_alive()]
    for pid in leaked:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for child in children:
        child.kill()
    for name in left_namespaces:
        subprocess.run(["ip", "netns", "del", name], check=False)
    forked = ZYGOTE.leftovers()  # before the folders: a run it ends leaves its own
    left_temp = {d for d in our_temp_dirs() - temp_before if not foreign(d, leaked)}
    assert not leaked, f"processes left behind by the test: {leaked}"
    assert not forked, f"`gradmesh` runs or their processes left behind by the test: {forked}"
    assert not left_temp, f"temporary folders left behind: {sorted(left_temp)}"
    assert not left_namespaces, f"network namespaces left behind: {sorted(left_namespaces)}"
    assert not children, f"child processes left behind by the test: {children}"
