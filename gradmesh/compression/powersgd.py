"""`powersgd` (Vogels et al. 2019): each weight matrix M (n x m) travels as a rank-r pair P, Q.

One power-iteration step per call, warm-started from the previous call's Q: P = M Q, allreduce
P, orthogonalize it, Q = M^T P, allreduce Q, M ~ P Q^T. Linear in M, so the sum of the ranks'
matrices is approximated from two summed messages of r (n + m) numbers instead of n m. Tensors
for which that saves nothing (vectors, small matrices) are summed exactly, in the same message
as P. All P's of a tensor go in one allreduce and all Q's in another, as torch's hook does.
A tensor of unknown structure (a parameter-server shard) is folded into a near-square matrix.
Biased: error feedback (this rank's P Q_local^T is what it sent) is on by default.
Q starts from the same seeded random matrix on every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from gradmesh.compression.base import (
    Compressor,
    Encoded,
    Link,
    Shape,
    State,
    _expect,
    as_bytes,
    split_bytes,
)
from gradmesh.errors import GradmeshError
from gradmesh.observe.timeline import span

SEED = 0x5EED


@dataclass
class Matrix:
    """One compressed tensor: elements [start, start + numel) of the flat tensor, as rows x cols
    (zero-padded when numel < rows * cols)."""

    start: int
    numel: int
    rows: int
    cols: int


@dataclass
class PowerState(State):
    matrices: list[Matrix] = field(default_factory=list)
    exact: list[tuple[int, int]] = field(default_factory=list)
    """[start, end) ranges summed without compression."""


class PowerSGD(Compressor):
    """Rank-r power iteration with warm start (see the module docstring)."""

    name, wire_id, biased = "powersgd", 6, True

    def __init__(self, rank: int = 1) -> None:
        if rank < 1:
            raise GradmeshError(f"--compression-rank must be >= 1, got {rank}")
        self.rank = rank

    def worth(self, rows: int, cols: int) -> bool:
        return (rows + cols) * self.rank < rows * cols

    def new_state(self, numel: int, shapes: list[Shape] | None = None) -> State:
        base = super().new_state(numel, shapes)
        state = PowerState(numel, base.shapes)
        if shapes is None:  # no structure known: fold into a near-square matrix
            cols = max(1, math.isqrt(numel - 1) + 1) if numel else 1
            rows = -(-numel // cols)
            if numel and self.worth(rows, cols):
                state.matrices.append(Matrix(0, numel, rows, cols))
            else:
                state.exact.append((0, numel))
            return state
        at = 0
        for shape in shapes:
            size = math.prod(shape)
            rows, cols = (shape[0], size // shape[0]) if len(shape) >= 2 and size else (0, 0)
            if len(shape) >= 2 and size and self.worth(rows, cols):
                state.matrices.append(Matrix(at, size, rows, cols))
            elif size:
                state.exact.append((at, at + size))
            at += size
        return state

    def _start_q(self, state: PowerState, device: torch.device) -> list[torch.Tensor]:
        """Each matrix's Q (cols x r), warm: the previous call's summed Q."""
        total = sum(m.cols for m in state.matrices) * self.rank
        if "q" not in state.tensors:
            generator = torch.Generator().manual_seed(SEED)
            q = torch.randn(total, generator=generator, device="cpu")  # the same on every device
            state.tensors["q"] = q.to(device)
        return _views(state.tensors["q"], [(m.cols, self.rank) for m in state.matrices])

    def _views_of(self, x: torch.Tensor, state: PowerState) -> list[torch.Tensor]:
        out = []
        for m in state.matrices:
            part = x.view(-1)[m.start : m.start + m.numel]
            if m.numel < m.rows * m.cols:
                padded = torch.zeros(m.rows * m.cols, dtype=part.dtype, device=part.device)
                padded[: m.numel] = part
                part = padded
            out.append(part.view(m.rows, m.cols))
        return out

    def _power_step(
        self, mats: list[torch.Tensor], qs: list[torch.Tensor], p_flat: torch.Tensor, link: Link
    ) -> list[torch.Tensor]:
        """P = M Q for every matrix (into the start of `p_flat`, which is then summed whole),
        orthogonalized; then Q = M^T P in place."""
        ps = _views(p_flat, [(m.shape[0], self.rank) for m in mats])  # exact tensors follow
        with span("compress", "comm", compressor=self.name):
            for m, q, p in zip(mats, qs, ps, strict=True):
                torch.matmul(m, q, out=p)
        link.allreduce(p_flat)
        with span("compress", "comm", compressor=self.name):
            for m, q, p in zip(mats, qs, ps, strict=True):
                p.copy_(torch.linalg.qr(p).Q)
                torch.matmul(m.t(), p, out=q)
        return ps

    def reduce(
        self, x: torch.Tensor, state: State, link: Link, keep: torch.Tensor | None = None
    ) -> None:
        assert isinstance(state, PowerState)
        flat = x.view(-1)
        mats, qs = self._views_of(x, state), self._start_q(state, x.device)
        p_numel = sum(m.rows for m in state.matrices) * self.rank
        exact = sum(b - a for a, b in state.exact)
        message = torch.empty(p_numel + exact, device=x.device)
        at = p_numel
        for a, b in state.exact:  # exact tensors ride in P's message
            message[at : at + b - a] = flat[a:b]
            if keep is not None:
                keep[a:b] -= flat[a:b]
            at += b - a
        ps = self._power_step(mats, qs, message, link)
        at = p_numel
        for a, b in state.exact:  # their sums, back in place
            flat[a:b] = message[at : at + b - a]
            at += b - a
        if keep is not None:  # this rank's part: P times its own Q, before Q is summed
            for m, p, q in zip(state.matrices, ps, qs, strict=True):
                _product(p, q, keep[m.start : m.start + m.numel], alpha=-1)
        if state.matrices:
            link.allreduce(state.tensors["q"])
        with span("decompress", "comm", compressor=self.name):
            for m, p, q in zip(state.matrices, ps, qs, strict=True):
                _product(p, q, flat[m.start : m.start + m.numel])
        state.steps += 1

    def encode(self, x: torch.Tensor, state: State) -> Encoded:
        assert isinstance(state, PowerState)
        if not state.matrices:
            return Encoded(as_bytes(x.float()), (x.numel(), 1, 0))
        if len(state.matrices) != 1 or state.exact:
            raise GradmeshError("powersgd encodes a tensor of unknown structure only")
        (m,) = state.matrices
        mats, qs = self._views_of(x, state), self._start_q(state, x.device)
        (p,) = self._power_step(
            mats, qs, torch.empty(m.rows * self.rank, device=x.device), Link(local=True)
        )
        state.steps += 1
        return Encoded(as_bytes(p, qs[0]), (m.rows, m.cols, self.rank))

    def decode(
        self, payload: torch.Tensor, ctx: tuple[int, int, int], out: torch.Tensor, alpha: float = 1
    ) -> None:
        rows, cols, rank = ctx
        n = out.numel()
        if rank == 0:  # sent exactly
            _expect((rows, cols) == (n, 1), "context")
            (values,) = split_bytes(payload, (torch.float32, n))
            out.view(-1).add_(values, alpha=alpha)
            return
        _expect(rows >= 1 and cols >= 1 and rows * cols >= n > (rows - 1) * cols, "shape")
        _expect(rank <= min(rows, cols), "rank")
        p, q = split_bytes(payload, (torch.float32, rows * rank), (torch.float32, cols * rank))
        product = p.view(rows, rank) @ q.view(cols, rank).t()
        out.view(-1).add_(product.view(-1)[:n], alpha=alpha)

    def describe(self) -> str:
        return f"powersgd rank {self.rank}"


def _product(p: torch.Tensor, q: torch.Tensor, out: torch.Tensor, alpha: float = 0) -> None:
    """out (flat: the first numel elements of P Q^T) = P Q^T, or += alpha P Q^T when alpha is
    not 0, without a temporary where the matrix is not padded."""
    rows, cols = p.shape[0], q.shape[0]
    if out.numel() != rows * cols:
        product = (p @ q.t()).view(-1)[: out.numel()]
        out.add_(product, alpha=alpha) if alpha else out.copy_(product)
    elif alpha:
        out.view(rows, cols).addmm_(p, q.t(), alpha=alpha)
    else:
        torch.mm(p, q.t(), out=out.view(rows, cols))


def _views(flat: torch.Tensor, shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    out, at = [], 0
    for rows, cols in shapes:
        out.append(flat[at : at + rows * cols].view(rows, cols))
        at += rows * cols
    return out
