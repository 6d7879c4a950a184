"""All-to-all over one mesh axis, counted and timed, a failure naming this rank, its peers and
the operation: what context parallelism's all-to-all attention (equal parts, `layout/context/
ulysses.py`) and expert parallelism's dispatch (each step's uneven counts, `layout/expert/
dispatch.py`) both exchange. torch's `all_to_all_single` does the exchange; this adds the
job's timeout, the one-line failure and the byte count the report reads."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from gradmesh.errors import PeerFailure, first_line
from gradmesh.runtime.mesh import Axis
from gradmesh.runtime.world import get_runtime


def all_to_all(
    x: torch.Tensor,
    axis: Axis,
    label: str,
    kind: str,
    splits: tuple[list[int], list[int]] | None = None,
) -> torch.Tensor:
    """All-to-all of the rows of `x` over `axis`: equal parts (part j to rank j, part i back
    from rank i), or by `splits` = (rows from each rank, rows to each rank). The bytes sent
    count under `kind`; a failure is one line naming `label`."""
    rt = get_runtime()
    x = x.contiguous()
    out_splits, in_splits = splits if splits is not None else (None, None)
    if out_splits is None:
        out, sent_rows = torch.empty_like(x), [x.shape[0] // axis.size] * axis.size
    else:
        out, sent_rows = x.new_empty((sum(out_splits), *x.shape[1:])), list(in_splits or [])
    started = time.perf_counter()
    try:
        dist.all_to_all_single(out, x, out_splits, in_splits, group=axis.group, async_op=True).wait(
            rt.timeout
        )
    except RuntimeError as exc:
        others = ", ".join(str(r) for r in axis.ranks if r != rt.rank)
        raise PeerFailure(
            f"rank {rt.rank}: {label} on {axis.name}: waiting for rank(s) {others} failed: "
            f"{first_line(exc)}"
        ) from None
    row = x[0].numel() * x.element_size() if len(x) else 0
    sent = (sum(sent_rows) - sent_rows[axis.index]) * row
    rt.comm.add(sent, time.perf_counter() - started, kind)
    return out
