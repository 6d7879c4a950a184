"""Sequence parallelism: between the tensor-parallel layers, each tp rank holds only its part of
the sequence (Megatron-LM's scheme, the samples first and the sequence on dimension 1).

Plain tensor parallelism leaves the work between a rowwise and the next colwise layer (the
residual stream, the norms, dropout) whole on every tp rank: the same activations, computed T
times and kept T times. Here a rowwise layer reduce-scatters its partial sums along the sequence
(`rowwise(seq)`: each rank gets the whole sum for its 1/T of the tokens, and the backward
all-gathers the gradient), so the residual add and the next norm run on 1/T of the tokens; the
norm's output is all-gathered back along the sequence before the colwise layers read it
(`sequence(gather)`), whose backward keeps this rank's part of the gradient (the colwise
layers' own allreduce of their input's gradient has already summed it). A module marked
`sequence` runs on the rank's part alone; `sequence(scatter)` cuts a module's input to this
rank's part (the entry: the first block), and a norm or any module with parameters that runs on
a part of the tokens sees only part of its gradient, which is summed over tp as backward makes it.

Per block, forward moves two all-gathers and two reduce-scatters of the block's activations
(plain tp: two allreduces, the same bytes), and backward the same; what it saves is activation
memory and the norms' work, T-fold (docs/model_parallel.md gives the measured figures).
Pipelines do not take it (refused in one line): the sum of a norm's gradient is a hook on the
parameter, which a captured stage graph does not carry.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import gradmesh.layout.tensor.layers as layers
from gradmesh.errors import GradmeshError
from gradmesh.layout.tensor.layers import (
    _tp_collective,
    tp_gather,
    tp_place,
    tp_reduce_scatter,
)

DIM = 1
"""The sequence dimension of the activations (batch, sequence, features)."""


def _check(x: torch.Tensor) -> None:
    size = tp_place()[0]
    if x.dim() <= DIM or x.shape[DIM] % size:
        raise GradmeshError(
            f"sequence parallelism: activations of shape {tuple(x.shape)} do not split their "
            f"sequence (dimension {DIM}) over tp {size}"
        )


def _mine(x: torch.Tensor) -> torch.Tensor:
    size, index = tp_place()
    return x.chunk(size, DIM)[index].contiguous()


@torch.library.custom_op("gradmesh::sp_scatter", mutates_args=())
def _sp_scatter(x: torch.Tensor) -> torch.Tensor:
    """This rank's part of the sequence; all-gather of the gradient in backward."""
    _check(x)
    return _mine(x).clone()


@torch.library.custom_op("gradmesh::sp_gather", mutates_args=())
def _sp_gather(x: torch.Tensor) -> torch.Tensor:
    """Every rank's part of the sequence, in tp order; this rank's part of the gradient in
    backward (the colwise layers reading it have summed it over tp already)."""
    return tp_gather(x, DIM, "sequence gather")


@torch.library.custom_op("gradmesh::sp_reduce_scatter", mutates_args=())
def _sp_reduce_scatter(x: torch.Tensor) -> torch.Tensor:
    """The sum over tp of this rank's part of the sequence; all-gather in backward."""
    _check(x)
    return tp_reduce_scatter(x, DIM, "sequence reduce-scatter")


# On the meta device (the simulator's count) only these shape functions run: a dry run's
# exchanges are recorded here, as the real bodies record them (`layers.dry_exchanges`).
def _dry(x: torch.Tensor, what: str, kind: str) -> None:
    if layers._DRY is not None and x.is_meta:
        layers._DRY.made.append((what, x.numel() * x.element_size(), kind))


def _part(x: torch.Tensor) -> torch.Tensor:
    shape = list(x.shape)
    shape[DIM] //= tp_place()[0]
    return x.new_empty(shape)


@_sp_scatter.register_fake
def _part_shape(x: torch.Tensor) -> torch.Tensor:
    return _part(x)


@_sp_reduce_scatter.register_fake
def _reduced_part_shape(x: torch.Tensor) -> torch.Tensor:
    _dry(x, "sequence reduce-scatter", "reduce_scatter")
    return _part(x)


@_sp_gather.register_fake
def _whole_shape(x: torch.Tensor) -> torch.Tensor:
    _dry(x, "sequence gather", "allgather")
    shape = list(x.shape)
    shape[DIM] *= tp_place()[0]
    return x.new_empty(shape)


def _gather_grad(_ctx: Any, grad: torch.Tensor) -> torch.Tensor:
    return tp_gather(grad.contiguous(), DIM, "sequence gradient gather")


def _mine_grad(_ctx: Any, grad: torch.Tensor) -> torch.Tensor:
    return _mine(grad)


_sp_scatter.register_autograd(_gather_grad)
_sp_reduce_scatter.register_autograd(_gather_grad)
_sp_gather.register_autograd(_mine_grad)


def scatter_sequence(x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = _sp_scatter(x)
    return out


def gather_sequence(x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = _sp_gather(x)
    return out


def reduce_scatter_sequence(x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = _sp_reduce_scatter(x)
    return out


def sum_gradient_over_tp(param: nn.Parameter, done: set[int]) -> None:
    """Sum `param`'s gradient over tp as backward makes it (each rank saw part of the tokens);
    once per parameter (`done` holds the ids already hooked)."""
    if id(param) in done or not param.requires_grad:
        return
    done.add(id(param))
    param.register_hook(  # type: ignore[no-untyped-call]
        lambda g: _tp_collective(g.clone(), "sequence-parallel gradient")
    )


def mark_sequence(module: nn.Module, mode: str, done: set[int]) -> None:
    """Make `module` a sequence-parallel one: `scatter` cuts its input to this rank's part of
    the sequence; otherwise it runs on the part, its parameters' gradients summed over tp, and
    `gather` all-gathers its output."""
    if mode == "scatter":

        def cut(_m: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            return (scatter_sequence(args[0]), *args[1:])

        module.register_forward_pre_hook(cut)
        return
    for p in module.parameters():
        sum_gradient_over_tp(p, done)
    if mode == "gather":

        def whole(_m: nn.Module, _args: Any, out: torch.Tensor) -> torch.Tensor:
            return gather_sequence(out)

        module.register_forward_hook(whole)
