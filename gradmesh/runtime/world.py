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
import os
import sys
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gradmesh.errors import PEER_FAILED_EXIT, GradmeshError, PeerFailure, first_line, on_rank
from gradmesh.runtime import device_guard
from gradmesh.runtime.axes import PP, TP, MeshShape
from gradmesh.runtime.connect import connect, host_groups, pick_backend
from gradmesh.runtime.ending import exit_process, finish_reports_on_stop
from gradmesh.runtime.mesh import Axis, Mesh, build_mesh, group_of_lines
from gradmesh.runtime.process import _env_int, bind_to_launcher
from gradmesh.runtime.process import timeout_s as timeout_s_of
from gradmesh.runtime.stats import CommStats


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
    mesh: Mesh
    """The world on the mesh's axes (`gradmesh.mesh()`, `gradmesh.runtime.axes`): the
    splitting axes' ranks, adjacent, hold one replica of the model, the rest of the world is
    data-parallel."""
    widest_host: int = 1
    """The most ranks any host holds: the same on every rank (unlike `local_size` when hosts
    hold different numbers of ranks), so choices made from it agree across the world."""
    homogeneous: bool = True
    """Whether every host holds the same number of ranks (Horovod's `is_homogeneous`)."""
    comm: CommStats = field(default_factory=CommStats)
    workspace: dict[tuple[object, ...], torch.Tensor] = field(default_factory=dict)
    """Scratch buffers of the collectives, kept across calls so the hot path allocates nothing."""
    sequence: dict[int, int] = field(default_factory=dict)
    """Collective calls made so far on each group (by id): every call is numbered in messages."""
    group_names: dict[int, str] = field(default_factory=dict)
    owned: list[dist.ProcessGroup] = field(default_factory=list)
    """Every group `new_group` made. The runtime holds the only strong references to its groups
    (others keep weak ones), so that `shutdown()` can free them: see `release_groups`."""
    failure: BaseException | None = None
    """Set when this rank is failing: leaving then waits for nobody."""
    async_group: dist.ProcessGroup | None = None
    """A second world group, for the Horovod drop-in's coordinator of the global set: its rounds
    never meet collectives other threads issue on the default group (`horovod.coordinator`)."""
    timeline: Any = None
    """The running timeline (`gradmesh.observe.timeline`), if any."""
    on_shutdown: list[Callable[[], object]] = field(default_factory=list)
    """Run by `shutdown()` before the groups go (a timeline writes itself out there)."""
    adopted: bool = False
    """Whether an engine (Ray Train) formed the world group: it, not `shutdown()`, ends it."""
    _executor: ThreadPoolExecutor | None = None
    joinable: Callable[[], None] | None = None
    """What `gradmesh.join()` runs: the join of the most recently created DistributedOptimizer."""

    def next_sequence(self, group: dist.ProcessGroup) -> int:
        """Number the next collective call on `group` (1, 2, ...); every rank counts alike."""
        n = self.sequence.get(id(group), 0) + 1
        self.sequence[id(group)] = n
        return n

    def new_group(self, kind: str, axis: str | tuple[str, ...] | None = None) -> dist.ProcessGroup:
        """A new group over the whole world (or over this rank's line of mesh axes) with the job's
        timeout, named '<kind> <n>' in messages (n counts the groups of that kind). Every rank
        must call it, in the same order."""
        lines = [list(range(self.size))] if axis is None else self.mesh.shape.lines(axis)
        return self._own(kind, group_of_lines(lines, self.rank, self.timeout))

    def group_over(self, kind: str, ranks: list[int]) -> dist.ProcessGroup | None:
        """A group over the global `ranks`, made and named as `new_group`'s are; None on a rank
        outside it. Every rank of the world calls it, in the same order."""
        group = dist.new_group(ranks, timeout=self.timeout)
        return self._own(kind, group) if self.rank in ranks else None

    def _own(self, kind: str, group: dist.ProcessGroup) -> dist.ProcessGroup:
        n = 1 + sum(name.startswith(f"{kind} ") for name in self.group_names.values())
        self.group_names[id(group)] = f"{kind} {n}"
        self.owned.append(group)
        return group

    def free_group(self, group: dist.ProcessGroup) -> None:
        """Destroy a group `new_group` or `group_over` made, before shutdown."""
        self.owned = [g for g in self.owned if g is not group]
        self.group_names.pop(id(group), None)
        self.sequence.pop(id(group), None)
        dist.destroy_process_group(group)

    @property
    def dp(self) -> Axis:
        """The replicas that average gradients with this rank (`Mesh.replicas`)."""
        return self.mesh.replicas

    @property
    def batch(self) -> Axis:
        """The ranks that split the global batch with this one (`Mesh.batch`)."""
        return self.mesh.batch

    def release_groups(self) -> None:
        """Drop every reference the runtime holds to a process group, after
        `dist.destroy_process_group()`. A group's C++ object then ends at once, joining its
        backend threads. Kept alive into interpreter exit, a Gloo worker thread still releasing
        a finished call's tensors needs the GIL while Python finalizes, and the process aborts
        ("terminate called without an active exception") after its work was done."""
        self.local_group = self.cross_group = self.async_group = None
        self.mesh.release()
        self.owned.clear()
        self.group_names.clear()
        self.sequence.clear()
        self.workspace.clear()

    def group_label(self, group: dist.ProcessGroup) -> str:
        """'world', 'host-local', ... or the group's ranks, for messages."""
        name = self.group_names.get(id(group))
        if name is None:
            name = "ranks " + ",".join(str(r) for r in dist.get_process_group_ranks(group))
        return name

    def synchronize(self) -> None:
        """Wait for this rank's GPU to finish what it was given (nothing off CUDA): only where a
        time is read, never inside a step."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def comm_executor(self) -> ThreadPoolExecutor:
        """The one communication thread: asynchronous collectives run here, in submission order,
        so every rank issues them in the same order."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gradmesh-comm")
        return self._executor


