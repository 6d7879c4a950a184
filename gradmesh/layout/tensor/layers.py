"""Tensor parallelism: one layer's weight split over the ranks of the mesh's `tp` axis.

A *column-parallel* layer keeps a slice of the output features (a Linear's rows, a
convolution's output channels): its input is whole on every rank, its output is this rank's
slice. A *row-parallel* layer keeps the matching slice of the input features: each rank's output
is a partial sum, and one allreduce over `tp` makes it whole. A column-parallel layer followed by
a row-parallel one (with anything elementwise between, as ReLU or max-pooling per channel)
therefore costs one allreduce in forward (the row layer's partial sums) and one in backward (the
gradient of the column layer's input, which every rank computed only partly): the paired
operators `gradmesh::tp_copy` (identity forward, allreduce backward) and `gradmesh::tp_reduce`
(allreduce forward, identity backward). Parameters keep their names, so a split model's
state_dict reads like the whole model's, each tensor being this rank's slice.

Why not torch's DTensor styles (`parallelize_module` with `ColwiseParallel`/`RowwiseParallel`)?
They do work on Gloo and CPU (tried: same outputs and gradients as here). But (1) they are
slower: `gradmesh bench tp-styles --rounds 5` (the built-in GPT, width 128, 2 blocks, its MLPs
split over 2 ranks, 8 sequences of 64 tokens, forward + backward + AdamW, medians of 5
interleaved rounds of 20 steps, loopback) measured 28.51 ms a step with DTensor against
22.17 ms here on 2026-11-25 (1.29x; 1.14x-1.24x on an earlier day), most likely DTensor's
dispatch (not profiled); (2) parameters would be DTensors in every sync path
(DistributedOptimizer's flat buckets, local SGD, parameter broadcast, checkpoints), each needing
to unwrap them; (3) their collectives bypass gradmesh's per-call numbering, byte counts by kind
and one-line timeout messages. The placement vocabulary of DTensor (`Replicate`, `Shard(dim)`)
is what the plan's styles follow (`gradmesh.layout.tensor.plan`).

Besides the pair, a column-parallel layer can gather its output (`gather`: every rank ends
with the whole output, as DTensor's `ColwiseParallel(output_layouts=Replicate())`), and can
split a fused projection chunk by chunk (`chunks`: q, k and v made by one matrix are each cut
in `parts`, so each rank holds q, k and v of its own heads, never a mix).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gradmesh.collectives import allgather, allreduce, reduce_scatter
from gradmesh.collectives.agreement import FixedLayout
from gradmesh.collectives.api import Op
from gradmesh.runtime.axes import TP
from gradmesh.runtime.world import get_runtime


@dataclass
class DryExchanges:
    """While a planner measures one rank's slice of a tensor-parallel model in a process of its
    own (`dry_exchanges`): the tp degree it stands for, and each exchange the slice would have
    made (what, bytes this rank sends in, `allreduce` or `allgather`), in call order."""

    size: int
    made: list[tuple[str, int, str]] = field(default_factory=list)


_DRY: DryExchanges | None = None


@contextmanager
def dry_exchanges(size: int) -> Iterator[DryExchanges]:
    """Run rank 0's slice of a model split over `size` tp ranks in this process alone: every tp
    exchange is recorded instead of made (an allreduce leaves this rank's tensor as it is, a
    gather repeats it), so the slice computes what it would on a mesh, at its own cost, and the
    planner prices the recorded exchanges on the links. The values are not a mesh's: for timing
    and counting only."""
    global _DRY
    before, _DRY = _DRY, DryExchanges(size)
    try:
        yield _DRY
    finally:
        _DRY = before


def tp_place() -> tuple[int, int]:
    """(tp degree, this rank's index on the tp axis): the mesh's, or a dry run's (index 0)."""
    if _DRY is not None:
        return _DRY.size, 0
    axis = get_runtime().mesh[TP]
    return axis.size, axis.index


def _tp_collective(tensor: torch.Tensor, what: str, op: Op = "sum") -> torch.Tensor:
    """Reduce `tensor` over the tp axis in place (`op`). The mesh's tp group carries only these
    calls, made by the same layers in the same order on every tp rank (same model, same
    samples), so each call agrees by construction and needs no signature exchange."""
    if _DRY is not None:
        _DRY.made.append((what, tensor.numel() * tensor.element_size(), "allreduce"))
        return tensor
    rt = get_runtime()
    axis = rt.mesh[TP]
    check = FixedLayout.post(rt, axis.group, f"tensor-parallel {what}")
    allreduce(tensor, op=op, group=axis.group, check=check, kind="tensor_parallel")
    return tensor


def _tp_allreduce(tensor: torch.Tensor, what: str) -> torch.Tensor:
    return _tp_collective(tensor.contiguous(), what)


def tp_gather(x: torch.Tensor, dim: int, what: str) -> torch.Tensor:
    """Every tp rank's `x` concatenated along `dim`, in tp order (equal shapes on every rank)."""
    if _DRY is not None:
        _DRY.made.append((what, x.numel() * x.element_size(), "allgather"))
        return torch.cat([x] * _DRY.size, dim=dim)
    rt = get_runtime()
    axis = rt.mesh[TP]
    check = FixedLayout.post(rt, axis.group, f"tensor-parallel {what}")
    rows = allgather(
        x.contiguous(), group=axis.group, check=check, kind="tensor_parallel", backend=True
    )
    return torch.cat(list(rows.unbind(0)), dim=dim)


def tp_reduce_scatter(x: torch.Tensor, dim: int, what: str) -> torch.Tensor:
    """The sum over tp of `x`, this rank's `dim`-part of it (`dim` divisible by tp)."""
    if _DRY is not None:
        _DRY.made.append((what, x.numel() * x.element_size(), "reduce_scatter"))
        return x.chunk(_DRY.size, dim)[0].clone()
    rt = get_runtime()
    axis = rt.mesh[TP]
    moved = x.movedim(dim, 0).contiguous()  # the parts are then contiguous blocks
    check = FixedLayout.post(rt, axis.group, f"tensor-parallel {what}")
    block = reduce_scatter(moved, group=axis.group, check=check, kind="tensor_parallel")
    part = block.reshape(moved.shape[0] // axis.size, *moved.shape[1:])
    return part.movedim(0, dim).contiguous()


# The exchanges are torch custom operators with their own gradients, not autograd.Functions:
# `torch.export` (which cuts a model into pipeline stages on its graph) keeps a custom operator
# in the graph as one call, gradient and all, where it would trace through a Function's forward
# and lose its backward; so a tensor-parallel model can also be cut into pipeline stages.
@torch.library.custom_op("gradmesh::tp_copy", mutates_args=())
def _tp_copy(x: torch.Tensor) -> torch.Tensor:
    """Identity forward (an operator may not return its input: a copy); allreduce of the
    gradient over tp in backward."""
    return x.clone()


@torch.library.custom_op("gradmesh::tp_reduce", mutates_args=())
def _tp_reduce(x: torch.Tensor, what: str) -> torch.Tensor:
    """Allreduce over tp in forward; identity in backward."""
    return _tp_allreduce(x.clone(), what)


@torch.library.custom_op("gradmesh::tp_gather", mutates_args=())
def _tp_gather(x: torch.Tensor, dim: int) -> torch.Tensor:
    """All-gather of the features over tp in forward; this rank's slice in backward (what comes
    after is replicated, so every rank holds the same whole gradient)."""
    return tp_gather(x, dim, "output gather")


# On the meta device (the simulator's models) only these shape functions run: a dry run's
# exchanges are recorded here too, as `_tp_collective` and `tp_gather` record them on real ones.
@_tp_copy.register_fake
def _same_shape(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@_tp_reduce.register_fake
def _reduced_shape(x: torch.Tensor, what: str) -> torch.Tensor:
    if _DRY is not None and x.is_meta:
        _DRY.made.append((what, x.numel() * x.element_size(), "allreduce"))
    return torch.empty_like(x)


@_tp_gather.register_fake
def _gathered_shape(x: torch.Tensor, dim: int) -> torch.Tensor:
    if _DRY is not None and x.is_meta:
        _DRY.made.append(("output gather", x.numel() * x.element_size(), "allgather"))
    shape = list(x.shape)
    shape[dim] *= tp_place()[0]
    return x.new_empty(shape)


def _copy_backward(_ctx: Any, grad: torch.Tensor) -> torch.Tensor:
    return reduce_from_tp(grad, "input gradient")


def _reduce_backward(_ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return grad, None


def _gather_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    x, dim = inputs
    ctx.dim, ctx.size = dim, x.shape[dim]


def _gather_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    index = tp_place()[1]
    return grad.narrow(ctx.dim, index * ctx.size, ctx.size).contiguous(), None


_tp_copy.register_autograd(_copy_backward)
_tp_reduce.register_autograd(_reduce_backward)
_tp_gather.register_autograd(_gather_backward, setup_context=_gather_context)


def copy_to_tp(x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = _tp_copy(x)
    return out


def reduce_from_tp(x: torch.Tensor, what: str = "partial sums") -> torch.Tensor:
    out: torch.Tensor = _tp_reduce(x, what)
    return out


def gather_from_tp(x: torch.Tensor, dim: int) -> torch.Tensor:
    out: torch.Tensor = _tp_gather(x, dim % x.dim())
    return out


def chunk_sizes(size: int, chunks: tuple[int, ...]) -> list[int]:
    """The rows of each chunk of a fused dimension of `size`, `chunks` giving their proportions
    (q, k, v: (1, 1, 1); grouped-query attention with 8 query and 2 key/value heads: (8, 2, 2)).
    A ValueError when `size` does not split so."""
    total = sum(chunks)
    if not chunks or size % total:
        raise ValueError(f"{size} rows do not split in proportions {chunks}")
    return [size // total * c for c in chunks]


def shard(
    t: torch.Tensor, dim: int, parts: int, index: int, chunks: tuple[int, ...] = ()
) -> torch.Tensor:
    """This rank's slice of `t` along `dim`: the `index`-th of `parts` equal pieces, or, for a
    fused dimension, the `index`-th piece of each chunk, concatenated."""
    if not chunks:
        return t.detach().chunk(parts, dim)[index].clone()
    pieces = torch.split(t.detach(), chunk_sizes(t.shape[dim], chunks), dim)
    return torch.cat([p.chunk(parts, dim)[index] for p in pieces], dim).clone()


def unshard(pieces: list[torch.Tensor], dim: int, chunks: tuple[int, ...] = ()) -> torch.Tensor:
    """The whole tensor from every rank's `shard`, in tp order (the inverse of `shard`)."""
    if not chunks:
        return torch.cat(pieces, dim)
    split = [torch.split(p, chunk_sizes(p.shape[dim], chunks), dim) for p in pieces]
    return torch.cat([torch.cat([s[c] for s in split], dim) for c in range(len(chunks))], dim)


Slicer = Callable[[torch.Tensor, int, tuple[int, ...]], nn.Parameter]
"""Makes this rank's slice of a parameter along a dim with chunks (shared by tied uses)."""


class ParallelLayer(nn.Module):
    """A Linear or Conv2d whose weight is this rank's slice of the whole layer's (`style`
    colwise or rowwise); forward is the whole layer's, with the tp exchanges it needs. A
    colwise layer may `gather` its output, or split a fused projection by `chunks`; a rowwise
    layer's partial sums are reduced by `reduce` (default: allreduced over tp; sequence
    parallelism reduce-scatters them along the sequence)."""

    def __init__(
        self,
        layer: nn.Linear | nn.Conv2d,
        style: str,
        parts: int,
        index: int,
        chunks: tuple[int, ...] = (),
        gather: bool = False,
        slicer: Slicer | None = None,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        nn.Module.__init__(self)  # not the layer class's: it would make whole weights
        self.style, self.chunks, self.gather = style, chunks, gather
        self.reduce = reduce or reduce_from_tp
        self.conv: tuple[Any, ...] | None = (
            (layer.stride, layer.padding, layer.dilation, layer.groups)
            if isinstance(layer, nn.Conv2d)
            else None
        )
        """A convolution's stride, padding, dilation, groups."""
        if slicer is None:
            slicer = lambda t, d, c: nn.Parameter(shard(t, d, parts, index, c))  # noqa: E731
        dim = 0 if style == "colwise" else 1
        self.weight = slicer(layer.weight, dim, chunks)
        bias = layer.bias
        if bias is None:
            self.bias = None
        elif style == "colwise":  # each rank's output features have their own bias
            self.bias = slicer(bias, 0, chunks)
        else:  # added once, after the partial sums are reduced: replicated on every tp rank
            self.bias = nn.Parameter(bias.detach().clone())
        self._keep_attributes(layer, parts if gather else 1)

    def _keep_attributes(self, layer: nn.Linear | nn.Conv2d, gathered: int) -> None:
        """The replaced layer's attributes, its widths the ones this rank's forward takes and
        gives (a model reading `self.qkv.out_features` gets this rank's heads' width)."""
        out_width, in_width = self.weight.shape[0], self.weight.shape[1]
        if self.style == "colwise":
            widths = (layer.weight.shape[1], out_width * gathered)
        else:
            widths = (in_width, layer.weight.shape[0])
        if isinstance(layer, nn.Linear):
            self.in_features, self.out_features = widths
            return
        self.in_channels, self.out_channels = widths
        for name in ("kernel_size", "stride", "padding", "dilation", "groups", "padding_mode"):
            setattr(self, name, getattr(layer, name))
        self.transposed, self.output_padding = layer.transposed, layer.output_padding

    def _apply_weight(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.conv is None:
            return F.linear(x, self.weight, bias)
        return F.conv2d(x, self.weight, bias, *self.conv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.style == "colwise":
            out = self._apply_weight(copy_to_tp(x), self.bias)
            if self.gather:
                return gather_from_tp(out, -1 if self.conv is None else 1)
            return out
        out = self.reduce(self._apply_weight(x, None))
        if self.bias is None:
            return out
        if self.conv is None:
            return out + self.bias
        return out + self.bias.view((1, -1) + (1,) * (out.dim() - 2))

    def extra_repr(self) -> str:
        extra = f", chunks {self.chunks}" if self.chunks else ""
        extra += ", output gathered" if self.gather else ""
        extra += (
            ", sums reduce-scattered along the sequence"
            if self.reduce is not reduce_from_tp
            else ""
        )
        return f"{self.style}, weight slice {tuple(self.weight.shape)}{extra}"


class ParallelLinear(ParallelLayer, nn.Linear):  # type: ignore[misc]
    """A split `nn.Linear`: still an `nn.Linear` to the model (`isinstance`, `in_features`,
    `out_features`, `weight`, `bias`), each size this rank's."""


class ParallelConv2d(ParallelLayer, nn.Conv2d):  # type: ignore[misc]
    """A split `nn.Conv2d`: still an `nn.Conv2d` to the model, its channels this rank's."""


def parallel_layer(
    layer: nn.Linear | nn.Conv2d, style: str, parts: int, index: int, **how: Any
) -> ParallelLayer:
    """This rank's slice of `layer` as a module of the same kind (`ParallelLayer`'s arguments)."""
    kind = ParallelLinear if isinstance(layer, nn.Linear) else ParallelConv2d
    return kind(layer, style, parts, index, **how)
