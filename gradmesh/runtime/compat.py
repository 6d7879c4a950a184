"""The torch releases gradmesh runs on, and the few calls whose names moved between them.

Supported: torch 2.11 (what CUDA images ship) to 2.15 (docs/testing.md says how the range was
checked). `check_torch` refuses an older torch in one line before anything else loads; a newer
one runs, with one line saying it is untested.

torch 2.13 named the tensor collectives `all_gather_single` / `reduce_scatter_single`; 2.11 and
2.12 have only `all_gather_into_tensor` / `reduce_scatter_tensor` (same arguments, same
semantics). Each call here takes whichever this torch has.
"""

from __future__ import annotations

import sys
from importlib import metadata
from typing import Any

OLDEST = (2, 11)
NEWEST = (2, 15)
RANGE = f"torch {OLDEST[0]}.{OLDEST[1]} to {NEWEST[0]}.{NEWEST[1]}"


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as '2.11.0+cu128' or '2.15.0.dev20260101'."""
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


def check_torch(version: str | None = None) -> str | None:
    """Raise one line for a torch older than the range; a warning line for a newer one (None
    inside the range, or where torch's version cannot be read: the import then says why)."""
    from gradmesh.errors import GradmeshError

    if version is None:
        try:
            version = metadata.version("torch")
        except metadata.PackageNotFoundError:
            return None
    have = release(version)
    if have < OLDEST:
        raise GradmeshError(
            f"gradmesh needs {RANGE}; this python has torch {version}: install one in the range"
        )
    if have > NEWEST:
        return f"gradmesh: torch {version} is newer than the tested range ({RANGE})"
    return None


def check_at_import() -> None:
    """`import gradmesh`'s check: an older torch is one line, on which the command line exits
    (status 2) and which a script gets as its ImportError's message; a newer one, one line on
    stderr."""
    from gradmesh.errors import GradmeshError

    try:
        line = check_torch()
    except GradmeshError as exc:
        if sys.argv and sys.argv[0].rsplit("/", 1)[-1] in ("gradmesh", "cli.py"):
            print(f"gradmesh: error: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        raise ImportError(str(exc)) from None
    if line:
        print(line, file=sys.stderr)


def all_gather_single(output: Any, tensor: Any, group: Any = None, async_op: bool = False) -> Any:
    """Every rank's equal-sized `tensor`, concatenated into `output`."""
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, tensor, group=group, async_op=async_op)


def reduce_scatter_single(
    output: Any, tensor: Any, op: Any = None, group: Any = None, async_op: bool = False
) -> Any:
    """This rank's part of `tensor` reduced over the ranks, into `output`."""
    import torch.distributed as dist

    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    op = dist.ReduceOp.SUM if op is None else op
    return scatter(output, tensor, op=op, group=group, async_op=async_op)
