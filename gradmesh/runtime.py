"""The process world: who this rank is, its backend, its groups, its timeouts.

`init()` reads the standard torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, GROUP_RANK), picks Gloo on CPU or NCCL when every local rank has its own
CUDA device, and builds the intra-host and cross-host process groups. Without a launcher it is a
world of one, still backed by a real process group so that every code path is the same.

The initialised `Runtime` is the one piece of module-level state in gradmesh; everything else is
passed explicitly.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from gradmesh.errors import GradmeshError, first_line

DEFAULT_TIMEOUT_S = 60.0
TIMEOUT_ENV = "GRADMESH_TIMEOUT_S"
BACKEND_ENV = "GRADMESH_BACKEND"


@dataclass(frozen=True)
class WorkerGrid:
    """The data-parallel x model-parallel layout of the world; strategies split ranks along it."""

    data: int
    """Number of model replicas (data-parallel degree)."""
    model: int = 1
    """Number of ranks one replica is split over (tensor x pipeline degree)."""

    def __post_init__(self) -> None:
        if self.data < 1 or self.model < 1:
            raise GradmeshError(
                f"worker grid axes must be >= 1, got data={self.data} model={self.model}"
            )

    @property
    def world_size(self) -> int:
        return self.data * self.model

    def check(self, world_size: int) -> None:
        """Raise unless data x model covers exactly `world_size` ranks."""
        if self.world_size != world_size:
            raise GradmeshError(
                f"worker grid data={self.data} x model={self.model} = {self.world_size} "
                f"does not match the world size {world_size}"
            )

    def coords(self, rank: int) -> tuple[int, int]:
        """(data index, model index) of `rank`; model-parallel peers are adjacent ranks."""
        return divmod(rank, self.model)


@dataclass
class CommStats:
    """What this rank has communicated: counted by the collectives, read by reports."""

    bytes_sent: int = 0
    """Bytes this rank put on the wire (exact for gradmesh's algorithms, modelled for native)."""
    comm_s: float = 0.0
    """Seconds spent waiting in communication calls."""
    calls: int = 0

    def add(self, nbytes: int, seconds: float) -> None:
        self.bytes_sent += nbytes
        self.comm_s += seconds
        self.calls += 1


@dataclass
class Runtime:
    """The initialised process world of this rank."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    backend: str
    device: torch.device
    timeout: timedelta
    local_group: dist.ProcessGroup | None
    cross_group: dist.ProcessGroup | None
    grid: WorkerGrid
    comm: CommStats = field(default_factory=CommStats)
    workspace: dict[tuple[object, ...], torch.Tensor] = field(default_factory=dict)
    """Scratch buffers of the collectives, kept across calls so the hot path allocates nothing."""
    checked: set[tuple[object, ...]] = field(default_factory=set)
    """Collective signatures whose shape and dtype have been checked to agree on every rank."""
    async_group: dist.ProcessGroup | None = None
    """A second group over the whole world for the communication thread, so that its
    collectives never interleave with those the main thread issues on the default group."""
    timeline: Any = None
    """The running `gradmesh.timeline.Timeline`, if any."""
    _executor: ThreadPoolExecutor | None = None
    joinable: Callable[[], None] | None = None
    """What `gradmesh.join()` runs: the join of the most recently created DistributedOptimizer."""

    def comm_executor(self) -> ThreadPoolExecutor:
        """The one communication thread: asynchronous collectives run here, in submission order,
        so every rank issues them in the same order."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gradmesh-comm")
        return self._executor


_runtime: Runtime | None = None


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise GradmeshError(f"environment variable {name}={raw!r} is not an integer") from None


def _timeout_s(timeout_s: float | None) -> float:
    if timeout_s is not None:
        return timeout_s
    raw = os.environ.get(TIMEOUT_ENV)
    try:
        return float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        raise GradmeshError(f"environment variable {TIMEOUT_ENV}={raw!r} is not a number") from None


def _pick_backend(local_size: int, requested: str | None) -> tuple[str, torch.device]:
    backend = requested or os.environ.get(BACKEND_ENV) or ""
    cuda_ok = torch.cuda.is_available() and torch.cuda.device_count() >= local_size
    if not backend:
        backend = "nccl" if cuda_ok else "gloo"
    if backend not in ("gloo", "nccl"):
        raise GradmeshError(f"unknown backend {backend!r} (valid: gloo, nccl)")
    if backend == "nccl":
        if not cuda_ok:
            raise GradmeshError(f"backend nccl needs {local_size} CUDA devices on this host")
        device = torch.device("cuda", _env_int("LOCAL_RANK", 0))
        torch.cuda.set_device(device)
        return backend, device
    return backend, torch.device("cpu")


def _connect(backend: str, rank: int, size: int, timeout: timedelta) -> None:
    if size == 1 and "MASTER_ADDR" not in os.environ:
        store = dist.HashStore()  # type: ignore[attr-defined]
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
        return
    addr = os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    port = os.environ.setdefault("MASTER_PORT", "29500")
    started = time.monotonic()
    try:  # env:// also reuses the torchrun agent's store when the launcher offers it
        dist.init_process_group(
            backend, init_method="env://", rank=rank, world_size=size, timeout=timeout
        )
    except (
        RuntimeError,
        ValueError,
    ) as exc:  # DistNetworkError and DistStoreError are RuntimeErrors
        waited = time.monotonic() - started
        first = first_line(exc)
        raise GradmeshError(
            f"rank {rank}: could not join the job at master {addr}:{port} "
            f"after {waited:.0f} s (timeout {timeout.total_seconds():.0f} s): {first}"
        ) from None


