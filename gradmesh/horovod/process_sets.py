"""Horovod's process sets: collectives over some of the ranks, registered on every rank."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist

from gradmesh.collectives.objects import differing
from gradmesh.errors import GradmeshError
from gradmesh.horovod.coordinator import Coordinator, close, coordinator
from gradmesh.horovod.headers import ALLGATHER, header, tensors_only
from gradmesh.runtime.world import get_runtime, rank, size
from gradmesh.sync.data_parallel import api as _api
from gradmesh.sync.data_parallel.api import Handle

__all__ = [
    "add_process_set",
    "global_process_set",
    "ProcessSet",
    "remove_process_set",
]


# -- process sets --------------------------------------------------------------------------


class ProcessSet:
    """Horovod's process set: collectives over some of the ranks. Made from a list of global
    ranks and registered on every rank with `add_process_set` (or `init(process_sets=...)`);
    only its ranks then call collectives with `process_set=` it. gradmesh has no MPI, so a set
    is never made from a communicator."""

    def __init__(self, ranks: Iterable[int]) -> None:
        given = list(ranks)
        if any(type(r) is not int for r in given):
            raise GradmeshError(f"a ProcessSet is made from a list of ranks (ints), got {given!r}")
        self.ranks: list[int] | None = sorted(given)
        self.process_set_id: int | None = None
        self._groups: tuple[Any, Any] | None = None
        """Weak references to (the group its collectives run on, the group its
        DistributedOptimizer reduces on); None on a rank outside the set."""

    def included(self) -> bool:
        """Whether this rank belongs to the set."""
        return self.ranks is not None and rank() in self.ranks

    def size(self) -> int:
        return len(self.ranks or ())

    def rank(self) -> int:
        """This rank's place in the set (-1 outside it)."""
        return self.ranks.index(rank()) if self.ranks and rank() in self.ranks else -1

    def _invalidate(self) -> None:
        self.process_set_id = None
        self._groups = None

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet([])
"""Every rank of the job (its ranks are filled in by `init`)."""
global_process_set.process_set_id = 0
_sets: dict[int, ProcessSet] = {}
"""The registered process sets other than the global one, by id."""


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set; every rank calls it with the same ranks, in the same order. Ranks
    that disagree, or bad ranks on any rank, are one error on every rank."""
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    assert ps.ranks is not None
    rt = get_runtime()
    problem = ""
    if not ps.ranks:
        problem = "no ranks"
    elif len(set(ps.ranks)) != len(ps.ranks):
        problem = f"a rank twice in {ps.ranks}"
    elif not 0 <= ps.ranks[0] <= ps.ranks[-1] < rt.size:
        problem = f"ranks {ps.ranks} outside 0..{rt.size - 1}"
    elif ps.process_set_id is not None:
        problem = f"a set already registered as id {ps.process_set_id}"
    me = f"rank {rt.rank}: add_process_set"
    given = differing([problem, ps.ranks]) or [[problem, ps.ranks]] * rt.size
    bad = [r for r, (trouble, _) in enumerate(given) if trouble]
    if bad:
        mine = f" ({problem})" if problem else ""
        raise GradmeshError(f"{me}: rank {bad[0]} gave bad ranks{mine}")
    if any(ranks != given[0][1] for _, ranks in given):
        said = "; ".join(f"rank {r} gave {ranks}" for r, (_, ranks) in enumerate(given))
        raise GradmeshError(f"{me}: the ranks disagree on the set's members: {said}")
    if any(other.ranks == ps.ranks for other in _sets.values()):
        raise GradmeshError(f"{me}: a process set with ranks {ps.ranks} is already registered")
    ps.process_set_id = max(_sets, default=0) + 1
    label = f"process set {ps.process_set_id}"
    groups = [rt.group_over(f"{label} ({kind})", ps.ranks) for kind in ("ops", "optimizer")]
    ps._groups = None if groups[0] is None else (weakref.ref(groups[0]), weakref.ref(groups[1]))
    _sets[ps.process_set_id] = ps
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a set on every rank and free its groups; False for the global set."""
    if process_set is global_process_set or process_set.process_set_id == 0:
        return False
    _registered(process_set, "remove_process_set")
    close(
        process_set.process_set_id,  # type: ignore[arg-type]
        f"process set {process_set.process_set_id} (ranks {process_set.ranks}) was removed "
        "while it was pending",
    )
    if process_set._groups is not None:
        for ref in process_set._groups:
            group = ref()
            if group is not None:
                get_runtime().free_group(group)
    del _sets[process_set.process_set_id]  # type: ignore[arg-type]
    process_set._invalidate()
    return True