_runtime: Runtime | None = None


def init(
    timeout_s: float | None = None,
    backend: str | None = None,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    mesh: Mapping[str, int] | None = None,
) -> Runtime:
    """Join the job described by the torchrun environment (or a world of one) and return it.

    `timeout_s` bounds rendezvous and every collective (default 60 s, or GRADMESH_TIMEOUT_S).
    The mesh is `mesh`, axis name -> size (`{"tp": 2, "pp": 2}`; the data axis `dp` is the rest
    of the world unless given), or the keywords `tensor_parallel` and `pipeline_parallel`:
    those ranks, adjacent, hold one replica of the model; `gradmesh.mesh()` has one group per
    axis. Calling `init()` again in an initialised process returns the existing runtime.
    """
    global _runtime
    if _runtime is None:  # first, so that init's own refusals are one line too
        _hook_on_top()
    sizes = _mesh_sizes(mesh, tensor_parallel, pipeline_parallel)
    rank, size = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    if _runtime is not None:
        if sizes and MeshShape.for_world(_runtime.size, **sizes) != _runtime.mesh.shape:
            asked = MeshShape.for_world(_runtime.size, **sizes).describe()
            raise GradmeshError(
                f"gradmesh is already initialised with {_runtime.mesh.shape.describe()}: "
                f"call shutdown() before init() with {asked}"
            )
        return _runtime
    device_guard.install()
    if size < 1 or not 0 <= rank < size:
        raise GradmeshError(f"bad process world: RANK={rank} WORLD_SIZE={size}")
    timeout = timedelta(seconds=timeout_s_of(timeout_s))
    shape = MeshShape.for_world(size, **sizes)
    bind_to_launcher(rank)
    if size > 1:  # a peer's failure is reported from this side before a launcher's SIGTERM
        finish_reports_on_stop()
    chosen, device = pick_backend(_env_int("LOCAL_WORLD_SIZE", size), backend)
    adopted = connect(chosen, rank, size, timeout)
    _hook_on_top()  # again over torch's, which its process group put on top ("[rank0]: ...")
    _runtime = _build(rank, size, chosen, device, timeout, shape)
    _runtime.adopted = adopted
    return _runtime


def _mesh_sizes(
    mesh: Mapping[str, int] | None, tensor_parallel: int, pipeline_parallel: int
) -> dict[str, int]:
    """The mesh `init` was asked for, axis -> size, from `mesh` or the keywords (not both)."""
    keywords = {TP: tensor_parallel, PP: pipeline_parallel}
    given = {k: v for k, v in keywords.items() if v != 1}
    if mesh is None:
        return given
    if given:
        raise GradmeshError(
            "init: give the mesh as mesh={...} or as tensor_parallel= / pipeline_parallel=, "
            "not both"
        )
    return dict(mesh)


