"""Gradmesh's own worker modules forked from a server that imported torch once.

A worker process started fresh imports torch (1.7 s of CPU here) and, at its first optimizer,
torch._dynamo (1.1 s more; torch.optim's `add_param_group` imports it): paid once a worker, so
four workers on two cores wait most of 6 s before their first step. `gradmesh train` and the
benchmarks run modules of gradmesh's own (`python -m gradmesh.<module>`); a launcher that is a
program of its own (`program()`, the `gradmesh` command) forks those from Python's forkserver,
with torch, torch._dynamo and the module imported, through torch's elastic agent (a callable
entry point; its start method "forkserver"). The agent still starts, watches and stops every
worker; what changes is that the imports are paid once a launcher: the launcher imports them
and the server is a fork of it (`_fork_server`), so even one worker shares them. `gradmesh
train` starts it before it checks the job (`start_early`), which imports torch and runs ops.

Where it does not apply, workers start as fresh processes, as before:
- a user's command (`gradmesh run -- python train.py`): it is theirs, run as torchrun runs it;
- one worker where the server would be a new interpreter (nothing to share), or a host with a
  GPU (a CUDA driver touched by an import in the server would be unusable in its forks; GPU
  hosts have the cores to import in parallel);
- a launcher called inside another program (`gradmesh.cli.main` in a test, or a notebook):
  its forkserver would outlive the call and carry that program's environment;
- GRADMESH_WORKER_START=exec, the way out if forking misbehaves somewhere.

Why a callable entry point needs care, and what `run_module` does about it:
- the agent counts a worker done when its function returns; gradmesh's workers end by
  `exit_process` (os._exit, skipping C++ static destructors), which would leave the agent
  waiting. In a forked worker, `exit_process(0)` raises `ending.Finished` instead, which ends
  the module and returns here (a non-zero code still exits at once: a failure);
- the server's environment is the launcher's when the server started: the launcher's as it
  is when the worker starts (`LauncherEnvironment`: its worker variables, the user's, an
  elastic round's number) is passed in and put back, with the agent's per-rank variables on
  top; the thread count is set from it, since torch read it at import;
- Python runs atexit handlers after an uncaught exception, where a forked child does not:
  `run_module` runs them (gradmesh's `_leave_at_exit` turns a peer's failure into its code).
"""

from __future__ import annotations

import atexit
import os
import runpy
import sys
import traceback
import warnings
from typing import Any

from gradmesh.runtime.process import stay_with_launcher

WORKER_START_ENV = "GRADMESH_WORKER_START"
"""`exec` starts every worker as a fresh process; unset (or `fork`): the rules above."""
PROGRAM = False
"""Set by `program()`: this process is a gradmesh launcher of its own."""
GUARD = "gradmesh.launch.forkserver_guard"
_server_env: dict[str, str] | None = None
"""The environment the forkserver started with (it is started once a process)."""


def forkable(command: list[str], nproc: int) -> tuple[str, list[str]] | None:
    """(module, arguments) when `command` is a gradmesh module this launcher may fork its
    `nproc` workers of (the module docstring's rules), None otherwise."""
    from gradmesh.runtime.process import visible_gpus

    choice = os.environ.get(WORKER_START_ENV, "fork")
    if choice not in ("fork", "exec"):
        from gradmesh.errors import GradmeshError

        raise GradmeshError(f"{WORKER_START_ENV}={choice!r}: use fork or exec")
    if choice == "exec" or not PROGRAM or len(command) < 3:
        return None
    if nproc < 2 and _server_env is None and not server_forks():  # one worker: an exec'd
        return None  # server would share nothing
    program, flag, module, *args = command
    if program != sys.executable or flag != "-m" or not module.startswith("gradmesh."):
        return None
    return (module, args) if visible_gpus() == 0 else None


def start_early(command: list[str], nproc: int, torch_unused: bool = False) -> None:
    """Start the server `launch` would start for `command`'s `nproc` workers now, where it can
    still be a fork of this launcher: before the launcher imports torch and runs ops on its
    threads to check the job (a checkpoint to resume, a layout, a user's model or loss).
    `torch_unused`: see `server_forks`."""
    forked = forkable(command, nproc)
    if forked is not None:
        start_server(forked[0], torch_unused)


def start_server(module: str, torch_unused: bool = False) -> dict[str, str]:
    """Start this process's forkserver (once), with torch and `module` imported, and return
    the environment it started with (`torch_unused`: see `server_forks`)."""
    import multiprocessing as mp
    from multiprocessing import forkserver

    global _server_env
    if _server_env is None:
        preload = ["torch", "torch._dynamo", "torch.distributed", module, __name__]
        _server_env = dict(os.environ)
        if not (server_forks(torch_unused) and _fork_server(preload)):
            # the guard first: the server dies with this process (its forks hold it up otherwise)
            mp.get_context("forkserver").set_forkserver_preload([GUARD, *preload])
            forkserver.ensure_running()
    return _server_env


_SERVER_MAIN = ["listener_fd", "alive_r", "preload", "main_path", "sys_path"]
"""`multiprocessing.forkserver.main`'s parameters where `_fork_server` knows its protocol
(Python 3.11 to 3.13; 3.14 added a key exchange: the exec'd server serves there)."""


