"""A compressor reduces one tensor (a fusion bucket, a model delta, a parameter-server shard) over
a group in fewer bytes, keeping what must persist between calls in a per-tensor `State`.

The shape is torch's DDP communication hooks: a `Compressor` holds only its settings (one object
serves any number of tensors); `new_state` makes the state of one tensor (the error-feedback
residual, PowerSGD's Q), which is checkpointable. Two forms, so every path uses the same code:

- `reduce(x, state, link, keep)`: sum `x` in place over the link's group (allreduce with any
  algorithm, the DDP hook, local SGD's averaging). With `keep`, this rank's own contribution, as
  the group decoded it, is subtracted from `keep` (error feedback passes its residual, which is
  then what was not sent, with no scratch tensor).
- `encode(x, state)` -> `Encoded` and `decode(payload, ctx, out, alpha)`: one rank's message on
  its own (the parameter server's push): bytes plus three integers of context. `decode` adds
  alpha times the message into `out` and raises `ValueError` for a payload that does not match
  its context, so a receiver can drop a bad message instead of trusting it.

`Compressor.reduce` by default allgathers every rank's encoded message and sums the decodings
(top-k, sign: their payloads cannot be summed on the wire); compressors whose payload an
allreduce can sum (fp16, bf16, int8) or that reduce in rounds (PowerSGD) override it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from gradmesh.collectives import allreduce
from gradmesh.collectives.agreement import Check, FixedLayout
from gradmesh.collectives.channel import resolve_group
from gradmesh.collectives.ring import allgather
from gradmesh.errors import GradmeshError
from gradmesh.observe.timeline import span
from gradmesh.runtime.world import get_runtime

Shape = tuple[int, ...]


class Encoded(NamedTuple):
    """One rank's compressed message: raw bytes and the context needed to read them."""

    payload: torch.Tensor
    """uint8, 1-d."""
    ctx: tuple[int, int, int]


def as_bytes(*parts: torch.Tensor) -> torch.Tensor:
    """The parts' bytes end to end, as one uint8 tensor."""
    return torch.cat([p.contiguous().view(torch.uint8).reshape(-1) for p in parts])


def split_bytes(payload: torch.Tensor, *specs: tuple[torch.dtype, int]) -> list[torch.Tensor]:
    """Cut `payload` into typed parts of the given element counts; ValueError unless they fill
    it exactly."""
    sizes = [d.itemsize * n for d, n in specs]
    if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.numel() != sum(sizes):
        raise ValueError(f"payload of {payload.numel()} bytes, expected {sum(sizes)}")
    parts, at = [], 0
    for (dtype, _), size in zip(specs, sizes, strict=True):
        chunk = payload[at : at + size]
        if chunk.data_ptr() % dtype.itemsize:
            chunk = chunk.clone()  # a view must be aligned to its element size
        parts.append(chunk.view(dtype))
        at += size
    return parts


@dataclass
class Link:
    """The group a compressor reduces over, the allreduce algorithm it uses, and how each call
    is checked and counted. A link whose group has one member (or no process group at all)
    sends nothing: the compressor still compresses, so its rounding is the same."""

    group: dist.ProcessGroup | None = None
    algorithm: str = "native"
    kind: str = "sync"
    name: str | None = None
    """The caller's name for the tensor, part of each call's checked signature."""
    fixed: bool = False
    """The group carries only this fixed stream of calls (a DistributedOptimizer's own
    group), whose layout was checked once: no per-call signature exchange."""
    payload_bytes: int = 0
    """Bytes of the messages handed to collectives so far (after compression)."""
    local: bool = False
    """A group of one whatever the process world: a message made on its own (a parameter-server
    push) is rounded as in a reduction but never sent by a collective."""

    @property
    def size(self) -> int:
        if self.local or not dist.is_initialized():
            return 1
        return dist.get_world_size(resolve_group(self.group))

    def _check(self, operation: str) -> Check | None:
        if not self.fixed:
            return None
        return FixedLayout.post(get_runtime(), resolve_group(self.group), operation)

    def allreduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce `tensor` in place ("sum" or "max")."""
        self.payload_bytes += tensor.numel() * tensor.element_size()
        if self.size == 1:
            return tensor
        operation = f"{self.algorithm} allreduce" + ("" if op == "sum" else f" ({op})")
        return allreduce(
            tensor,
            op=op,  # type: ignore[arg-type]
            algorithm=self.algorithm,
            group=self.group,
            name=self.name,
            check=self._check(operation),
            kind=self.kind,
        )

    def allgather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` (same shape everywhere), stacked in group order."""
        self.payload_bytes += tensor.numel() * tensor.element_size()
        if self.size == 1:
            return tensor.unsqueeze(0)
        native = self.algorithm == "native"
        operation = "native allgather" if native else "ring allgather"
        return allgather(tensor, self.group, self._check(operation), self.kind, backend=native)


@dataclass
class State:
    """What a compressor keeps for one tensor between calls; `state_dict()` checkpoints it."""

    numel: int
    shapes: list[Shape]
    """The tensors packed end to end in the flat tensor (one entry, its own shape, when the
    caller knows no finer structure)."""
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    steps: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "numel": self.numel,
            "steps": self.steps,
            "tensors": {k: v.clone() for k, v in self.tensors.items()},
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        if saved["numel"] != self.numel:
            raise GradmeshError(
                f"compressor state is for {saved['numel']} elements, this tensor has {self.numel}"
            )
        self.steps = int(saved["steps"])
        for key, value in saved["tensors"].items():
            if key in self.tensors and self.tensors[key].shape != value.shape:
                raise GradmeshError(f"compressor state {key!r} has the wrong shape")
            self.tensors[key] = value.clone()

    def buffer(self, key: str, like: torch.Tensor, numel: int | None = None) -> torch.Tensor:
        """A float32 tensor kept in this state on `like`'s device (zeros when first asked for;
        moved there once when it was made or loaded elsewhere)."""
        held = self.tensors.get(key)
        if held is None:
            n = self.numel if numel is None else numel
            held = self.tensors[key] = torch.zeros(n, device=like.device)
        elif held.device != like.device:
            held = self.tensors[key] = held.to(like.device)
        return held


