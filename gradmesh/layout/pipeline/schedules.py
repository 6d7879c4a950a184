"""Pipeline parallelism: the model's layer sequence cut into stages along the mesh's `pp` axis,
micro-batches streamed through them with the GPipe, the 1F1B or the interleaved 1F1B schedule.

Stage s holds a contiguous run of the model's layers (an `nn.Sequential`; parameter names are
kept, so a stage's state_dict reads like the matching part of the whole model's). The cut is
given by the user (`--stages 4,9`: the first layer of each stage after the first) or balanced on
the layers' forward+backward times, measured on every rank and averaged over the world so that
every rank cuts alike.

Each replica's batch is split into m micro-batches. GPipe runs every micro-batch's forward, then
every backward; 1F1B runs p - s - 1 forwards, then alternates one forward and one backward, then
drains the backwards, so a stage holds at most p - s micro-batches' activations instead of m.
Both leave each stage idle for (p - 1) / (m + p - 1) of the step when stages take equal time
(the bubble). The interleaved schedule (Narayanan et al., 2021) cuts the model into p v stages
and gives rank s the v chunks s, s + p, ...: a micro-batch visits every rank v times, each
visit v times shorter, so filling and draining cost v times less and the bubble is
(p - 1) / (v m + p - 1), for v times more point-to-point messages. The stage engine
(`gradmesh.layout.pipeline.engine.PipelineEngine`) measures each stage's time outside computation;
`bubble` reads the pipeline's bubble off the stage that computes longest (the others also wait
for it).

Activations and their gradients travel as raw tensors over tagged point-to-point messages
(`Channel`, with the job's timeout): every rank knows each boundary's shape from a dry run of
the whole model, and each micro-batch's size from the batch, so nothing is described on the
wire. Any other model is cut on its graph (`gradmesh.layout.pipeline.graph`), which uses
torch's split but not its schedules. Why not `torch.distributed.pipelining`'s schedules: its
stages infer shapes by sending pickled metadata (`send_object_list`) unless every shape is given
up front, its schedules want equal micro-batches (an epoch's last batch is smaller), it is not
tested on Gloo upstream, and its sends bypass gradmesh's timeouts that name the peer stage.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn

from gradmesh.collectives import allreduce
from gradmesh.errors import GradmeshError
from gradmesh.runtime.world import Runtime


def layers_of(model: nn.Module, name: str) -> list[tuple[str, nn.Module]]:
    """The model's layer sequence, or one line saying the model cannot be cut into stages."""
    if not isinstance(model, nn.Sequential):
        raise GradmeshError(
            f"model {name} is not a sequence of layers (nn.Sequential); pipeline parallelism "
            "cuts a layer sequence into stages"
        )
    return list(model.named_children())


def units(layers: list[tuple[str, nn.Module]]) -> list[int]:
    """Where a stage may start: at each layer with weights, the layers without weights before it
    joining it (a stage of ReLUs and reshapes alone would have nothing to train)."""
    weighted = [i for i, (_, layer) in enumerate(layers) if any(True for _ in layer.parameters())]
    return [0, *weighted[1:]] if weighted else []


def parse_stages(text: str, layers: list[tuple[str, nn.Module]], pp: int) -> list[int] | None:
    """'4,9' -> [0, 4, 9]: each stage's first layer; None when `text` is empty (balance)."""
    starts_ok = units(layers)
    if pp > len(starts_ok):
        raise GradmeshError(
            f"a pipeline of {pp} stages asks for more stages than the model's {len(starts_ok)} "
            f"layers with weights; at most {len(starts_ok)} stages fit (a pipeline's stages: "
            "--pipeline-parallel times the stages each rank holds, 2 under zbv, "
            "--virtual-stages under interleaved)"
        )
    if not text:
        return None
    try:
        starts = [0, *(int(part) for part in text.split(","))]
    except ValueError:
        raise GradmeshError(f"--stages {text!r}: expected layer indices like 4,9") from None
    if (
        len(starts) != pp
        or any(b <= a for a, b in itertools.pairwise(starts))
        or not set(starts) <= set(starts_ok)
    ):
        raise GradmeshError(
            f"--stages {text!r} must give {pp - 1} increasing indices of layers with weights "
            f"(the first layer of each stage after the first; any of "
            f"{', '.join(map(str, starts_ok[1:]))})"
        )
    return starts


