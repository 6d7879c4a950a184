"""The one loss convention, for `gradmesh train --loss`, `gradmesh.pipeline_stage(loss_fn=)`,
`gradmesh.parallelize` and every engine: a loss is `fn(outputs, targets)` returning the mean
over the batch's samples, as PyTorch's losses return it (`F.cross_entropy`, `nn.MSELoss()`).

The engines need a sum: a micro-batch's loss counts its samples once each, so that a step's
micro-batches add up to the batch's sum, which `step(x, y, scale)` then scales (by 1 / the
batch, for the mean). `Summed` makes that sum from the user's mean, in one place, and checks
what the loss returned (a scalar), naming the loss in one line otherwise.

`outputs` are what the model's forward returns, in its structure: a tensor, a tuple, or a
Hugging Face `ModelOutput` (read its `.logits`, or `.loss` when the model was given `labels`).
A pipeline's last stage puts its values back into that structure (`GraphStages.output_of`),
so one loss serves a whole model and its cut. The default loss reads the logits from any of
them (`logits_of`). A model with mixtures of experts returns a `MoEOutput`
(`gradmesh.models.moe`): the engines add its balance loss (a mean over samples too) to the
user's loss, which need not know of it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from gradmesh.data.batch import size as batch_size
from gradmesh.errors import GradmeshError
from gradmesh.models.moe import MoEOutput

LossFn = Callable[[Any, Any], torch.Tensor]
"""fn(outputs, targets) -> the batch's mean loss (a scalar tensor); targets are what the step
was given (a tensor, or a tuple or dict of tensors)."""


def logits_of(out: Any) -> torch.Tensor:
    """The logits in a model's output: the tensor itself, a `ModelOutput`'s `.logits`, or the
    first element of a tuple or list; one line for anything else."""
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(out, tuple | list) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise GradmeshError(
        f"cannot find the logits in a model output of type {type(out).__name__}: return a "
        "tensor, a tuple whose first element is the logits, or an object with .logits"
    )


def cross_entropy(out: Any, y: torch.Tensor) -> torch.Tensor:
    """The default loss: cross-entropy, the batch's mean; for sequences (logits (batch, time,
    classes), labels (batch, time)) the mean over every position, which is the mean over the
    samples of each sample's mean over its positions."""
    logits = logits_of(out)
    if y.dim() == 1:
        return F.cross_entropy(logits, y)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _name(fn: Any) -> str:
    return str(getattr(fn, "__qualname__", None) or type(fn).__name__)


class Summed:
    """The engines' form of a mean loss: `fn(out, y)` times the micro-batch's samples; one line
    naming the loss when it does not return a scalar tensor."""

    def __init__(self, fn: LossFn, name: str = "") -> None:
        self.fn, self.name = fn, name or _name(fn)
        _check_signature(fn, self.name)

    def __call__(self, out: Any, y: Any) -> torch.Tensor:
        n = batch_size(y)
        if n == 0:  # a rank's share of a last, short batch: a sum of nothing, still in the graph
            return logits_of(out).sum() * 0.0
        value = self.fn(out, y)
        if not isinstance(value, torch.Tensor) or value.dim() != 0:
            got = (
                f"shape {tuple(value.shape)}"
                if isinstance(value, torch.Tensor)
                else (type(value).__name__)
            )
            raise GradmeshError(
                f"loss {self.name} returned {got}, not a scalar: return the batch's mean "
                "(reduction='mean', as torch's losses do); the engines multiply it by the samples"
            )
        if isinstance(out, MoEOutput):  # a mixture's balance loss, a mean over samples too
            value = value + out.aux_loss
        return value * n


def _check_signature(fn: Any, name: str) -> None:
    """One line, before the first step, for a loss that cannot be called as `fn(outputs,
    targets)` (not a function, or another signature); one whose signature Python cannot read
    is called as it is."""
    if not callable(fn):
        raise GradmeshError(f"loss {name} is a {type(fn).__name__}, not a function")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(None, None)
    except TypeError as exc:
        raise GradmeshError(
            f"loss {name} cannot be called as fn(outputs, targets): {signature} ({exc})"
        ) from None


def summed(fn: LossFn | None, name: str = "") -> Summed:
    """`fn` (default: `cross_entropy`) in the engines' form; a `Summed` is kept as it is."""
    if isinstance(fn, Summed):
        return fn
    return Summed(fn or cross_entropy, name)