def save_states(states: dict[str, State]) -> dict[str, Any]:
    """Named compressor states as one checkpointable mapping."""
    return {name: state.state_dict() for name, state in states.items()}


def load_states(states: dict[str, State], saved: Any) -> None:
    """Restore `save_states`' output into the states of the same names; one line when the
    saved states are not this run's (another compressor, another model)."""
    if not isinstance(saved, dict) or set(saved) != set(states):
        found = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
        raise GradmeshError(f"compressor states {found} are not this run's {sorted(states)}")
    for name, state in states.items():
        entry = saved[name]
        if not isinstance(entry, dict) or not isinstance(entry.get("tensors"), dict):
            raise GradmeshError(f"compressor state {name!r} is not a mapping with 'tensors'")
        state.load_state_dict(entry)


class Compressor:
    """Settings of one compression method; see the module docstring for the two forms."""

    name = "none"
    wire_id = 0
    """The method's number in the parameter server's message header."""
    biased = False
    """Whether it converges only with error feedback (which is then on by default)."""
    error_feedback = False

    def new_state(self, numel: int, shapes: list[Shape] | None = None) -> State:
        if shapes is not None and sum(_numel(s) for s in shapes) != numel:
            raise GradmeshError(f"shapes {shapes} do not hold {numel} elements")
        return State(numel, shapes if shapes is not None else [(numel,)])

    def encode(self, x: torch.Tensor, state: State) -> Encoded:
        raise NotImplementedError

    def decode(
        self, payload: torch.Tensor, ctx: tuple[int, int, int], out: torch.Tensor, alpha: float = 1
    ) -> None:
        raise NotImplementedError

    def reduce(
        self, x: torch.Tensor, state: State, link: Link, keep: torch.Tensor | None = None
    ) -> None:
        """Allgather every rank's message and sum the decodings into `x`."""
        with span("compress", "comm", compressor=self.name):
            payload, ctx = self.encode(x, state)
        everyone = link.allgather(payload)
        with span("decompress", "comm", compressor=self.name):
            if keep is not None:
                self.decode(payload, ctx, keep, alpha=-1)
            x.zero_()
            for row in everyone:
                self.decode(row, ctx, x)
        state.steps += 1

    def describe(self) -> str:
        return self.name


class NoCompression(Compressor):
    """The identity: the tensor is summed as it is (no message form: uncompressed parameter-
    server pushes travel as plain float32 shards)."""

    def reduce(
        self, x: torch.Tensor, state: State, link: Link, keep: torch.Tensor | None = None
    ) -> None:
        if keep is not None:
            keep.sub_(x)
        link.allreduce(x)
        state.steps += 1


class ErrorFeedback(Compressor):
    """Any compressor with error feedback: the part of a tensor a message did not carry is kept
    and added to the next tensor given (Seide et al. 2014; Karimireddy et al. 2019), so that
    over time everything is sent: sent + residual == given + previous residual. The residual
    is the corrected tensor until the inner compressor subtracts what it sent (`keep`)."""

    error_feedback = True

    def __init__(self, inner: Compressor) -> None:
        self.inner = inner
        self.name, self.wire_id, self.biased = inner.name, inner.wire_id, inner.biased

    def new_state(self, numel: int, shapes: list[Shape] | None = None) -> State:
        state = self.inner.new_state(numel, shapes)
        state.tensors["residual"] = torch.zeros(numel, device="cpu")  # moves to the data's device
        return state

    def reduce(
        self, x: torch.Tensor, state: State, link: Link, keep: torch.Tensor | None = None
    ) -> None:
        residual = state.buffer("residual", x).add_(x)  # the corrected tensor
        corrected = residual.clone() if keep is not None else None
        x.copy_(residual)
        self.inner.reduce(x, state, link, residual)  # leaves what was not sent
        if corrected is not None and keep is not None:
            keep.sub_(corrected.sub_(residual))

    def encode(self, x: torch.Tensor, state: State) -> Encoded:
        residual = state.buffer("residual", x).add_(x)
        message = self.inner.encode(residual, state)
        self.inner.decode(message.payload, message.ctx, residual, alpha=-1)
        return message

    def decode(
        self, payload: torch.Tensor, ctx: tuple[int, int, int], out: torch.Tensor, alpha: float = 1
    ) -> None:
        self.inner.decode(payload, ctx, out, alpha)

    def describe(self) -> str:
        return f"{self.inner.describe()} with error feedback"


class CodecAdapter(Compressor):
    """A Horovod-style codec (`compress(t) -> (payload, ctx)`, `decompress(payload, ctx)`,
    payload summable by an allreduce), for scripts that bring their own."""

    def __init__(self, codec: Any) -> None:
        self.codec = codec
        self.name = type(codec).__name__

    def reduce(
        self, x: torch.Tensor, state: State, link: Link, keep: torch.Tensor | None = None
    ) -> None:
        payload, ctx = self.codec.compress(x)
        if keep is not None:
            keep.sub_(self.codec.decompress(payload.clone(), ctx))
        link.allreduce(payload)
        result = self.codec.decompress(payload, ctx)
        if result is not x:
            x.copy_(result)
        state.steps += 1


def _numel(shape: Shape) -> int:
    count = 1
    for d in shape:
        count *= d
    return count


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"compressed message: bad {what}")
