"""Tensor operations with Horovod's semantics (scale factors, reduce-scatter's split,
all-to-all's counts), run where the Horovod drop-in's coordinator runs them
(`gradmesh.horovod.coordinator`: on its thread, once every rank has submitted them), and the
optimizer-state broadcast."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from gradmesh.collectives import Op, allreduce, broadcast, broadcast_object
from gradmesh.collectives import allgather as gather_equal
from gradmesh.compression.base import Compressor, Link, NoCompression
from gradmesh.compression.registry import reduce, resolve
from gradmesh.errors import GradmeshError, GradmeshValueError
from gradmesh.runtime.world import collective_device, get_runtime

Handle = Future[torch.Tensor]


def members(group: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup | None, int, int]:
    """(the group an operation runs on, this rank's place in it, its size): `group` itself, or
    for None the world's negotiation group."""
    rt = get_runtime()
    if group is None:
        return rt.async_group, rt.rank, rt.size
    return group, dist.get_rank(group), dist.get_world_size(group)


def compressed_allreduce(
    tensor: torch.Tensor,
    compressor: Compressor,
    op: Op,
    algorithm: str,
    group: dist.ProcessGroup | None,
    name: str | None = None,
) -> torch.Tensor:
    """Reduce `tensor` in place through `compressor` (a fresh state: no error feedback carries
    over between calls). Integer tensors and min/max/product travel uncompressed."""
    if isinstance(compressor, NoCompression) or not tensor.is_floating_point():
        return allreduce(tensor, op=op, algorithm=algorithm, group=group, name=name)
    if op not in ("sum", "average"):
        raise GradmeshError(f"compression {compressor.name} sums; it cannot reduce with {op}")
    flat = tensor.detach().reshape(-1)  # a copy when `tensor` is not contiguous
    link = Link(group, algorithm, name=name)
    reduce(flat, compressor, compressor.new_state(flat.numel()), link)
    if op == "average":
        flat.div_(link.size)
    if flat.data_ptr() != tensor.data_ptr():
        tensor.copy_(flat.view_as(tensor))
    return tensor


def reduce_copy(
    tensor: torch.Tensor,
    op: Op,
    compression: Compressor | str | None,
    name: str | None,
    prescale: float,
    postscale: float,
    group: dist.ProcessGroup | None,
    algorithm: str = "native",
) -> torch.Tensor:
    """A copy of `tensor` reduced over `group` (times `prescale` before, `postscale` after, as
    Horovod scales)."""
    on, _, size = members(group)
    copy = _scaled(tensor.detach().clone(), prescale)
    if size > 1:
        copy = compressed_allreduce(copy, resolve(compression), op, algorithm, on, name)
    return _scaled(copy, postscale)


def _scaled(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """`tensor` times `factor` in place, as Horovod scales: an integer tensor is multiplied in
    double precision and cast back (truncated toward zero), keeping its dtype."""
    if factor == 1.0:
        return tensor
    if tensor.is_floating_point() or tensor.is_complex():
        return tensor.mul_(factor)
    return tensor.copy_((tensor.double() * factor).to(tensor.dtype))


def my_rows(reduced: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's block of `reduced`'s rows (Horovod's reduce-scatter split): with n rows over
    W ranks, rank r gets n // W rows, plus one for the first n % W ranks."""
    _, me, size = members(group)
    base, extra = divmod(reduced.shape[0], size)
    start = me * base + min(me, extra)
    return reduced[start : start + base + (me < extra)].clone()


MAX_DIMS = 8
"""Alltoall describes each rank's tensor in a fixed-size row: at most this many dimensions."""


def alltoall_tensor(
    tensor: torch.Tensor, splits: list[int] | None, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Send rows of `tensor` to every rank (`splits[r]` rows to rank r, in order; without
    splits, equal parts) and receive theirs, concatenated in rank order: (rows received, how
    many came from each rank). Every rank's splits are checked first, so bad ones are one error
    on every rank, not a hang."""
    group, me, world = members(group)
    rows = tensor.shape[0] if tensor.dim() else 0
    sends = [rows // world] * world if splits is None else list(splits)
    problem = ""
    if not 1 <= tensor.dim() <= MAX_DIMS:
        problem = f"a tensor of {tensor.dim()} dimensions (1 to {MAX_DIMS})"
    elif splits is None and rows % world:
        problem = f"{rows} rows that do not split equally over {world} ranks (give splits=)"
    elif len(sends) != world or min(sends) < 0 or sum(sends) != rows:
        problem = f"splits {sends} for {rows} rows over {world} ranks"
    dims = [] if problem else list(tensor.shape[1:])
    row = [0 if problem else 1, 0 if problem else tensor.dim(), *dims]
    row += [-1] * (MAX_DIMS - len(dims)) + ([0] * world if problem else sends)
    # every rank sees every rank's row
    own = torch.tensor(row, device=collective_device())
    table = gather_equal(own, group) if world > 1 else own.unsqueeze(0)
    bad = [r for r in range(world) if int(table[r, 0]) == 0]
    if bad:
        mine = f": {problem}" if problem else ""
        raise GradmeshValueError(f"rank {me}: alltoall: rank {bad[0]} gave bad input{mine}")
    if any(
        not torch.equal(table[r, 1 : 2 + MAX_DIMS], table[0, 1 : 2 + MAX_DIMS])
        for r in range(world)
    ):
        raise GradmeshError(
            f"rank {me}: alltoall: the ranks' tensors differ beyond the first dimension "
            f"(rank {me}: {tuple(tensor.shape[1:])})"
        )
    received = [int(table[r, 2 + MAX_DIMS + me]) for r in range(world)]
    # Gloo's all-to-all knows no int8 or int16 ("Invalid scalar type"): they travel widened
    carrier = CARRIERS.get(tensor.dtype, tensor.dtype)
    out = torch.empty((sum(received), *tensor.shape[1:]), dtype=carrier, device=tensor.device)
    if world > 1:
        dist.all_to_all_single(
            out,
            tensor.detach().to(carrier).contiguous(),
            output_split_sizes=received,
            input_split_sizes=sends,
            group=group,
        )
    else:
        out.copy_(tensor.detach())
    return out.to(tensor.dtype), torch.tensor(received, dtype=torch.int32, device="cpu")


CARRIERS = {
    torch.int8: torch.int32,
    torch.int16: torch.int32,
}
"""The dtype a tensor travels in through all-to-all where the backend lacks its own."""


def synchronize(handle: Handle) -> torch.Tensor:
    """Wait for an asynchronous operation and return its result (each collective it runs is
    bounded by the job's timeout, so this wait is too)."""
    return handle.result()


def poll(handle: Handle) -> bool:
    """Whether an asynchronous operation has finished."""
    return handle.done()


def allgather_tensor(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Concatenate every rank's tensor along dimension 0; first dimensions may differ."""
    if members(group)[2] == 1:
        return tensor.detach().clone()
    first = tensor.shape[0] if tensor.dim() else 1
    rows = gather_equal(torch.tensor([first], device=collective_device()), group)
    lengths = [int(n) for n in rows.reshape(-1)]
    longest = max(lengths)
    item = tensor.reshape(-1, *tensor.shape[1:]) if tensor.dim() else tensor.reshape(1)
    if longest == 0:  # every rank sent no rows
        return item.detach().clone()
    padded = torch.zeros((longest, *item.shape[1:]), dtype=item.dtype, device=item.device)
    padded[: item.shape[0]] = item
    everyone = gather_equal(padded, group)
    return torch.cat([everyone[r, :n] for r, n in enumerate(lengths)])


def broadcast_optimizer_state(optimizer: Optimizer, root_rank: int = 0) -> None:
    """Give every rank the root's optimizer state (hyper-parameters, step counts, buffers such as
    momentum), creating state entries a rank does not have yet. An optimizer that has not
    stepped is first given its state as Horovod gives it: a step on zero gradients, after which
    every parameter that requires a gradient has one (zeros) and the others keep None."""
    if not optimizer.state_dict()["state"]:
        _initialise_state(optimizer)
    rt = get_runtime()
    if rt.size == 1:
        return
    state = optimizer.state_dict()
    manifest = None
    if rt.rank == root_rank:
        entries = {}
        for index, values in state["state"].items():
            entries[str(index)] = {
                key: (
                    {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")}
                    if isinstance(v, torch.Tensor)
                    else {"value": v}
                )
                for key, v in values.items()
            }
        manifest = {"param_groups": state["param_groups"], "state": entries}
    manifest = broadcast_object(manifest, root_rank)
    new_state: dict[int, dict[str, Any]] = {}
    for index, values in manifest["state"].items():
        mine = state["state"].get(int(index), {})
        rebuilt: dict[str, Any] = {}
        for key, spec in values.items():
            if "value" in spec:
                rebuilt[key] = spec["value"]
                continue
            dtype = getattr(torch, spec["dtype"])
            tensor = mine.get(key)
            if not isinstance(tensor, torch.Tensor) or list(tensor.shape) != spec["shape"]:
                tensor = torch.zeros(spec["shape"], dtype=dtype, device=collective_device())
            tensor = tensor.to(dtype).contiguous()
            broadcast(tensor, root=root_rank)
            rebuilt[key] = tensor
        new_state[int(index)] = rebuilt
    optimizer.load_state_dict({"state": new_state, "param_groups": manifest["param_groups"]})


def _initialise_state(optimizer: Optimizer) -> None:
    """Horovod's way to create an unstepped optimizer's state: zero gradients and one step of
    the optimizer's own class (not a gradmesh wrapper's, which would synchronize)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    own = next(
        k
        for k in type(optimizer).__mro__
        if issubclass(k, Optimizer) and not k.__module__.startswith("gradmesh.")
    )
    own.step(optimizer)
