"""Test accuracy and loss: through the step engine, each replica scoring its own slice
(`evaluate`), and after each epoch off the training path (`Evaluator`, for TensorBoard)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

import gradmesh.data.batch as batch
from gradmesh.collectives import allreduce
from gradmesh.data import Split
from gradmesh.data.registry import DataSpec
from gradmesh.layout.engine import Split as ModelSplit
from gradmesh.observe.metrics import Metrics
from gradmesh.runtime.world import Runtime


def has_classes(data: Split) -> bool:
    """Whether the targets are class ids (one integer tensor), so accuracy applies (the same
    answer on every rank: it reads only the data)."""
    targets = data.rows(slice(0, 1)).y if len(data) else data.y  # one read of a lazy split
    return isinstance(targets, torch.Tensor) and not targets.is_floating_point()


class Score(NamedTuple):
    """The test split's accuracy and cross-entropy (per target: per token for a language
    model), every position counted."""

    accuracy: float
    loss: float


def evaluate(split: ModelSplit, data: Split, rt: Runtime) -> Score | None:
    """Accuracy and cross-entropy over the whole split, each replica scoring its own slice
    through the engine; only the rank that holds a replica's logits counts them. None where the
    targets are not class ids (a tuple or dict of targets, real values): neither applies."""
    if not has_classes(data):
        return None
    mine = torch.tensor_split(torch.arange(len(data), device="cpu"), rt.batch.size)[rt.batch.index]
    part = data.rows(mine)
    split.module.eval()
    logits = split.engine.predict(batch.to(part.x, rt.device))
    split.module.train()
    counts = torch.zeros(3, dtype=torch.float64, device=rt.device)
    if split.owns_output and logits is not None:
        y = part.y.to(logits.device)
        counts[0] += (logits.argmax(dim=-1) == y).sum()  # every position
        counts[1] += y.numel()
        flat = logits.reshape(-1, logits.shape[-1])
        counts[2] += F.cross_entropy(flat, y.reshape(-1).long(), reduction="sum").double()
    allreduce(counts, kind="metrics")
    return Score(float(counts[0] / counts[1]), float(counts[2] / counts[1]))


class Evaluator:
    """The test accuracy after each epoch, for TensorBoard, off the training path: the writer
    (holding the whole model) keeps a copy of its parameters after each epoch and scores the
    copies once training ends. Scoring in the step loop cost the default job 13 % of its step
    time, and on a thread of its own (niced or not) 14-19 %, its CPU taken from the ranks'
    (gradmesh bench observe, 2 cores): so the per-epoch curve appears at the end of the run."""

    def __init__(
        self, build: Callable[[], torch.nn.Module], data: DataSpec, metrics: Metrics
    ) -> None:
        self.build, self.data, self.metrics = build, data, metrics
        self.kept: list[tuple[int, dict[str, torch.Tensor]]] = []

    def after(self, step: int, module: torch.nn.Module) -> None:
        self.kept.append(
            (step, {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()})
        )

    def close(self) -> None:
        """Score every copy and write its accuracy at its step."""
        test = self.data.test
        if not has_classes(test):
            self.kept.clear()
            return
        model = self.build().eval()  # a pretrained skeleton's parameters are on the meta device:
        for step, state in self.kept:  # each copy's tensors are taken, not copied into them
            model.load_state_dict(state, assign=True)
            correct = 0
            with torch.no_grad():
                for i in range(0, len(test), 512):
                    part = test.rows(slice(i, i + 512))
                    logits = batch.call(model, part.x)
                    correct += int((logits.argmax(dim=-1) == part.y).sum())
            self.metrics.scalars(step, {"accuracy/test": correct / max(test.y.numel(), 1)})
        self.kept.clear()
