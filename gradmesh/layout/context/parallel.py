"""The context-parallel step: each batch's sequences cut over the cp ranks (`chunks`), the
model's positions set to the tokens each rank holds, and its attention (every call to torch's
`scaled_dot_product_attention`, while the step runs) made ring or all-to-all attention over
the cp axis. The model is not rewritten: any model whose attention calls torch's fused
attention, causally and without a mask (gradmesh's GPT, Hugging Face's Llama family with
`attn_implementation="sdpa"`), and whose forward takes the positions (`positions=` or
`position_ids=`), runs context-parallel as it is."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_map

import gradmesh.data.batch as batch
from gradmesh.collectives.api import allreduce, exchanged
from gradmesh.data.batch import Batch
from gradmesh.errors import GradmeshError
from gradmesh.layout.context.chunks import check_length, positions, restore, take
from gradmesh.layout.context.ring import Ring, ring_attention
from gradmesh.layout.context.ulysses import alltoall_attention
from gradmesh.runtime.axes import CP
from gradmesh.runtime.mesh import Axis

TORCH_ATTENTION = F.scaled_dot_product_attention
"""torch's own fused attention, which the step's attention stands in for and Ulysses calls."""
POSITION_ARGUMENTS = ("positions", "position_ids")
"""The forward arguments that take each token's position (gradmesh's GPT, Hugging Face's)."""


