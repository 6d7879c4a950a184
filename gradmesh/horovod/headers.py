"""The coordinator's wire format (`coordinator.py`): each request's header (kind, dtype, shape,
op or root, unnamed counter) as a row of int64, a rank's summary each round, and Horovod's
response cache, which sends a request that ran before as one bit."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from gradmesh.errors import GradmeshError
from gradmesh.sync.data_parallel.reducer import Average, Sum

KINDS = (
    "join",
    "allreduce",
    "allgather",
    "broadcast",
    "DistributedOptimizer step",
    "reducescatter",
    "alltoall",
    "barrier",
    "broadcast_object",
    "allgather_object",
    "sparse_allreduce",
    "grouped_allreduce",
)
(
    JOIN,
    ALLREDUCE,
    ALLGATHER,
    BROADCAST,
    STEP,
    REDUCESCATTER,
    ALLTOALL,
    BARRIER,
    BROADCAST_OBJECT,
    ALLGATHER_OBJECT,
    SPARSE,
    GROUPED,
) = range(len(KINDS))
DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
OPS = (Sum, Average, "min", "max", "product")
"""A reduction's op, by the index its header carries."""
MAX_DIMS = 8
KIND, DTYPE, EXTRA, AUTO, NDIM, SHAPE = range(6)
HEADER = SHAPE + MAX_DIMS
ROW = 1 + HEADER
"""A request's row: its name's hash, then its header."""
WORDS, BITS = 8, 62
"""The response cache's bit set: WORDS int64 words of BITS bits (kept positive)."""
SUMMARY = 3 + WORDS
"""A rank's summary each round: the round it joined (-1: it has not), its new rows, whether it
is closing, the bits."""
SHAPED = (ALLREDUCE, REDUCESCATTER, BROADCAST, ALLGATHER, ALLTOALL)
"""Kinds whose header carries the tensor's dtype and shape (an allgather's and an alltoall's
without its first dimension, which may differ between ranks)."""
JOINABLE = (ALLREDUCE, GROUPED, STEP)
"""Kinds a joined rank takes part in (allreduce with Sum or Average only)."""
Key = tuple[int, ...]
DIFFERENT = "the ranks called different operations"


def name_hash(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") >> 1


def header(kind: int, tensor: torch.Tensor | None = None, extra: int = 0) -> list[int]:
    """A request's header (without its unnamed counter, which `submit` fills in)."""
    row = [kind, -1, extra, -1, 0] + [-1] * MAX_DIMS
    if tensor is not None:
        tensors_only(KINDS[kind], [tensor])
    if tensor is not None and kind in SHAPED:
        known = tensor.dtype in DTYPES and tensor.dim() <= MAX_DIMS
        row[DTYPE] = DTYPES.index(tensor.dtype) if known else len(DTYPES)
        dims = list(tensor.shape[:MAX_DIMS])
        if kind in (ALLGATHER, ALLTOALL) and dims:
            dims[0] = -1
        row[NDIM] = len(dims)
        row[SHAPE : SHAPE + len(dims)] = dims
    return row


def tensors_only(what: str, values: list[Any]) -> None:
    """One line where a call was given something else than tensors (a list of numbers, say),
    before anything reads a dtype off it."""
    for value in values:
        if not isinstance(value, torch.Tensor):
            raise GradmeshError(f"{what} takes torch tensors, got {type(value).__name__}")


def grouped_header(buffers: list[torch.Tensor], op: int) -> list[int]:
    """A grouped allreduce's header: one fused buffer per dtype, each as numel x 16 + its
    dtype's code (at most MAX_DIMS dtypes, far more than torch has in common use)."""
    if len(buffers) > MAX_DIMS or any(b.dtype not in DTYPES for b in buffers):
        raise GradmeshError(
            f"grouped_allreduce: at most {MAX_DIMS} dtypes of {len(DTYPES)} known ones in one group"
        )
    row = header(GROUPED, None, op)
    row[NDIM] = len(buffers)
    row[SHAPE : SHAPE + len(buffers)] = [b.numel() * 16 + DTYPES.index(b.dtype) for b in buffers]
    return row


def buffers_of(row: Key) -> list[tuple[int, torch.dtype]]:
    return [(code // 16, DTYPES[code % 16]) for code in row[SHAPE : SHAPE + row[NDIM]]]


def said(row: Key) -> str:
    """A header in words: 'allreduce of float32 (3, 4)'."""
    kind = row[KIND]
    if kind == GROUPED:
        parts = " + ".join(f"{str(d).removeprefix('torch.')} ({n},)" for n, d in buffers_of(row))
        return f"{KINDS[kind]} ({OPS[row[EXTRA]]}) of {parts}"
    if kind not in SHAPED:
        return KINDS[kind]
    code = row[DTYPE]
    dtype = str(DTYPES[code]).removeprefix("torch.") if code < len(DTYPES) else "other dtype"
    shape = tuple(row[SHAPE : SHAPE + row[NDIM]])
    more = f" from root {row[EXTRA]}" if kind == BROADCAST else ""
    op = f" ({OPS[row[EXTRA]]})" if kind in (ALLREDUCE, REDUCESCATTER) else ""
    return f"{KINDS[kind]}{op} of {dtype} {shape}{more}"


class Cache:
    """Horovod's response cache: keys that ran before, by bit, in least-recently-used order. Only
    the agreed order of execution changes it, so it is the same on every rank."""

    def __init__(self) -> None:
        self.bits: OrderedDict[Key, int] = OrderedDict()
        self.keys: dict[int, Key] = {}

    def put(self, key: Key) -> None:
        if key in self.bits:
            self.bits.move_to_end(key)
            return
        if len(self.bits) < WORDS * BITS:
            bit = len(self.bits)
        else:
            _, bit = self.bits.popitem(last=False)
        self.bits[key], self.keys[bit] = bit, key

    def encode(self, keys: list[Key]) -> tuple[list[int], list[Key]]:
        """The bit set of the cached keys and the list of the others."""
        words, new = [0] * WORDS, []
        for key in keys:
            bit = self.bits.get(key)
            if bit is None:
                new.append(key)
            else:
                words[bit // BITS] |= 1 << (bit % BITS)
        return words, new

    def decode(self, words: list[int]) -> list[Key]:
        out = []
        for w, word in enumerate(words):
            while word:
                low = word & -word
                out.append(self.keys[w * BITS + low.bit_length() - 1])
                word ^= low
        return out


@dataclass
class Round:
    """Every rank's side of one round."""

    joined: list[int]
    """The round each rank joined in, -1 for a rank that has not."""
    keys: list[list[Key]]
    """Each rank's pending keys: cached ones by bit, then new ones in submission order."""
    closing: list[bool]

    def active(self) -> list[int]:
        return [r for r, at in enumerate(self.joined) if at < 0]