def server_forks(torch_unused: bool = False) -> bool:
    """Whether `start_server` would fork the server from this process: this Python's
    forkserver is one `_fork_server` can start, and this process has not imported torch yet.
    A launcher that has (to check a checkpoint or a layout before launch) may have run an op on
    several threads: GNU OpenMP's thread pool does not survive a fork (a fork's first parallel
    op waits forever), and the exec'd server never ran one. `torch_unused`: the caller knows
    this process imported torch and has run no op since (a program forked from a process that
    only imported it: the test suite's `gradmesh` runs, tests/zygote.py)."""
    import inspect
    from multiprocessing import forkserver

    if "torch" in sys.modules and not torch_unused:
        return False
    server = getattr(forkserver, "_forkserver", None)
    fields = ("_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid", "_lock")
    known = list(inspect.signature(forkserver.main).parameters) == _SERVER_MAIN
    return known and server is not None and all(hasattr(server, f) for f in fields)


def _fork_server(preload: list[str]) -> bool:
    """Import `preload` here, then start the forkserver as a fork of this process; False
    (nothing started) where that cannot be done safely.

    Python starts its forkserver by exec: a new interpreter that imports torch again, though
    the launcher imported it already for the elastic agent (0.7 s of CPU, and as long before
    the first step, of the 4.2 s a one-epoch job of 2 workers took here: docs/launch.md).
    Forked after the imports and before the agent starts a thread, the server has them for
    free; it then runs Python's own server loop (`forkserver.main`), so everything after (the
    agent's requests, the forks, the exit codes) is the library's. What this sets up is what
    `ForkServer.ensure_running` does: a listening socket, an "alive" pipe, and the address,
    pipe and pid the client side reads."""
    import importlib
    import signal
    import socket
    import threading
    from multiprocessing import connection, forkserver, resource_tracker, util

    server: Any = forkserver._forkserver
    try:
        for name in preload:
            importlib.import_module(name)
    except ImportError:  # the exec'd server skips it, and its worker says what is missing
        return False
    if threading.active_count() > 1:  # a Python thread could hold a lock the fork copies
        return False
    with server._lock:
        resource_tracker.ensure_running()
        address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
        with socket.socket(socket.AF_UNIX) as listener:
            listener.bind(address)
            if not util.is_abstract_socket_namespace(address):
                os.chmod(address, 0o600)
            listener.listen()
            alive_r, alive_w = os.pipe()
            sys.stdout.flush()  # what is buffered here would be written twice
            sys.stderr.flush()
            launcher = os.getpid()
            pid = os.fork()
            if pid == 0:  # the server: never returns to the launcher's code
                code = 0
                try:
                    os.close(alive_w)
                    stay_with_launcher(launcher)
                    for sig in (signal.SIGTERM, signal.SIGHUP):  # the launcher's handlers
                        signal.signal(sig, signal.SIG_DFL)
                    signal.signal(signal.SIGINT, signal.default_int_handler)
                    forkserver.main(listener.fileno(), alive_r, [], None, None)
                except SystemExit:  # its clients are gone (the "alive" pipe closed)
                    pass
                except BaseException:  # noqa: BLE001 - reported, and the server ends
                    traceback.print_exc()
                    code = 1
                finally:
                    os._exit(code)  # not the launcher's atexit handlers
            os.close(alive_r)
        server._forkserver_address = address
        server._forkserver_alive_fd = alive_w
        server._forkserver_pid = pid
    return True


class LauncherEnvironment:
    """The launcher's environment as it is when the agent starts a worker: the agent pickles
    a forked worker's arguments at each start, and this pickles as a copy of `os.environ` then,
    so a forked worker gets what a fresh process inherits, such as the round number an elastic
    rendezvous sets before each start (`gradmesh.launch.rendezvous`)."""

    def __reduce__(self) -> tuple[type[dict[str, str]], tuple[dict[str, str]]]:
        return dict, (dict(os.environ),)


def run_module(module: str, args: list[str], env: dict[str, str], started: dict[str, str]) -> None:
    """A forked worker: `python -m module args` in the launch's environment `env`, the agent's
    per-rank variables (what differs from `started`, the server's) on top."""
    ranked = {k: v for k, v in os.environ.items() if started.get(k) != v}
    os.environ.clear()
    os.environ.update({**env, **ranked})
    import torch

    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # torch read it in the server, at import
        torch.set_num_threads(int(threads))
    from gradmesh.runtime import ending

    ending.return_on_success()
    sys.argv = [module, *args]
    # the server imported the module already: runpy warns of that, and runs it as __main__
    warnings.filterwarnings("ignore", "'.*' found in sys.modules", RuntimeWarning, "runpy")
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except ending.Finished:
        return
    except SystemExit as exc:
        if isinstance(exc.code, str):  # sys.exit("message"): printed, code 1, as Python does
            print(exc.code, file=sys.stderr)
        code = exc.code if isinstance(exc.code, int) or exc.code is None else 1
        if code:  # sys.exit(0) ends well: returning is how the agent learns it
            _leave(code)
    except BaseException:  # noqa: BLE001 - as Python ends on an uncaught exception
        traceback.print_exc()
        _leave(1)


def _leave(code: int) -> None:
    """End as a process of its own would: atexit handlers, flushed output, the exit code."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