def balance(times: list[float], pp: int) -> list[int]:
    """Each stage's first layer, cutting `times` into `pp` contiguous runs so that the slowest
    run is as fast as it can be (exact, by dynamic programming; O(pp n^2), so remembered: the
    planners price many layouts of one model)."""
    return list(_balance(tuple(times), pp))


@functools.lru_cache(maxsize=256)
def _balance(times: tuple[float, ...], pp: int) -> tuple[int, ...]:
    n = len(times)
    prefix = [0.0]
    for t in times:
        prefix.append(prefix[-1] + t)
    inf = float("inf")
    # best[k][i]: the slowest stage when the first i layers make k stages; cut[k][i]: last start
    best = [[inf] * (n + 1) for _ in range(pp + 1)]
    cut = [[0] * (n + 1) for _ in range(pp + 1)]
    best[0][0] = 0.0
    for k in range(1, pp + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    starts, i = [], n
    for k in range(pp, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return tuple(starts[::-1])


def layer_times(
    layers: list[tuple[str, nn.Module]], sample: torch.Tensor, rounds: int = 3
) -> list[float]:
    """Seconds of forward + backward of each layer on `sample` (the median of `rounds`)."""
    times = []
    x = sample
    for _, layer in layers:
        runs = []
        for _ in range(rounds):
            inp = x.detach().requires_grad_(x.is_floating_point())
            started = time.perf_counter()
            out = layer(inp)
            if out.requires_grad:
                out.backward(torch.ones_like(out))
            runs.append(time.perf_counter() - started)
        times.append(sorted(runs)[len(runs) // 2])
        x = out.detach()
    layer_zero_grads(layers)
    return times


def layer_zero_grads(layers: list[tuple[str, nn.Module]]) -> None:
    for _, layer in layers:
        for p in layer.parameters():
            p.grad = None


def cut_stages(
    model: nn.Module,
    name: str,
    pp: int,
    stages: str,
    sample: torch.Tensor,
    rt: Runtime | None,
) -> list[int]:
    """Each stage's first layer: given by `stages`, or balanced on layer times measured on every
    rank and averaged over the world (`rt`), so that every rank cuts alike."""
    layers = layers_of(model, name)
    given = parse_stages(stages, layers, pp)
    if given is not None:
        return given
    times = torch.tensor(layer_times(layers, sample), dtype=torch.float64, device=sample.device)
    if rt is not None and rt.size > 1:
        allreduce(times, op="average", kind="metrics")
    starts = units(layers)
    ends = [*starts[1:], len(layers)]
    per_unit = [float(times[a:b].sum()) for a, b in zip(starts, ends, strict=True)]
    return [starts[i] for i in balance(per_unit, pp)]


def sample_shapes(layers: list[tuple[str, nn.Module]], sample: torch.Tensor) -> list[torch.Size]:
    """The per-sample shape entering each layer, and finally the output's, from a dry run."""
    shapes = [sample.shape[1:]]
    x = sample
    with torch.no_grad():
        for _, layer in layers:
            x = layer(x)
            shapes.append(x.shape[1:])
    return shapes


def stage_module(model: nn.Module, starts: list[int], index: int) -> nn.Sequential:
    """Stage `index`'s layers as an `nn.Sequential` that keeps the model's layer names."""
    layers = list(model.named_children())
    end = starts[index + 1] if index + 1 < len(starts) else len(layers)
    return nn.Sequential(OrderedDict(layers[starts[index] : end]))


@dataclass
class BubbleClock:
    """A stage's time in steps and the part of it spent computing; the rest is idle (waiting
    for a neighbour stage)."""

    step_s: float = 0.0
    busy_s: float = 0.0

    def idle(self) -> float:
        return 1.0 - self.busy_s / self.step_s if self.step_s > 0 else 0.0


def bubble(busy_s: list[float], idle: list[float]) -> float:
    """The pipeline's bubble from every stage's busy seconds and idle fraction: the idle part of
    the step of the stage that computes longest. That stage sets the pipeline's pace and waits
    only while the pipeline fills and drains, which is what (p - 1) / (m + p - 1) counts for
    equal stages; a faster stage also waits for the slower one (imbalance), which the mean idle
    of all stages includes."""
    return idle[max(range(len(busy_s)), key=busy_s.__getitem__)]
