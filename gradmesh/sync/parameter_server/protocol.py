"""The parameter-server wire format: a fixed 91-byte header, then the body (raw tensor bytes or
JSON) whose length the header gives (`transport` reads the header first and checks it before it
reads the body). No pickle; a tensor body is sent without a copy and read as a view.

Header (little-endian):

    magic    4s  b"GMPS"           kind     B   Kind                dtype   B  DTYPES code
    version  B   WIRE_VERSION      ndim     B   0..MAX_DIMS         worker  H  worker index
    token    16s job token         clock    Q   worker's push count  seen   Q  server version read
    staleness I  clock gap of the read      shape 4I                 offset Q  element offset
    nbytes   Q   length of the tensor frame
    codec    B   compressor's wire id (0: none)   ctx 3I  its context (meaning set by the codec)

A compressed push carries its message as a uint8 tensor; the server decodes it with the codec's
own `decode`, which checks the context against the shard and the payload's length (`server`).

`decode` checks every field against the frames it came with and the receiver's limits and raises
`WireError` (never anything else) for a message that fails: wrong magic, version, kind or token,
an unknown dtype, a shape that does not match the byte count, a length over the receiver's bound,
too many frames. It allocates nothing beyond the header's fields: the payload stays a view.
"""

from __future__ import annotations

import enum
import hmac
import struct
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

# payload views of received frames are read-only; the server copies out of them, never writes
warnings.filterwarnings("ignore", message="The given buffer is not writable")

MAGIC = b"GMPS"
WIRE_VERSION = 3
MAX_DIMS = 4
TOKEN_BYTES = 16
HEADER = struct.Struct("<4sBBBBH16sQQI4IQQB3I")
HEADER_BYTES = HEADER.size
NBYTES_FIELD = 10 + MAX_DIMS + 1
"""The index of the body length among the header's unpacked fields."""

DTYPES: dict[int, torch.dtype] = {
    1: torch.float32,
    2: torch.float16,
    3: torch.int64,
    4: torch.uint8,
}
CODES = {dtype: code for code, dtype in DTYPES.items()}


class Kind(enum.IntEnum):
    """What a message asks or answers."""

    INIT = 1  # worker -> server: initial values of the shard (first one wins)
    PUSH = 2  # worker -> server: a gradient for the shard
    PULL = 3  # worker -> server: ask for the shard (answered when the mode allows)
    PARAMS = 4  # server -> worker: the shard's values
    ACK = 5  # server -> worker: a push or init was applied
    FINISH = 6  # worker -> server: this worker is done (payload: its stats as JSON bytes)
    DONE = 7  # server -> worker: every live worker is done (payload: JSON)
    CLOSE = 8  # worker -> server: stop serving
    SAVE = 9  # worker -> server: write the shard's part of the checkpoint after step `clock`
    PUSH_PULL = 10  # worker -> server: a gradient, then a pull (answered by PARAMS alone)


class WireError(ValueError):
    """A message that does not parse or fails the token check."""


@dataclass(frozen=True)
class Message:
    kind: Kind
    worker: int
    clock: int = 0
    seen: int = 0
    staleness: int = 0
    offset: int = 0
    payload: torch.Tensor | None = None
    """A 1-d or shaped view of the tensor frame (no copy), or None."""
    raw: bytes | memoryview | None = None
    """The tensor frame as bytes, for JSON payloads (uint8)."""
    codec: int = 0
    ctx: tuple[int, int, int] = (0, 0, 0)


