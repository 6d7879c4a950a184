"""Gradmesh's own worker modules forked from a server that imported torch once.

A worker process started fresh imports torch (1.7 s of CPU here) and, at its first optimizer,
torch._dynamo (1.1 s more; torch.optim's `add_param_group` imports it): paid once a worker, so
four workers on two cores wait most of 6 s before their first step. `gradmesh train` and the
benchmarks run modules of gradmesh's own (`python -m gradmesh.<module>`); a launcher that is a
program of its own (`program()`, the `gradmesh` command) forks those from Python's forkserver,
preloaded with torch, torch._dynamo and the module, through torch's elastic agent (a callable
entry point; its start method "forkserver"). The agent still starts, watches and stops every
worker; what changes is that the imports are paid once a launcher.

Where it does not apply, workers start as fresh processes, as before:
- a user's command (`gradmesh run -- python train.py`): it is theirs, run as torchrun runs it;
- one worker (nothing to share), or a host with a GPU (a CUDA driver touched by an import in the
  server would be unusable in its forks; GPU hosts have the cores to import in parallel);
- a launcher called inside another program (`gradmesh.cli.main` in a test, or a notebook):
  its forkserver would outlive the call and carry that program's environment;
- GRADMESH_WORKER_START=exec, the way out if forking misbehaves somewhere.

Why a callable entry point needs care, and what `run_module` does about it:
- the agent counts a worker done when its function returns; gradmesh's workers end by
  `exit_process` (os._exit, skipping C++ static destructors), which would leave the agent
  waiting. In a forked worker, `exit_process(0)` raises `ending.Finished` instead, which ends
  the module and returns here (a non-zero code still exits at once: a failure);
- the server's environment is the launcher's when the server started: the launch's own
  (its worker variables, the user's) is passed in and put back, with the agent's per-rank
  variables on top; the thread count is set from it, since torch read it at import;
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
    if choice == "exec" or not PROGRAM or nproc < 2 or len(command) < 3:
        return None
    program, flag, module, *args = command
    if program != sys.executable or flag != "-m" or not module.startswith("gradmesh."):
        return None
    return (module, args) if visible_gpus() == 0 else None


def start_server(module: str) -> tuple[dict[str, str], dict[str, str]]:
    """Start this process's forkserver (once), preloaded with torch and `module`; return the
    environment a forked worker should run in (this launch's) and the server's."""
    import multiprocessing as mp
    from multiprocessing import forkserver

    global _server_env
    if _server_env is None:
        # the guard first: the server dies with this process (its forks hold it up otherwise)
        preload = [GUARD, "torch", "torch._dynamo", "torch.distributed", module, __name__]
        mp.get_context("forkserver").set_forkserver_preload(preload)
        _server_env = dict(os.environ)
        forkserver.ensure_running()
    return dict(os.environ), _server_env


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
