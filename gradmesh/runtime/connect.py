"""Joining a job: the timeout, the backend, the rendezvous that forms the default group (with
its retry when a store goes away under a rank), and the intra-host and cross-host groups."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed.distributed_c10d import PrefixStore
from torch.distributed.rendezvous import rendezvous

from gradmesh.errors import GradmeshError, first_line
from gradmesh.runtime.process import (
    BACKEND_ENV,
    ROUND_ENV,
    _env_int,
    gpu_share_problem,
    restarts,
)


def pick_backend(local_size: int, requested: str | None) -> tuple[str, torch.device]:
    backend = requested or os.environ.get(BACKEND_ENV) or ""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    problem = gpu_share_problem(local_size, gpus, backend)
    if problem:
        raise GradmeshError(problem)
    cuda_ok = gpus > 0 and local_size <= gpus
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


_joins = 0
"""How many times this process has joined a job of more than one rank (see `_connect`)."""


def connect(backend: str, rank: int, size: int, timeout: timedelta) -> bool:
    """Form the default group (or join one an engine formed); whether it was adopted."""
    # torch.distributed.nn.functional takes `group=group.WORLD` as a default argument: imported
    # after init (torch._dynamo pulls it in lazily), it would hold the world group forever and
    # `shutdown()` could not free it (see `Runtime.release_groups`). Imported first, it holds None.
    import torch.distributed.nn.functional  # noqa: F401

    if dist.is_initialized():  # an engine (Ray Train) formed the job's group before us: join it
        have = (dist.get_rank(), dist.get_world_size())
        if have != (rank, size):
            raise GradmeshError(
                f"rank {rank}: a process group already exists with rank {have[0]} of "
                f"{have[1]}, but RANK={rank} WORLD_SIZE={size}"
            )
        return True
    if size == 1 and "MASTER_ADDR" not in os.environ:
        store = dist.HashStore()  # type: ignore[attr-defined]
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
        return False
    addr = os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    port = os.environ.setdefault("MASTER_PORT", "29500")
    started = time.monotonic()
    global _joins
    while True:
        left = timeout.total_seconds() - (time.monotonic() - started)
        count = c10d._world.group_count
        try:
            _join_default_group(backend, rank, size, timedelta(seconds=max(left, 1.0)))
            _joins += 1
            return False
        except (RuntimeError, ValueError) as exc:  # DistNetworkError, DistStoreError
            if rank != 0 and _store_went_away(exc) and left > STORE_RETRY_S:
                # a rank back from shutdown() before rank 0 reached an old store server in its
                # last moments (Horovod's init, shutdown, init cycle): join rank 0's new one.
                # torch named the failed group already (its store keys carry the name): forget
                # it, or this rank would wait under a name rank 0 never uses
                if dist.is_initialized():
                    dist.destroy_process_group()
                c10d._world.group_count = count
                time.sleep(STORE_RETRY_S)
                continue
            waited = time.monotonic() - started
            raise GradmeshError(
                f"rank {rank}: could not join the job at master {addr}:{port} "
                f"after {waited:.0f} s (timeout {timeout.total_seconds():.0f} s): "
                f"{first_line(exc)}"
            ) from None


STORE_RETRY_S = 0.1
_STORE_GONE = ("Connection was likely closed", "Connection reset by peer", "Broken pipe")


def _store_went_away(exc: BaseException) -> bool:
    """Whether `exc` says the rendezvous store closed the connection under us."""
    return any(words in str(exc) for words in _STORE_GONE)


def _join_default_group(backend: str, rank: int, size: int, timeout: timedelta) -> None:
    """Rendezvous through env:// (which reuses the torchrun agent's store when the launcher
    offers it) and form the default group."""
    store, _, _ = next(rendezvous("env://", rank, size, timeout=timeout))
    store.set_timeout(timeout)
    # each join of this process after a shutdown() gets keys of its own in the store: the
    # agent's store outlives the job's groups, and Gloo reading the addresses the previous
    # join published there connected to ports long closed (Horovod's init, shutdown, init)
    # and so does each attempt of a job the launcher restarted (--max-restarts), or each
    # round of an elastic job's rendezvous (there the attempt counts differ between hosts)
    attempt = restarts()
    round_ = os.environ.get(ROUND_ENV)
    generation = f"round-{round_}" if round_ is not None else f"attempt-{attempt}"
    fresh = attempt or _joins or round_ is not None
    joined = f"gradmesh-{generation}-join-{_joins}/" if fresh else ""
    dist.init_process_group(
        backend,
        store=PrefixStore(joined + "default_pg", store),
        rank=rank,
        world_size=size,
        timeout=timeout,
    )


def host_groups(
    rank: int, size: int, local_rank: int, device: torch.device, timeout: timedelta
) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None, int, int, list[int]]:
    """Intra-host and cross-host groups, this rank's cross rank and size, and the ranks each
    host holds (by host); hosts are found by all-gathering each rank's node id."""
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
        return None, None, 0, 1, [1]
    # every group gets the job's timeout: without it torch gives subgroups its 30-minute default
    local_group, _ = dist.new_subgroups_by_enumeration(by_node, timeout=timeout)  # type: ignore[no-untyped-call]
    cross_group, _ = dist.new_subgroups_by_enumeration(by_local, timeout=timeout)  # type: ignore[no-untyped-call]
    cross_members = by_local[local_ranks.index(my_local)]
    hosts = [len(ranks) for ranks in by_node]
    return local_group, cross_group, cross_members.index(rank), len(cross_members), hosts