def encode(
    kind: Kind,
    token: bytes,
    worker: int = 0,
    *,
    clock: int = 0,
    seen: int = 0,
    staleness: int = 0,
    offset: int = 0,
    tensor: torch.Tensor | None = None,
    data: bytes | None = None,
    codec: int = 0,
    ctx: tuple[int, int, int] = (0, 0, 0),
) -> list[bytes | memoryview]:
    """The frames of one message: the header, then the tensor's bytes (no copy) or `data`."""
    if tensor is not None:
        flat = tensor.detach().contiguous()
        shape = list(flat.shape) + [0] * (MAX_DIMS - flat.dim())
        body: bytes | memoryview = memoryview(flat.view(torch.uint8).reshape(-1).numpy())  # type: ignore[arg-type]
        code, ndim = CODES[flat.dtype], flat.dim()
    else:
        body = data or b""
        code, ndim, shape = 0, 0, [0] * MAX_DIMS
    header = HEADER.pack(
        MAGIC,
        WIRE_VERSION,
        int(kind),
        code,
        ndim,
        worker,
        token,
        clock,
        seen,
        staleness,
        *shape,
        offset,
        len(body),
        codec,
        *ctx,
    )
    return [header, body] if len(body) else [header]


Header = bytes | bytearray | memoryview


def _unpack(head: Header, token: bytes, max_payload: int) -> tuple[Any, ...]:
    head = memoryview(head)
    if head.nbytes != HEADER_BYTES:
        raise WireError(f"header is {head.nbytes} bytes, expected {HEADER_BYTES}")
    fields = HEADER.unpack(head)
    magic, version, tok, nbytes = fields[0], fields[1], fields[6], fields[NBYTES_FIELD]
    if magic != MAGIC or version != WIRE_VERSION:
        raise WireError("not a gradmesh parameter-server message (magic or version)")
    if not hmac.compare_digest(tok, token):
        raise WireError("wrong job token")
    if nbytes > max_payload:
        raise WireError(f"payload of {nbytes} bytes is over the bound of {max_payload}")
    return fields


def check_header(head: Header, token: bytes, max_payload: int) -> int:
    """The body length a header announces, once its magic, version, token and that length (within
    `max_payload`) pass: what a stream reader must know before it reads the body."""
    return int(_unpack(head, token, max_payload)[NBYTES_FIELD])


def decode(frames: Sequence[bytes | memoryview], token: bytes, max_payload: int) -> Message:
    """Parse and check one message; `WireError` says what is wrong with it."""
    if not 1 <= len(frames) <= 2:
        raise WireError(f"expected 1 or 2 frames, got {len(frames)}")
    (_, _, kind, code, ndim, worker, _, clock, seen, stale, *rest) = _unpack(
        frames[0], token, max_payload
    )
    shape, offset, nbytes = rest[:MAX_DIMS], rest[MAX_DIMS], rest[MAX_DIMS + 1]
    codec, ctx = rest[MAX_DIMS + 2], tuple(rest[MAX_DIMS + 3 :])
    try:
        kind = Kind(kind)
    except ValueError:
        raise WireError(f"unknown message kind {kind}") from None
    body = memoryview(frames[1]) if len(frames) == 2 else memoryview(b"")
    if body.nbytes != nbytes:
        raise WireError(f"length field says {nbytes} bytes, the frame has {body.nbytes}")
    if code == 0:  # plain bytes (JSON) or nothing
        if ndim != 0 or any(shape):
            raise WireError("a byte payload has no shape")
        if codec or any(ctx):
            raise WireError("a byte payload has no codec")
        return Message(kind, worker, clock, seen, stale, offset, None, body if nbytes else None)
    dtype = DTYPES.get(code)
    if dtype is None:
        raise WireError(f"unknown dtype code {code}")
    if ndim > MAX_DIMS or any(shape[ndim:]):
        raise WireError(f"bad shape {shape[:ndim]} with {ndim} dims")
    dims = list(shape[:ndim])
    count = 1
    for d in dims:
        count *= d
    itemsize = dtype.itemsize
    if count * itemsize != nbytes:
        raise WireError(f"shape {dims} of {dtype} is not {nbytes} bytes")
    if codec and (dtype != torch.uint8 or ndim != 1):
        raise WireError("a compressed payload is 1-d uint8")
    fields = (kind, worker, clock, seen, stale, offset)
    if nbytes == 0:
        return Message(*fields, torch.empty(dims, dtype=dtype, device="cpu"), None, codec, ctx)
    tensor = torch.frombuffer(body, dtype=dtype).view(dims)
    return Message(*fields, tensor, None, codec, ctx)