def _host_groups(
    rank: int, size: int, local_rank: int, device: torch.device
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None, int, int]:
    """Intra-host and cross-host groups; hosts are found by all-gathering each rank's node id."""
    node = _env_int("GROUP_RANK", -1)
    mine = torch.tensor([node, local_rank], dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(everyone, mine)
    pairs = [(int(t[0]), int(t[1])) for t in everyone]
    if any(n < 0 for n, _ in pairs):  # not started by torchrun: one host per LOCAL_WORLD_SIZE ranks
        local_size = _env_int("LOCAL_WORLD_SIZE", size)
        pairs = [(r // local_size, r % local_size) for r in range(size)]
    nodes = sorted({n for n, _ in pairs})
    by_node = [[r for r, (n, _) in enumerate(pairs) if n == node_id] for node_id in nodes]
    local_ranks = sorted({lr for _, lr in pairs})
    by_local = [[r for r, (_, lr) in enumerate(pairs) if lr == want] for want in local_ranks]
    my_node, my_local = pairs[rank]
    if size == 1:
        return None, None, 0, 1
    local_group, _ = dist.new_subgroups_by_enumeration(by_node)  # type: ignore[no-untyped-call]
    cross_group, _ = dist.new_subgroups_by_enumeration(by_local)  # type: ignore[no-untyped-call]
    cross_members = by_local[local_ranks.index(my_local)]
    return local_group, cross_group, cross_members.index(rank), len(cross_members)


def init(timeout_s: float | None = None, backend: str | None = None) -> Runtime:
    """Join the job described by the torchrun environment (or a world of one) and return it.

    `timeout_s` bounds rendezvous and every collective (default 60 s, or GRADMESH_TIMEOUT_S).
    Calling `init()` again in an initialised process returns the existing runtime.
    """
    global _runtime
    if _runtime is not None:
        return _runtime
    rank = _env_int("RANK", 0)
    size = _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    local_size = _env_int("LOCAL_WORLD_SIZE", size)
    if size < 1 or not 0 <= rank < size:
        raise GradmeshError(f"bad process world: RANK={rank} WORLD_SIZE={size}")
    timeout = timedelta(seconds=_timeout_s(timeout_s))
    chosen, device = _pick_backend(local_size, backend)
    _connect(chosen, rank, size, timeout)
    local_group, cross_group, cross_rank, cross_size = _host_groups(rank, size, local_rank, device)
    if local_group is not None:
        local_size = dist.get_world_size(local_group)
    async_group = dist.new_group(list(range(size))) if size > 1 else None
    atexit.register(shutdown)  # scripts that never call shutdown() still leave together
    _runtime = Runtime(
        rank=rank,
        size=size,
        local_rank=local_rank,
        local_size=local_size,
        cross_rank=cross_rank,
        cross_size=cross_size,
        backend=chosen,
        device=device,
        timeout=timeout,
        local_group=local_group,
        cross_group=cross_group,
        grid=WorkerGrid(data=size),
        async_group=async_group,
    )
    return _runtime


def is_initialized() -> bool:
    return _runtime is not None


def get_runtime() -> Runtime:
    """The initialised runtime; a clear error when `init()` has not been called."""
    if _runtime is None:
        raise GradmeshError("gradmesh is not initialised: call gradmesh.init() first")
    return _runtime


def rank() -> int:
    return get_runtime().rank


def size() -> int:
    return get_runtime().size


def local_rank() -> int:
    return get_runtime().local_rank


def local_size() -> int:
    return get_runtime().local_size


def cross_rank() -> int:
    return get_runtime().cross_rank


def cross_size() -> int:
    return get_runtime().cross_size


def barrier() -> None:
    """Wait until every rank reaches this point (bounded by the collective timeout)."""
    dist.barrier()


def shutdown() -> None:
    """Leave the job and free the process groups; safe to call twice."""
    global _runtime
    if _runtime is not None:
        if _runtime.timeline is not None:
            from gradmesh.timeline import stop_timeline

            stop_timeline()
        if _runtime._executor is not None:
            _runtime._executor.shutdown(wait=True, cancel_futures=True)
        if _runtime.size > 1 and dist.is_initialized():
            # leave together: a rank tearing its Gloo connections down while a peer still uses
            # them made the peer abort ("terminate called") now and then
            with contextlib.suppress(RuntimeError):
                dist.barrier()
    if dist.is_initialized():
        dist.destroy_process_group()
    _runtime = None


def exit_process(code: int) -> NoReturn:
    """End a worker process of gradmesh's own entry points after `shutdown()`: flush output and
    leave without running C++ static destructors, one of which (in a c10d/Gloo thread) aborted
    now and then at interpreter exit ("terminate called without an active exception")."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
