"""Hogwild! (Recht et al. 2011): workers on one host update one model in shared memory, no locks.

`share_model` moves a model's parameters and buffers into one file-backed segment in /dev/shm that
every rank maps (`torch.from_file(shared=True)`): rank 0 writes its values, the others map the
same file, and once all have it the file is unlinked, so nothing outlives the job. Each worker then
steps its own optimizer on its own data and writes straight into the shared weights. With sparse
gradients (`EmbeddingBag(sparse=True)`) a step touches only the rows its batch uses, and
collisions between workers are rare: the regime where Hogwild! scales. `lock=True` serialises the
updates with an `flock` on the segment, for comparison.

Optimizer state (momentum, Adam moments) stays private to each worker; only the weights are
shared. The segment lives in one host's memory, so every rank must be on the same host and on CPU.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from gradmesh.collectives import broadcast_object
from gradmesh.errors import GradmeshError
from gradmesh.runtime.world import barrier, get_runtime
from gradmesh.sync.wrapping import wrap_optimizer

ALIGN = 64
SHM_DIR = "/dev/shm"


@dataclass
class SharedModel:
    """The shared segment a model's tensors now live in, and this rank's counters."""

    nbytes: int
    tensors: int
    lock: bool
    _lock_fd: int
    updates: int = 0
    """Optimizer steps this rank has applied to the shared weights."""

    def close(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


def _check_one_host() -> None:
    rt = get_runtime()
    if rt.local_size != rt.size:
        raise GradmeshError(
            f"hogwild shares memory within one host, but this job's {rt.size} ranks are spread "
            f"over {rt.size // max(rt.local_size, 1)} hosts; run it with all workers on one host"
        )
    if rt.device.type != "cpu":
        raise GradmeshError(f"hogwild shares CPU memory; this rank trains on {rt.device}")
    if rt.mesh.split:
        raise GradmeshError(
            f"hogwild shares one whole model between workers; this job splits it "
            f"({rt.mesh.shape.describe()}): use tensor and pipeline parallel 1"
        )


def share_model(model: nn.Module, lock: bool = False) -> SharedModel:
    """Put `model`'s parameters and buffers (rank 0's values) in memory shared by every rank.

    Collective: every rank calls it with the same architecture. Returns the segment's handle;
    give it to `HogwildOptimizer`.
    """
    _check_one_host()
    rt = get_runtime()
    tensors = [*model.parameters(), *model.buffers()]
    spans, total = [], 0
    for t in tensors:
        spans.append((total, total + t.numel() * t.element_size()))
        total = -(-spans[-1][1] // ALIGN) * ALIGN
    if total == 0:
        raise GradmeshError("hogwild: the model has no parameters to share")
    path = ""
    try:
        if rt.rank == 0:
            where = SHM_DIR if os.path.isdir(SHM_DIR) else None
            fd, path = tempfile.mkstemp(prefix="gradmesh-hogwild-", dir=where)
            os.ftruncate(fd, total)
            os.close(fd)
        shared_path = str(broadcast_object(path))
        flat = torch.from_file(shared_path, shared=True, size=total, dtype=torch.uint8)
        lock_fd = os.open(shared_path, os.O_RDWR) if lock else -1
        views = [
            flat[a:b].view(t.dtype).view(t.shape) for t, (a, b) in zip(tensors, spans, strict=True)
        ]
        with torch.no_grad():
            if rt.rank == 0:
                for view, t in zip(views, tensors, strict=True):
                    view.copy_(t)
            barrier()  # rank 0's values are in place and every rank has the file open
            for view, t in zip(views, tensors, strict=True):
                t.data = view
    finally:
        if rt.rank == 0 and path:
            os.unlink(path)  # the mappings stay; nothing is left in /dev/shm
    return SharedModel(nbytes=total, tensors=len(tensors), lock=lock, _lock_fd=lock_fd)


class _HogwildMixin:
    _hogwild: SharedModel

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        shared = self._hogwild
        if shared.lock:
            fcntl.flock(shared._lock_fd, fcntl.LOCK_EX)
        try:
            result = super().step(closure)  # type: ignore[misc]
        finally:
            if shared.lock:
                fcntl.flock(shared._lock_fd, fcntl.LOCK_UN)
        shared.updates += 1
        return result


def HogwildOptimizer(optimizer: Optimizer, shared: SharedModel) -> Optimizer:  # noqa: N802
    """`optimizer` stepping the shared weights of `shared` (under its lock if it has one)."""
    return wrap_optimizer(optimizer, _HogwildMixin, _hogwild=shared)
