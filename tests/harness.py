"""Run a function on W real gloo ranks (forked processes) and bring back results or the failure.

Ranks are started from a forkserver that has imported torch once, so a world of 4 costs
milliseconds rather than four torch imports. Each rank gets the torchrun environment on a free
loopback port, calls `gradmesh.init()`, runs `fn(*args)` and sends its return value (or its
traceback) back. A rank that fails fails the test with its traceback; ranks that do not finish
within `timeout` are killed and named.
"""

from __future__ import annotations

import contextlib
import importlib.util
import multiprocessing as mp
import os
import pickle
import queue
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from gradmesh.launch.ports import free_port

CLI = Callable[[list[str]], int]
"""The `cli` fixture: `gradmesh ARGS...` run in the test's own process, its exit code back."""


SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@contextlib.contextmanager
def script(name: str) -> Iterator[ModuleType]:
    """scripts/NAME.py loaded as module NAME (in sys.modules meanwhile: a dataclass looks its
    module up there)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[name]


@contextlib.contextmanager
def kept_environment() -> Iterator[None]:
    """Put the environment back as it was, for code run in the test's own process that sets
    variables of its process by design (the CLI's log levels, Ray's driver settings)."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


_CTX = mp.get_context("forkserver")
# torch._dynamo too: torch.optim's optimizers import it on their first add_param_group (0.8 s of
# CPU in every rank otherwise; 34 s -> 25.5 s for the data-parallel and local-SGD tests)
_CTX.set_forkserver_preload(
    [
        "torch",
        "torch._dynamo",
        "torch.distributed",
        "gradmesh.runtime.world",
        "gradmesh.collectives",
    ]
)


def start_forkserver() -> None:
    """Start the forkserver now (before any test sets its leak-check tag) so it outlives tests."""
    from multiprocessing import forkserver

    forkserver.ensure_running()


def _rank_main(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    env: dict[str, str],
    results: mp.Queue,  # type: ignore[type-arg]
    init: dict[str, Any],
) -> None:
    os.environ.update(env)
    rank = int(env["RANK"])
    try:
        import torch

        import gradmesh

        # the forkserver imported torch before this rank's OMP_NUM_THREADS was set: pin the
        # thread count itself, since it changes the rounding of every reduction inside an op
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))

        gradmesh.init(**init)
        # pickled by value here: the queue's own pickler would send tensors as shared-memory
        # handles that die with this process
        results.put((rank, "ok", pickle.dumps(fn(*args))))
    except BaseException:  # noqa: BLE001 - every failure goes back to the test
        results.put((rank, "error", traceback.format_exc()))
    finally:
        import gradmesh.runtime.world

        gradmesh.runtime.world.shutdown()


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    timeout: float = 60.0,
    local_size: int | None = None,
    extra_env: dict[str, str] | None = None,
    init: dict[str, Any] | None = None,
) -> list[Any]:
    """Run `fn(*args)` on `world` ranks, each after `gradmesh.init(**init)`; return the per-rank
    results in rank order."""
    port = free_port()
    results: mp.Queue = _CTX.Queue()  # type: ignore[type-arg]
    procs = []
    for rank in range(world):
        local = local_size or world
        env = {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank % local),
            "LOCAL_WORLD_SIZE": str(local),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": "lo",
            # these are Gloo tests: on a machine with one GPU, two ranks would be refused
            "GRADMESH_BACKEND": os.environ.get("GRADMESH_BACKEND", "gloo"),
            "GRADMESH_TIMEOUT_S": str(min(timeout, 30.0)),
            "OMP_NUM_THREADS": "1",
            # carry the leak-check tag: forked ranks inherit the forkserver's environment, not ours
            "GRADMESH_TEST_TAG": os.environ.get("GRADMESH_TEST_TAG", ""),
            **(extra_env or {}),
        }
        proc = _CTX.Process(
            target=_rank_main, args=(fn, args, env, results, init or {}), daemon=True
        )
        proc.start()
        procs.append(proc)
    outcome: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcome) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world)) - set(outcome))
                raise AssertionError(f"ranks {missing} of {world} did not finish in {timeout} s")
            try:
                rank, status, payload = results.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if status == "error":
                raise AssertionError(f"rank {rank} of {world} failed:\n{payload}")
            outcome[rank] = pickle.loads(payload)
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        results.close()
    return [outcome[r] for r in range(world)]