def _build(
    rank: int, size: int, backend: str, device: torch.device, timeout: timedelta, shape: MeshShape
) -> Runtime:
    """The runtime of a joined job: its host groups, mesh and communication-thread group, each
    named for messages."""
    local_rank = _env_int("LOCAL_RANK", 0)
    local_group, cross_group, cross_rank, cross_size, hosts = host_groups(
        rank, size, local_rank, device, timeout
    )
    local_size = (
        dist.get_world_size(local_group) if local_group else _env_int("LOCAL_WORLD_SIZE", size)
    )
    async_group = dist.new_group(list(range(size)), timeout=timeout) if size > 1 else None
    owned: list[dist.ProcessGroup] = []
    rt = Runtime(
        rank=rank,
        size=size,
        local_rank=local_rank,
        local_size=local_size,
        cross_rank=cross_rank,
        cross_size=cross_size,
        backend=backend,
        device=device,
        timeout=timeout,
        local_group=local_group,
        cross_group=cross_group,
        mesh=build_mesh(shape, rank, timeout, owned),
        widest_host=max(hosts),
        homogeneous=len(set(hosts)) == 1,
        async_group=async_group,
        owned=owned,
    )
    rt.group_names[id(resolve_world())] = "world"
    for axis in rt.mesh.axes.values():
        rt.group_names[id(axis.group)] = f"{axis.name} axis"
    for group, label in (
        (async_group, "world (negotiation)"),
        (local_group, "host-local"),
        (cross_group, "cross-host"),
    ):
        if group is not None:
            rt.group_names[id(group)] = label
    return rt


def resolve_world() -> dist.ProcessGroup:
    """The default process group itself."""
    world = dist.group.WORLD
    if not isinstance(world, dist.ProcessGroup):
        raise GradmeshError("torch.distributed is not initialised: call gradmesh.init() first")
    return world


def mark_failed(exc: BaseException) -> int:
    """Record that this rank is failing with `exc` (so leaving waits for nobody); return the
    exit code a worker should end with."""
    if _runtime is not None:
        _runtime.failure = exc
    return PEER_FAILED_EXIT if isinstance(exc, PeerFailure) else 1


_HOOKS: list[Callable[..., Any]] = []


def _hook_on_top() -> None:
    """gradmesh's excepthook on top of whatever is there; the first registers the atexit leave
    (scripts that never call shutdown() still leave)."""
    if not getattr(sys.excepthook, "gradmesh", False):
        if not _HOOKS:
            atexit.register(_leave_at_exit)
        _HOOKS.append(_failing_hook(sys.excepthook))
        sys.excepthook = _HOOKS[-1]


def _failing_hook(previous: Callable[..., Any]) -> Callable[..., Any]:
    """sys.excepthook for scripts: an uncaught exception marks the rank failing; a gradmesh
    error is printed as its one line (it names the rank), anything else as usual."""

    def hook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        mark_failed(exc)
        if isinstance(exc, GradmeshError):
            rank = _runtime.rank if _runtime is not None else os.environ.get("RANK", "0")
            print(f"gradmesh: {on_rank(rank, exc)}", file=sys.stderr, flush=True)
        else:
            previous(kind, exc, tb)

    hook.gradmesh = True  # type: ignore[attr-defined]
    return hook


def is_initialized() -> bool:
    return _runtime is not None


def get_runtime() -> Runtime:
    """The initialised runtime; a clear error when `init()` has not been called."""
    if _runtime is None:
        raise GradmeshError("gradmesh is not initialised: call gradmesh.init() first")
    return _runtime


def collective_device() -> torch.device:
    """Where this process's collectives run (its GPU under NCCL; the CPU under Gloo, or before
    `init`): small tensors made for a collective are made here."""
    return torch.device("cpu") if _runtime is None else _runtime.device


def mesh() -> Mesh:
    return get_runtime().mesh  # the world on the mesh's axes: gradmesh.mesh()["dp"].group


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
    rt = get_runtime()
    world = resolve_world()
    sequence = rt.next_sequence(world)
    try:
        dist.barrier(group=world)
    except RuntimeError as exc:
        message = f"rank {rt.rank}: barrier #{sequence} on world: {first_line(exc)}"
        raise PeerFailure(message) from None


def shutdown() -> None:
    """Leave the job and free the process groups; safe to call twice. No rank waits for the
    others here: a rank that leaves early (it failed, or the user's script exited) must not sit
    in a barrier while its peers wait in a collective for it. A failing rank does not free its
    groups either, since a collective stuck in a backend thread would hold it."""
    global _runtime
    failing = _runtime is not None and _runtime.failure is not None
    adopted = _runtime is not None and _runtime.adopted
    if _runtime is not None:
        for hook in _runtime.on_shutdown:
            hook()
        _runtime.on_shutdown.clear()
        if _runtime._executor is not None:
            _runtime._executor.shutdown(wait=not failing, cancel_futures=True)
    if dist.is_initialized() and not failing:
        if not adopted:  # the engine that formed the world group ends it
            dist.destroy_process_group()
        if _runtime is not None:
            _runtime.release_groups()
    _runtime = None


def _leave_at_exit() -> None:
    """atexit: leave the job; a rank failing on an uncaught exception then ends at once, since
    interpreter teardown would wait for any collective still stuck in a backend thread."""
    if _runtime is not None:  # else never joined, or left: a group the script made is its own
        code = mark_failed(_runtime.failure) if _runtime.failure else None
        shutdown()
        if code is not None:
            exit_process(code)
