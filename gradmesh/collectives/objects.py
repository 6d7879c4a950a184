"""Python objects on the wire without pickle: MessagePack, with tuples as an extension type.

Object collectives (`broadcast_object`, `allgather_object`) must round-trip the plain values
scripts send (Horovod pickles them) without ever unpickling bytes from the network. JSON, which
gradmesh used first, turns int keys into strings, tuples into lists and refuses bytes; MessagePack
(the `msgpack` library, well kept and without code execution on decode) keeps int and str keys,
bytes, floats bit for bit (NaN and infinities included) and nested containers, and its strict
mode hands every other type to us, so tuples, sets and frozensets travel as extension types 1-3
(a set's items sorted by their encoding, so that equal sets encode alike on every rank) and
anything else is refused in one line naming the type. Integers must fit in 64 bits.
"""

from __future__ import annotations

import zlib
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from gradmesh.collectives.ring import allgather
from gradmesh.collectives.tree import broadcast
from gradmesh.errors import GradmeshError
from gradmesh.runtime.world import collective_device, get_runtime

_TUPLE, _SET, _FROZENSET = 1, 2, 3
_CONTAINERS: dict[int, type] = {_TUPLE: tuple, _SET: set, _FROZENSET: frozenset}
PLAIN = (
    "None, bool, int (64-bit), float, str, bytes, and lists, tuples, sets, frozensets and dicts "
    "of them"
)


def _default(obj: Any) -> msgpack.ExtType:
    for code, kind in _CONTAINERS.items():
        if type(obj) is kind:  # a set's items in a fixed order: every rank encodes it alike
            values: Any = obj
            items = list(values) if kind is tuple else sorted(values, key=_pack)
            return msgpack.ExtType(code, _pack(items))
    if type(obj) is int:
        raise OverflowError(f"the integer {obj} does not fit in 64 bits")
    raise TypeError(f"type {type(obj).__name__}")


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_default, strict_types=True, use_bin_type=True)  # type: ignore[no-any-return]


def _ext(code: int, data: bytes) -> Any:
    if code not in _CONTAINERS:
        raise ValueError(f"unknown extension type {code}")
    return _CONTAINERS[code](_unpack(data))


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=_ext)


def encode(obj: Any, what: str) -> bytes:
    """`obj` as bytes; a one-line error naming the first type that cannot travel."""
    try:
        return _pack(obj)
    except TypeError as exc:
        raise GradmeshError(f"{what} cannot send {exc} (it sends {PLAIN}, never pickle)") from None
    except (OverflowError, ValueError) as exc:  # an int beyond 64 bits, a too deep nesting
        raise GradmeshError(f"{what} cannot send this object: {exc}") from None


def decode(data: bytes, what: str) -> Any:
    """The object `encode` made; a one-line error for bytes that are not one."""
    try:
        return _unpack(data)
    except Exception as exc:  # msgpack raises several types for malformed input
        raise GradmeshError(
            f"{what} received bytes that are not an encoded object: {type(exc).__name__}"
        ) from None


def _as_tensor(data: bytes) -> torch.Tensor:
    return (
        torch.frombuffer(bytearray(data), dtype=torch.uint8).to(collective_device())
        if data
        else torch.zeros(0, dtype=torch.uint8, device=collective_device())
    )


def _payload(obj: Any, what: str) -> tuple[bytes, int]:
    """(bytes to send, their length) or, when `obj` cannot travel, (the error's text, minus
    one minus its length): a negative length tells every rank to read a reason, not an object."""
    try:
        data = encode(obj, what)
    except GradmeshError as exc:
        text = f"rank {get_runtime().rank}: {exc}".encode()
        return text, -1 - len(text)
    return data, len(data)


def _gathered(rows: torch.Tensor, sizes: list[int], what: str) -> list[Any]:
    """Every rank's object from the padded rows, or the first refusal raised on every rank."""
    for row, n in zip(rows, sizes, strict=True):
        if n < 0:
            raise GradmeshError(row[: -1 - n].cpu().numpy().tobytes().decode())
    rows = rows.cpu()
    return [decode(row[:n].numpy().tobytes(), what) for row, n in zip(rows, sizes, strict=True)]


def _size(group: dist.ProcessGroup | None) -> int:
    return get_runtime().size if group is None else dist.get_world_size(group)


def broadcast_object(obj: Any, root_rank: int = 0, group: dist.ProcessGroup | None = None) -> Any:
    """Root's (a global rank's) object on every rank of the world or `group` (plain values
    only, see the module docstring); an object that cannot travel is the same one-line error
    on every rank."""
    rt = get_runtime()
    if _size(group) == 1:
        encode(obj, "broadcast_object")  # the same refusal as in a larger world
        return obj
    data, length = _payload(obj, "broadcast_object") if rt.rank == root_rank else (b"", 0)
    size = torch.tensor([length], dtype=torch.int64, device=collective_device())
    broadcast(size, root=root_rank, group=group)
    n = int(size)
    buf = (
        _as_tensor(data)
        if rt.rank == root_rank
        else torch.zeros(max(n, -1 - n), dtype=torch.uint8, device=collective_device())
    )
    broadcast(buf, root=root_rank, group=group)
    return _gathered(buf.unsqueeze(0), [n], "broadcast_object")[0]


def allgather_object(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's object, in rank order, on every rank of the world or `group` (plain values
    only); an object that cannot travel is a one-line error on every rank, naming the rank."""
    if _size(group) == 1:
        encode(obj, "allgather_object")
        return [obj]
    data, length = _payload(obj, "allgather_object")
    lengths = allgather(
        torch.tensor([length], dtype=torch.int64, device=collective_device()), group
    )
    sizes = [int(n) for n in lengths.reshape(-1)]
    padded = torch.zeros(
        max(max(max(n, -1 - n) for n in sizes), 1), dtype=torch.uint8, device=collective_device()
    )
    padded[: len(data)] = _as_tensor(data)
    return _gathered(allgather(padded, group), sizes, "allgather_object")


def differing(value: Any, group: dist.ProcessGroup | None = None) -> list[Any] | None:
    """Every rank's `value` (plain values), in rank order, when the ranks do not all hold the
    same one; None when they do. A checksum travels first, the values only on a mismatch: the
    one check that ranks agree on a model's parameters, a process set's members, and the like."""
    if _size(group) == 1:
        return None
    digest = torch.tensor(
        [zlib.crc32(encode(value, "differing"))], dtype=torch.int64, device=collective_device()
    )
    rows = allgather(digest, group).reshape(-1)
    if bool((rows == rows[0]).all()):
        return None
    return allgather_object(value, group)
