"""Tensor- and object-level operations with Horovod's names and semantics.

Asynchronous operations run on the runtime's one communication thread, in submission order, so
every rank issues them in the same order. Objects travel as JSON, never pickle: gradmesh does
not unpickle anything that came over the network.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from gradmesh.collectives import Op, allreduce, broadcast, broadcast_object
from gradmesh.collectives import allgather as gather_equal
from gradmesh.compression import Compressor, Link, NoCompression, reduce, resolve
from gradmesh.errors import GradmeshError
from gradmesh.runtime import get_runtime

Handle = Future[torch.Tensor]


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


def _reduce_copy(
    tensor: torch.Tensor,
    op: Op,
    algorithm: str,
    compression: Compressor | str | None,
    name: str | None,
    prescale: float,
    postscale: float,
) -> torch.Tensor:
    copy = tensor.detach().clone()
    if prescale != 1.0:
        copy.mul_(prescale)
    if get_runtime().size > 1:
        copy = compressed_allreduce(
            copy, resolve(compression), op, algorithm, get_runtime().async_group, name
        )
    return copy.mul_(postscale) if postscale != 1.0 else copy


def allreduce_async(
    tensor: torch.Tensor,
    op: Op = "average",
    algorithm: str = "native",
    compression: Compressor | str | None = None,
    name: str | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Handle:
    """Start reducing a copy of `tensor` (times `prescale_factor` before, `postscale_factor`
    after, as Horovod does); `synchronize(handle)` returns the result. `name`, if given, must
    be the same on every rank for the same call."""
    rt = get_runtime()
    args = (tensor, op, algorithm, compression, name, prescale_factor, postscale_factor)
    if rt.size == 1:
        done: Handle = Future()
        done.set_result(_reduce_copy(*args))
        return done
    return rt.comm_executor().submit(_reduce_copy, *args)


def synchronize(handle: Handle) -> torch.Tensor:
    """Wait for an asynchronous operation and return its result (each collective it runs is
    bounded by the job's timeout, so this wait is too)."""
    return handle.result()


def poll(handle: Handle) -> bool:
    """Whether an asynchronous operation has finished."""
    return handle.done()


def allgather_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's tensor along dimension 0; first dimensions may differ."""
    rt = get_runtime()
    if rt.size == 1:
        return tensor.detach().clone()
    rows = gather_equal(torch.tensor([tensor.shape[0] if tensor.dim() else 1]))
    lengths = [int(n) for n in rows.reshape(-1)]
    longest = max(lengths)
    item = tensor.reshape(-1, *tensor.shape[1:]) if tensor.dim() else tensor.reshape(1)
    padded = torch.zeros((longest, *item.shape[1:]), dtype=item.dtype, device=item.device)
    padded[: item.shape[0]] = item
    everyone = gather_equal(padded)
    return torch.cat([everyone[r, :n] for r, n in enumerate(lengths)])


def broadcast_optimizer_state(optimizer: Optimizer, root_rank: int = 0) -> None:
    """Give every rank the root's optimizer state (hyper-parameters, step counts, buffers such as
    momentum), creating state entries a rank does not have yet."""
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
                tensor = torch.zeros(spec["shape"], dtype=dtype)
            tensor = tensor.to(dtype).contiguous()
            broadcast(tensor, root=root_rank)
            rebuilt[key] = tensor
        new_state[int(index)] = rebuilt
    optimizer.load_state_dict({"state": new_state, "param_groups": manifest["param_groups"]})
