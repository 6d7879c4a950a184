"""Test accuracy: through the step engine, each replica scoring its own slice (`evaluate`), and
after each epoch off the training path (`Evaluator`, for TensorBoard)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from gradmesh.collectives import allreduce
from gradmesh.data import Split
from gradmesh.data.registry import DataSpec
from gradmesh.layout.engine import Split as ModelSplit
from gradmesh.observe.metrics import Metrics
from gradmesh.runtime.world import Runtime


def evaluate(split: ModelSplit, data: Split, rt: Runtime) -> float:
    """Accuracy over the whole split, each replica scoring its own slice through the engine;
    only the rank that holds a replica's logits counts them."""
    mine = torch.tensor_split(torch.arange(len(data)), rt.dp.size)[rt.dp.index]
    split.module.eval()
    logits = split.engine.predict(data.x[mine].to(rt.device))
    split.module.train()
    counts = torch.zeros(2, dtype=torch.float64)
    if split.owns_output and logits is not None:
        correct = (logits.argmax(dim=-1).cpu() == data.y[mine]).sum()  # every position
        counts += torch.tensor([float(correct), float(data.y[mine].numel())], dtype=torch.float64)
    allreduce(counts, kind="metrics")
    return float(counts[0] / counts[1])


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
        model = self.build().eval()
        test = self.data.test
        for step, state in self.kept:
            model.load_state_dict(state)
            correct = 0
            with torch.no_grad():
                for i in range(0, len(test), 512):
                    logits = model(test.x[i : i + 512])
                    correct += int((logits.argmax(dim=-1) == test.y[i : i + 512]).sum())
            self.metrics.scalars(step, {"accuracy/test": correct / max(test.y.numel(), 1)})
        self.kept.clear()
