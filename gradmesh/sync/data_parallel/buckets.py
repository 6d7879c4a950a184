"""Fusion buckets: gradients packed into a few flat buffers, in the order backward makes them.

Parameters are taken in reverse registration order (backward produces the last layer's gradient
first) and cut into buckets of at most `fusion_bytes` and one dtype/device each. The layout is
the same on every rank because it depends only on the model (`check_models_agree` checks that
the models agree, once). Each bucket owns one flat buffer,
allocated once; the last bucket carries one extra element, the count of ranks still training
(1 from every active rank, 0 from a rank that has joined), so that `join` costs no extra message.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from gradmesh.collectives.native import modelled_bytes_sent
from gradmesh.collectives.objects import differing
from gradmesh.errors import GradmeshError, PeerFailure, first_line
from gradmesh.runtime.world import Runtime, collective_device


@dataclass
class Bucket:
    """A group of parameters whose gradients travel in one message."""

    index: int
    params: list[tuple[str, nn.Parameter]]
    buffer: torch.Tensor
    offsets: list[tuple[int, int]]
    has_flag: bool = False
    ready: set[int] = field(default_factory=set)
    """Positions (in `params`) whose gradient is final for this step."""
    views: list[torch.Tensor] = field(default_factory=list)
    """Each parameter's slice of the buffer, shaped like it: one fused copy moves them all."""
    skip: set[int] = field(default_factory=set)
    """Positions whose gradients travel sparse instead (`sparse.SparseGradients`), until the
    bucket is remade `without_skipped` them."""

    def __post_init__(self) -> None:
        self.views = [
            self.buffer[a:b].view_as(p)
            for (_, p), (a, b) in zip(self.params, self.offsets, strict=True)
        ]

    def without_skipped(self) -> Bucket:
        """This bucket without the parameters `skip` names (found sparse at the first step, as
        it leaves): they travel sparse, even at that step."""
        kept = [m for j, m in enumerate(self.params) if j not in self.skip]
        bucket = make_bucket(self.index, kept, self.has_flag, like=self.buffer)
        bucket.ready = set(range(len(kept)))
        return bucket

    def _dense_grads(self) -> list[torch.Tensor] | None:
        """Every parameter's gradient, when all exist and are dense (the usual step)."""
        grads = [p.grad for _, p in self.params]
        if not grads or self.skip or any(g is None or g.is_sparse for g in grads):
            return None
        return grads  # type: ignore[return-value]

    def _viewing(self, grads: list[torch.Tensor]) -> bool:
        """Whether the gradients are the bucket's own views (as torch DDP's
        `gradient_as_bucket_view`): backward then accumulated into the buffer itself, and the
        reduced values are the gradients, with no copy either way. Set at the first unpack;
        a `zero_grad(set_to_none=True)` drops them, and the next step copies once again."""
        return all(g is v for g, v in zip(grads, self.views, strict=True))

    @property
    def grad_numel(self) -> int:
        return self.offsets[-1][1] if self.offsets else 0

    def complete(self) -> bool:
        return len(self.ready) == len(self.params)

    def pack(self, active: bool) -> None:
        """Copy gradients into the buffer (a missing gradient, or a joined rank's, packs as
        zeros; a sparse one is densified, as Horovod's sparse_as_dense does)."""
        if not active:
            self.buffer.zero_()
            return
        if (grads := self._dense_grads()) is not None:
            if not self._viewing(grads):  # one call instead of one per parameter
                torch._foreach_copy_(self.views, grads)
            if self.has_flag:
                self.buffer[-1:].fill_(1.0)  # a kernel: a Python scalar set by index waits on a GPU
            return
        for j, ((_, p), (a, b)) in enumerate(zip(self.params, self.offsets, strict=True)):
            if p.grad is None or j in self.skip:
                self.buffer[a:b].zero_()
            else:
                grad = p.grad.to_dense() if p.grad.is_sparse else p.grad
                self.buffer[a:b].copy_(grad.reshape(-1))
        if self.has_flag:
            self.buffer[-1:].fill_(1.0)  # a kernel: a Python scalar set by index waits on a GPU

    def unpack(self, divisor: float | torch.Tensor) -> None:
        """Write the reduced gradients back (divided by `divisor` when averaging: a number, or
        a count still on the device)."""
        grads = self.buffer[: self.grad_numel]
        if isinstance(divisor, torch.Tensor) or divisor != 1.0:
            grads.div_(divisor)
        if (dense := self._dense_grads()) is not None:
            if not self._viewing(dense):  # from now on backward accumulates into the bucket
                for (_, p), view in zip(self.params, self.views, strict=True):
                    p.grad = view
            return
        for j, ((_, p), (a, b)) in enumerate(zip(self.params, self.offsets, strict=True)):
            if j in self.skip:
                continue
            reduced = grads[a:b].view_as(p)
            if p.grad is not None and p.grad.is_sparse:  # densified to travel, sparse again
                p.grad = reduced.to_sparse(p.grad.sparse_dim())  # (Horovod's sparse_as_dense)
            elif p.grad is None:
                p.grad = reduced.clone()
            else:
                p.grad.copy_(reduced)