class Attending:
    """The attention the model's calls get while a step runs; counts them, remembers heads."""

    def __init__(self, axis: Axis | None, mode: str, model_name: str) -> None:
        self.axis, self.mode, self.model_name = axis, mode, model_name
        self.ring = Ring(axis) if axis is not None and mode == "ring" else None
        self.calls, self.heads = 0, 0

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        if attn_mask is not None or not is_causal or dropout_p:
            got = "a mask" if attn_mask is not None else "dropout" if dropout_p else "no is_causal"
            raise GradmeshError(
                f"--context-parallel: model {self.model_name} calls scaled_dot_product_attention "
                f"with {got}; context parallelism splits causal self-attention without a mask "
                "or dropout"
            )
        self.calls, self.heads = self.calls + 1, query.shape[1]
        if enable_gqa and key.shape[1] != query.shape[1]:
            key = key.repeat_interleave(query.shape[1] // key.shape[1], 1)
            value = value.repeat_interleave(query.shape[1] // value.shape[1], 1)
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        if self.axis is None:  # the check before launch: the whole sequence, torch's kernel
            return TORCH_ATTENTION(query, key, value, is_causal=True, scale=scale)
        if self.ring is not None:
            return ring_attention(query, key, value, scale, self.ring)
        return alltoall_attention(query, key, value, scale, self.axis, TORCH_ATTENTION)

    def check_called(self) -> None:
        """One line unless the model's forward called torch's attention (else each rank would
        attend to its own chunks only)."""
        if self.calls == 0:
            raise GradmeshError(
                f"--context-parallel: model {self.model_name} never calls torch's "
                "scaled_dot_product_attention, which context parallelism splits (an attention "
                "written out by hand, or Hugging Face's eager attention: use "
                "attn_implementation='sdpa')"
            )

    def installed(self) -> contextlib.AbstractContextManager[None]:
        """torch's attention is this object while the block runs (forward and backward, where
        recomputation calls it again)."""
        return attention_replaced(self)


@contextlib.contextmanager
def attention_replaced(fn: Any) -> Iterator[None]:
    """`F.scaled_dot_product_attention` is `fn` inside the block (and torch's again after)."""
    F.scaled_dot_product_attention = fn
    try:
        yield
    finally:
        F.scaled_dot_product_attention = TORCH_ATTENTION


def position_argument(model: nn.Module, model_name: str) -> str:
    """The name of the forward argument that takes the positions; one line when none does."""
    taken = inspect.signature(model.forward).parameters
    for name in POSITION_ARGUMENTS:
        if name in taken:
            return name
    raise GradmeshError(
        f"--context-parallel: model {model_name}'s forward takes no positions argument "
        f"({' or '.join(POSITION_ARGUMENTS)}): each rank's chunks need their places in the "
        "whole sequence"
    )


def check_context(
    model: nn.Module, model_name: str, cp: int, attention: str, sample: Batch, tp: int = 1
) -> None:
    """One line, before launch, unless `model` can run context-parallel over `cp` ranks on
    batches like `sample`: the sequence cuts into 2 x cp chunks, the forward takes positions,
    its attention is torch's, causal and without a mask (tried on one sample of 2 x cp tokens:
    cheap whatever the sequence), and for all-to-all its heads (on each of `tp` ranks) divide
    by cp."""
    length = _length(sample)
    check_length(length, cp, f"--context-parallel: model {model_name}: ")
    argument = position_argument(model, model_name)
    probe = Attending(None, attention, model_name)
    short = 2 * cp

    def cut(t: torch.Tensor) -> torch.Tensor:
        return t[:, :short] if t.dim() >= 2 and t.shape[1] == length else t

    first = tree_map(cut, batch.rows(sample, slice(0, 1)))
    with torch.no_grad(), probe.installed():
        args, kwargs = batch.arguments(first)
        where = torch.arange(short, device=batch.leaves(first)[0].device)
        model(*args, **kwargs, **{argument: where[None]})
    probe.check_called()
    if attention == "alltoall":
        check_heads(probe.heads, tp, cp, model_name)


def check_heads(heads: int, tp: int, cp: int, model_name: str) -> None:
    """One line unless all-to-all attention's `heads` (on each of `tp` ranks) divide by cp."""
    if heads % tp or (heads // tp) % cp:
        raise GradmeshError(
            f"--context-attention alltoall: model {model_name} has {heads} attention heads"
            f"{f' over tp {tp} ({heads // tp} a rank)' if tp > 1 else ''}, which "
            f"--context-parallel {cp} does not divide; use --context-attention ring"
        )


def _length(sample: Batch) -> int:
    leaves = batch.leaves(sample)
    if leaves[0].dim() < 2:
        raise GradmeshError(
            "--context-parallel splits sequences: the inputs must be (samples, sequence, ...)"
        )
    return int(leaves[0].shape[1])


class ContextEngine:
    """An engine whose steps run on this rank's chunks of each sequence (`chunks`), with the
    model's attention over the cp axis; the loss it returns is the whole sequence's."""

    def __init__(self, inner: Any, model: nn.Module, axis: Axis, attending: Attending) -> None:
        self.inner, self.axis, self.attending = inner, axis, attending
        self.argument = position_argument(model, attending.model_name)
        self.where: torch.Tensor | None = None
        model.register_forward_pre_hook(self._positions, with_kwargs=True)

    @property
    def backward_passes(self) -> int:
        return int(self.inner.backward_passes)

    def _positions(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
        if self.where is not None:
            kwargs[self.argument] = self.where[None]
        return args, kwargs

    def _part(self, data: Batch, length: int) -> Batch:
        cp, index = self.axis.size, self.axis.index

        def cut(t: torch.Tensor) -> torch.Tensor:
            return take(t, cp, index) if t.dim() >= 2 and t.shape[1] == length else t

        return tree_map(cut, data)

    @contextlib.contextmanager
    def _on(self, x: Batch) -> Iterator[int]:
        length = _length(x)
        check_length(length, self.axis.size)
        self.where = positions(length, self.axis.size, self.axis.index, batch.leaves(x)[0].device)
        try:
            with self.attending.installed():
                yield length
        finally:
            self.where = None

    def step(self, x: Batch, y: Batch, scale: float | torch.Tensor) -> torch.Tensor:
        with self._on(x) as length:
            loss = self.inner.step(self._part(x, length), self._part(y, length), scale)
        self.attending.check_called()
        whole = loss.detach().clone().reshape(1)
        allreduce(whole, op="average", group=self.axis.group, kind="metrics")
        return whole.reshape(())  # type: ignore[no-any-return]

    @torch.no_grad()
    def predict(self, x: Batch) -> torch.Tensor | None:
        with self._on(x) as length:
            mine = self.inner.predict(self._part(x, length))
        assert mine is not None, "context parallelism runs without a pipeline"
        parts = [torch.empty_like(mine) for _ in range(self.axis.size)]
        with exchanged("context-parallel logits", mine.numel() * mine.element_size(), "metrics"):
            dist.all_gather(parts, mine.contiguous(), group=self.axis.group)
        return restore(parts)


def context_parallel(split: Any, model_name: str, attention: str, rt: Any) -> Any:
    """The recipe's context step: `split` (a `Split` of a model without a pipeline) with its
    engine's steps on this rank's chunks of the sequence and its attention over the cp axis;
    `split` itself at cp 1."""
    axis = rt.mesh[CP]
    if axis.size == 1:
        return split
    engine = ContextEngine(split.engine, split.module, axis, Attending(axis, attention, model_name))
    split.info["context_attention"] = attention
    return replace(split, engine=engine, owns_output=split.owns_output and axis.index == 0)
