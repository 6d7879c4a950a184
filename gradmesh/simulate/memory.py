"""`gradmesh plan --memory`: each rank's bytes for a model, layout and batch, before launch, in
seconds: the meta device's count of the model (`meta_profile`, what the simulator prices) and
the memory model (`gradmesh.planner.mesh_memory.predict_memory`, what the planner and the
simulator use), for each layout of `--layouts` (the names `gradmesh bench memory` measures:
`dp`, `zero1`..`zero3`, with `xtpT` and `+ac`), so that the two print side by side.

The parts: parameters, gradients, optimizer state (its slots as the optimizer keeps them),
activations (what each block saves for backward, the step's transient, the micro-batches in
flight), FSDP2's gathered parameters and, on a GPU, the optimizer step's temporaries (a foreach
step's copy; the CPU's per-tensor step makes none). Whether the peak fits: a GPU of the
simulator's table fits when the live bytes fit all but its context (`CONTEXT_GIB`); `cpu` when
the ranks together fit the host's available memory (`MemAvailable`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from gradmesh.errors import GradmeshError
from gradmesh.planner.mesh_memory import MemoryPrediction, named_layout, predict_memory
from gradmesh.simulate.devices import DEVICES, Device
from gradmesh.simulate.mesh import CONTEXT_GIB, meta_profile
from gradmesh.simulate.mesh_command import check_axes
from gradmesh.simulate.meta_count import Spec
from gradmesh.train.config import STATE_TENSORS

MB = 1e6


def available_bytes() -> int:
    """This host's available memory (`MemAvailable` of /proc/meminfo)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise GradmeshError("cannot read MemAvailable from /proc/meminfo")


def rank_memory(config: Any) -> dict[str, MemoryPrediction]:
    """Each layout's prediction for the rank that holds the most (`config`: `PlanConfig`)."""
    from gradmesh.data import DATASETS
    from gradmesh.data.registry import DataOptions
    from gradmesh.models.registry import is_token_model
    from gradmesh.registry import parse_kwargs

    if config.optimizer not in STATE_TENSORS:
        raise GradmeshError(f"unknown --optimizer {config.optimizer!r}")
    dataset = "text" if config.dataset == "synthetic" else config.dataset
    if not is_token_model(config.model) and not config.model.startswith("hf:"):
        raise GradmeshError(
            "plan --memory counts token models on the meta device (gpt, hf:...), "
            f"not {config.model}"
        )
    vocab = DATASETS.get(dataset)(DataOptions(sequence=config.sequence_length)).num_classes
    model_args = parse_kwargs(config.model_args, "--model-args")
    spec = Spec(config.model, model_args, config.sequence_length, vocab, "fp32", config.optimizer)
    grids = {name: named_layout(name, config.workers) for name in config.layouts.split(",")}
    device = _device(config.device)
    tps = sorted({g.tp for g in grids.values()})
    meta = meta_profile(spec, config.workers, config.batch, tps, device)
    for grid in grids.values():
        check_axes(meta, grid)  # a layout the trainer refuses is not priced
    profile = meta.profile
    if config.device == "cpu":  # a CPU's optimizer steps tensor by tensor: no foreach copy
        slices = {
            tp: dataclasses.replace(sl, optimizer_step_bytes=0) for tp, sl in profile.slices.items()
        }
        profile = dataclasses.replace(profile, slices=slices)
    return {name: predict_memory(profile, grid) for name, grid in grids.items()}


def _device(name: str) -> Device:
    """The device the count is priced on: its times are not used, only its bytes, so a CPU's
    count is priced on any GPU of the table."""
    return DEVICES.get("h100" if name == "cpu" else name).at("fp32")


def fits(total: float, config: Any) -> tuple[bool, str]:
    """Whether a rank's `total` bytes fit `config.device`, and what it was held against."""
    if config.device == "cpu":
        room = available_bytes()
        return total * config.workers <= room, f"{config.workers} ranks in {room / MB:,.0f} MB"
    size = DEVICES.get(config.device).memory_gib
    return total <= (size - CONTEXT_GIB) * 2**30, f"{size:g} GiB less {CONTEXT_GIB:g} of context"


def run(config: Any) -> int:
    """Print the table (and write the JSON with `--json`)."""
    import json

    found = rank_memory(config)
    rows = {}
    print(
        f"gradmesh plan --memory: {config.model} {config.model_args}, {config.workers} ranks, "
        f"global batch {config.batch} x {config.sequence_length} tokens, {config.optimizer}, "
        f"on {config.device} (MB a rank, the rank that holds the most)"
    )
    print("| layout | parameters | gradients | optimizer | activations | gathered | peak | fits |")
    print("|---|---|---|---|---|---|---|---|")
    for name, p in found.items():
        ok, against = fits(p.total_bytes, config)
        rows[name] = {**p.parts(), "state": p.state_bytes, "peak": p.total_bytes, "fits": ok}
        print(
            f"| {name} | {p.param_bytes / MB:.2f} | {p.grad_bytes / MB:.2f} | "
            f"{p.optimizer_bytes / MB:.2f} | {p.activation_bytes / MB:.2f} | "
            f"{p.gathered_bytes / MB:.2f} | {p.total_bytes / MB:.2f} | "
            f"{'yes' if ok else 'no'} ({against}) |"
        )
    if config.json:
        Path(config.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0
