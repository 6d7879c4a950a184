"""Checkpoints across layouts: a checkpoint saved at one data x tensor-parallel layout (dp4,
say) resumes at another (dp2 x tp2), or loads into one whole model for inference.

Each rank file already holds that rank's part: its tensor-parallel slices (tp ranks are
adjacent, so ranks 0..tp-1 hold one replica's slices and every other replica is a copy) and
its optimizer state for them. It also records how each split parameter was cut (`layout`: the
dimension and chunks of `shard_specs`, and the optimizer's parameters by name). Resharding puts
each tensor back together from the first replica's files (`unshard`), then cuts this rank's
slice with the new layout's own specs (`shard`): parameters and every optimizer tensor shaped
like its parameter (Adam's moments), with the optimizer's entries matched by parameter name.

Why not torch's distributed checkpoint (DCP), which reshards too: its reader loads the
checkpoint's `.metadata` with pickle, and these files load with `weights_only=True` only. What it
does that this does not: each rank reads just the byte ranges it needs. Here every rank reads
the first replica's files whole and holds the whole state while it cuts its part, which suits
models whose state fits a host's memory; layouts with pipeline stages or ZeRO shards are refused.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from gradmesh.errors import GradmeshError, first_line
from gradmesh.layout.tensor_parallel import shard, unshard
from gradmesh.layout.tp_plan import shard_specs
from gradmesh.train.checkpoint.files import Meta, complete, rank_file, read_meta, read_rank

__all__ = ["layout_record", "load_whole", "part_for", "saved_layout", "whole_state"]

LAYOUT_KEYS = ("workers", "tensor_parallel", "pipeline_parallel")
"""The settings a resharded resume may change: the first two."""


def optimizer_names(module: nn.Module, optimizer: Optimizer) -> list[str]:
    """The name of each of the optimizer's parameters, in its own order."""
    names = {id(p): n for n, p in module.named_parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return [names.get(id(p), f"(unnamed #{i})") for i, p in enumerate(params)]


def layout_record(module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """What a rank file records of its layout: each split parameter's cut, by every name it
    has in the state dict, and the optimizer's parameters by name."""
    specs = {n: [dim, list(chunks)] for n, (dim, chunks) in shard_specs(module).items()}
    return {"specs": specs, "names": optimizer_names(module, optimizer)}


def saved_layout(meta: Meta) -> tuple[int, int, int]:
    """(workers, tp, pp) of the run that wrote `meta`."""
    values = [meta.identity.get(k, 1) for k in LAYOUT_KEYS]
    return values[0], values[1], values[2]


def _cut(specs: dict[str, Any], name: str) -> tuple[int, tuple[int, ...]] | None:
    spec = specs.get(name)
    return None if spec is None else (int(spec[0]), tuple(int(c) for c in spec[1]))


def whole_state(meta: Meta) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The whole model's state dict and optimizer state (entries by parameter name) that
    `meta`'s checkpoint holds in parts; one line naming the file when it cannot."""
    _, tp, pp = saved_layout(meta)
    if pp > 1:
        raise GradmeshError(
            f"checkpoint {meta.checkpoint} was saved with --pipeline-parallel {pp}: its stages "
            "cannot be put together into another layout (resume it with the same layout)"
        )
    parts = [read_rank(meta.checkpoint, r) for r in range(tp)]  # the first replica's slices
    layouts = [part.get("layout") for part in parts]
    if not all(isinstance(x, dict) and {"specs", "names"} <= set(x) for x in layouts):
        raise GradmeshError(
            f"checkpoint {rank_file(meta.checkpoint, 0)} records no layout (written by an older "
            "gradmesh): resume it with the layout that saved it"
        )
    specs, names = layouts[0]["specs"], layouts[0]["names"]  # type: ignore[index]

    def join(name: str, pieces: list[Any]) -> Any:
        cut = _cut(specs, name)
        if cut is None or tp == 1:
            return pieces[0]
        return unshard(list(pieces), *cut)

    try:
        model = {k: join(k, [p["model"][k] for p in parts]) for k in parts[0]["model"]}
        saved = parts[0]["optimizer"]
        state: dict[str, dict[str, Any]] = {}
        for index, entry in saved["state"].items():
            name = names[int(index)]
            local = parts[0]["model"].get(name)
            state[name] = {
                key: join(name, [p["optimizer"]["state"][index][key] for p in parts])
                if isinstance(value, torch.Tensor)
                and local is not None
                and value.shape == local.shape
                else value
                for key, value in entry.items()
            }
        groups = [
            {**group, "params": [names[int(i)] for i in group["params"]]}
            for group in saved["param_groups"]
        ]
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as exc:
        raise GradmeshError(
            f"checkpoint {meta.checkpoint} cannot be put back together: {first_line(exc)}"
        ) from None
    return model, {"state": state, "param_groups": groups}


def part_for(
    whole: tuple[dict[str, torch.Tensor], dict[str, Any]],
    module: nn.Module,
    optimizer: Optimizer,
    parts: int,
    index: int,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This rank's model state dict and optimizer state dict, cut from `whole` as `module`
    (tp slice `index` of `parts`) is cut from the whole model."""
    model, saved = whole
    specs = {n: [dim, list(chunks)] for n, (dim, chunks) in shard_specs(module).items()}

    def cut(name: str, value: Any) -> Any:
        spec = _cut(specs, name)
        if spec is None or parts == 1 or not isinstance(value, torch.Tensor):
            return value
        if name in model and value.shape != model[name].shape:
            return value  # not shaped like its parameter (a step count): every rank's
        return shard(value, spec[0], parts, index, spec[1])

    names = optimizer_names(module, optimizer)
    position = {name: i for i, name in enumerate(names)}
    try:
        state = {
            position[name]: {key: cut(name, value) for key, value in entry.items()}
            for name, entry in saved["state"].items()
        }
        groups = [
            {**group, "params": [position[n] for n in group["params"]]}
            for group in saved["param_groups"]
        ]
    except KeyError as exc:
        raise GradmeshError(f"the optimizer has no parameter {exc.args[0]!r}") from None
    return {k: cut(k, v) for k, v in model.items()}, {"state": state, "param_groups": groups}


def load_whole(directory: str | Path, model: nn.Module, optimizer: Optimizer | None = None) -> Meta:
    """Load the newest complete checkpoint of `directory`, whatever layout saved it, into one
    whole `model` (and `optimizer`), for inference or a run on one process; returns its
    metadata. One line when there is none or it does not fit."""
    found = complete(directory)
    if not found:
        raise GradmeshError(f"no complete checkpoint in {directory}")
    meta = read_meta(found[0])
    state, saved = whole_state(meta)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.load_state_dict(state)
            if optimizer is not None:
                optimizer.load_state_dict(part_for((state, saved), model, optimizer, 1, 0)[1])
    except (RuntimeError, KeyError, ValueError) as exc:
        raise GradmeshError(
            f"checkpoint {meta.checkpoint} does not fit this model: {first_line(exc)}"
        ) from None
    return meta