def _registered(process_set: Any, what: str) -> ProcessSet:
    if not isinstance(process_set, ProcessSet):
        raise GradmeshError(f"{what}: process_set must be a ProcessSet, got {process_set!r}")
    known = _sets.get(process_set.process_set_id)  # type: ignore[arg-type]
    if known is not process_set:
        raise GradmeshError(
            f"rank {rank()}: {what}: unknown process set {process_set.ranks} (register it with "
            "hvd.add_process_set on every rank; a removed set cannot be used)"
        )
    return process_set


def _group(
    process_set: Any, what: str, optimizer: bool = False, outside_ok: bool = False
) -> dist.ProcessGroup | None:
    """The group `what` runs on for `process_set`: None for the global set, else the set's own;
    one line for a set that is not registered or (unless `outside_ok`) a rank outside it."""
    if process_set is None or process_set is global_process_set:
        return None
    ps = _registered(process_set, what)
    if ps._groups is None and outside_ok:
        return None
    if ps._groups is None:
        raise GradmeshError(
            f"rank {rank()}: {what}: this rank is not in process set {ps.process_set_id} "
            f"(ranks {ps.ranks}); only its ranks call its collectives"
        )
    group = ps._groups[1 if optimizer else 0]()
    if group is None:
        raise GradmeshError(f"rank {rank()}: {what}: process set used after hvd.shutdown()")
    return group  # type: ignore[no-any-return]


def _root(root_rank: int, group: dist.ProcessGroup | None, what: str) -> int:
    members = range(size()) if group is None else dist.get_process_group_ranks(group)
    if root_rank not in members:
        where = "the job" if group is None else f"the process set (ranks {list(members)})"
        raise GradmeshError(f"rank {rank()}: {what}: root rank {root_rank} is not in {where}")
    return root_rank


def negotiated(process_set: Any, what: str) -> Coordinator | None:
    """The coordinator that matches `what` by name on `process_set` (one line for a set that
    is not registered or a rank outside it); None for a set of one rank (it runs at once)."""
    if process_set is None or process_set is global_process_set:
        rt = get_runtime()
        if rt.size == 1 or rt.async_group is None:
            return None
        return coordinator(0, rt.async_group, list(range(rt.size)))
    group = _group(process_set, what)
    ps = _registered(process_set, what)
    if ps.size() == 1 or group is None:
        return None
    return coordinator(ps.process_set_id, group, ps.ranks)  # type: ignore[arg-type]


Run = Callable[[dist.ProcessGroup | None, int], Any]
"""An operation's body: given its set's group and how many of the set's ranks have joined."""


def submit(process_set: Any, what: str, row: list[int], name: str | None, run: Run) -> Future[Any]:
    """Submit an operation to its set's coordinator (see `coordinator`); in a set of one it runs
    at once."""
    found = negotiated(process_set, what)
    if found is not None:
        group = found.group
        return found.submit(what, row, name, lambda joined: run(group, joined))
    done: Future[Any] = Future()
    alone = (
        None
        if process_set is None or process_set is global_process_set
        else _group(process_set, what)
    )
    try:
        done.set_result(run(alone, 0))
    except BaseException as exc:  # raised where Horovod raises it: at synchronize
        done.set_exception(exc)
    return done


def allgather_request(tensor: torch.Tensor, name: str | None, process_set: Any) -> Handle:
    """Every rank's `tensor` (a copy taken now) concatenated along dimension 0, matched by
    name; first dimensions may differ."""
    tensors_only("allgather", [tensor])
    copy = tensor.detach().clone()
    row = header(ALLGATHER, copy)
    return submit(process_set, "allgather", row, name, lambda g, _: _api.allgather_tensor(copy, g))


def combined(
    handles: list[Future[Any]],
    finish: Callable[[list[Any]], Any],
    done: Future[Any] | None = None,
) -> Future[Any]:
    """One handle (`done`, or a new future) for several requests: `finish(their results)` once
    all are done (the first error otherwise)."""
    done = Future() if done is None else done
    left = [len(handles)]

    def one(_: Future[Any]) -> None:
        left[0] -= 1
        if left[0]:
            return
        try:
            done.set_result(finish([h.result() for h in handles]))
        except BaseException as exc:  # an operation's own error, raised at synchronize
            done.set_exception(exc)

    for handle in handles:
        handle.add_done_callback(one)
    return done