def plan_buckets(params: list[tuple[str, nn.Parameter]], fusion_bytes: int) -> list[Bucket]:
    """Cut `params` (registration order) into buckets, last parameter first."""
    names = [n for n, _ in params]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise GradmeshError(f"parameter name {dup!r} appears twice in named_parameters")
    groups: list[list[tuple[str, nn.Parameter]]] = []
    size = 0
    for name, p in reversed(params):
        nbytes = p.numel() * p.element_size()
        same_kind = bool(groups) and (groups[-1][0][1].dtype, groups[-1][0][1].device) == (
            p.dtype,
            p.device,
        )
        if not groups or not same_kind or (size + nbytes > fusion_bytes and size > 0):
            groups.append([])
            size = 0
        groups[-1].append((name, p))
        size += nbytes
    if not groups:  # nothing to train: one flag-only bucket keeps join() working
        return [Bucket(0, [], torch.zeros(1, device=collective_device()), [], has_flag=True)]
    return [make_bucket(i, members, i == len(groups) - 1) for i, members in enumerate(groups)]


def make_bucket(
    index: int,
    members: list[tuple[str, nn.Parameter]],
    last: bool,
    like: torch.Tensor | None = None,
) -> Bucket:
    """A bucket of `members` (the last one also carries the count of ranks still training);
    `like` gives the dtype and device when there are no members."""
    offsets, at = [], 0
    for _, p in members:
        offsets.append((at, at + p.numel()))
        at += p.numel()
    kind = members[0][1] if members else like
    assert kind is not None
    buffer = torch.zeros(at + (1 if last else 0), dtype=kind.dtype, device=kind.device)
    return Bucket(index, members, buffer, offsets, has_flag=last)


def describe(params: list[tuple[str, nn.Parameter]]) -> list[str]:
    return [f"{n} {list(p.shape)} {str(p.dtype).removeprefix('torch.')}" for n, p in params]


def check_models_agree(
    rt: Runtime, params: list[tuple[str, nn.Parameter]], group: dist.ProcessGroup
) -> None:
    """Raise, naming the first differing parameter and the ranks, unless every rank has the
    same parameter names, shapes and dtypes (`differing`: checksums first, text on mismatch)."""
    try:
        listings = differing(describe(params), group)
    except RuntimeError as exc:
        raise PeerFailure(
            f"rank {rt.rank}: comparing the model's parameters on {rt.group_label(group)} "
            f"failed: {first_line(exc)}"
        ) from None
    if listings is None:
        return
    ranks = dist.get_process_group_ranks(group)
    for i in range(max(len(x) for x in listings)):
        entries = [x[i] if i < len(x) else "(none)" for x in listings]
        if len(set(entries)) > 1:
            which = "; ".join(f"rank {r}: {e}" for r, e in zip(ranks, entries, strict=True))
            raise GradmeshError(
                f"rank {rt.rank}: models differ across ranks at parameter #{i}: {which}"
            )


class NativeWork:
    """A bucket reduced by the backend's asynchronous allreduce, issued from the training thread
    on the optimizer's group (as torch DDP does): no thread handoff on the hot path."""

    def __init__(self, rt: Runtime, bucket: Bucket, label: str, group: dist.ProcessGroup) -> None:
        self.rt, self.bucket, self.label = rt, bucket, label
        self.started = time.perf_counter()
        try:
            self.work = dist.all_reduce(bucket.buffer, group=group, async_op=True)
        except RuntimeError as exc:
            raise self._error(exc) from None
        nbytes = bucket.buffer.numel() * bucket.buffer.element_size()
        rt.comm.add(modelled_bytes_sent(dist.get_world_size(group), nbytes), 0.0)

    def _error(self, exc: BaseException) -> PeerFailure:
        return PeerFailure(
            f"rank {self.rt.rank}: {self.label} (bucket {self.bucket.index}) failed: "
            f"{first_line(exc)}"
        )

    def result(self) -> None:
        waited = time.perf_counter()
        try:
            self.work.wait(self.rt.timeout)
        except RuntimeError as exc:
            raise self._error(exc) from None
        done = time.perf_counter()
        self.rt.comm.add(0, done - waited)
        if self.rt.timeline is not None:
            self.rt.timeline.add("reduce", "comm", self.started, done, bucket=self.bucket.index)
