"""Checkpoints across layouts: a checkpoint saved at one data x tensor-parallel layout (dp4,
say) resumes at another (dp2 x tp2), or loads into one whole model for inference.

Each rank file already holds that rank's part: its tensor-parallel slices (tp ranks are
adjacent, so ranks 0..tp-1 hold one replica's slices and every other replica is a copy) and
its optimizer state for them. It also records how each split parameter was cut (`layout`: the
dimension and chunks of `shard_specs`, and the optimizer's parameters by name). Resharding puts
each tensor back together from the first replica's files (`unshard`), then cuts this rank's
slice with the new layout's own specs (`shard`): parameters and every optimizer tensor shaped
like its parameter (Adam's moments), with the optimizer's entries matched by parameter name.

Under sharded data parallelism (`--zero-stage` 2 and 3, FSDP2) each rank holds a shard of
every tensor (its rows `[d c, (d + 1) c)`, c = ceil(rows / dp), of each tp slice) and writes only
that: `dp_shards` records which parameters are so sharded. Putting a tensor back together then
reads every replica's file (the shards, in dp order, are its tp slice), and cutting a rank's
part of a sharded model takes its rows of its slice. Loading wraps the shards back into the
DTensors FSDP2 holds (`load_model`, `optimizer_state`).

Why not torch's distributed checkpoint (DCP), which reshards too: its reader loads the
checkpoint's `.metadata` with pickle, and these files load with `weights_only=True` only. What it
does that this does not: each rank reads just the byte ranges it needs. Here every rank reads
the first replica's files whole and holds the whole state while it cuts its part, which suits
models whose state fits a host's memory; layouts with pipeline stages are refused.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from gradmesh.errors import GradmeshError, first_line
from gradmesh.layout.config import LAYOUT_KEYS
from gradmesh.layout.tensor.layers import shard, unshard
from gradmesh.layout.tensor.plan import shard_specs
from gradmesh.sync.sharded.model import local
from gradmesh.train.checkpoint.files import Meta, complete, rank_file, read_meta, read_rank

__all__ = [
    "layout_record",
    "load_model",
    "load_whole",
    "optimizer_state",
    "part_for",
    "rank_part",
    "saved_layout",
    "whole_model",
    "whole_state",
]


def optimizer_names(module: nn.Module, optimizer: Optimizer) -> list[str]:
    """The name of each of the optimizer's parameters, in its own order."""
    names = {id(p): n for n, p in module.named_parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return [names.get(id(p), f"(unnamed #{i})") for i, p in enumerate(params)]


def dp_shards(module: nn.Module) -> dict[str, list[int]]:
    """The parameters sharded over the data-parallel replicas (FSDP2's DTensors, rows split),
    by every state-dict name: [replicas, this rank's index]."""
    found = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None:
            found[name] = [mesh.size(), mesh.get_local_rank()]
    return found


def layout_record(module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """What a rank file records of its layout: each split parameter's cut, by every name it
    has in the state dict, the parameters sharded over the replicas, and the optimizer's
    parameters by name."""
    from gradmesh.sync.sharded.optimizer import optimizer_sharded

    specs = {n: [dim, list(chunks)] for n, (dim, chunks) in shard_specs(module).items()}
    names = optimizer_names(module, optimizer)
    return {
        "specs": specs,
        "names": names,
        "dp_shards": dp_shards(module),
        "optimizer_shards": optimizer_sharded(optimizer),
    }


def saved_layout(meta: Meta) -> tuple[int, int, int, int]:
    """(workers, tp, pp, ZeRO stage) of the run that wrote `meta`."""
    got = {k: meta.identity.get(k) for k in LAYOUT_KEYS}
    return (
        int(got["workers"] or 1),
        int(got["tensor_parallel"] or 1),
        int(got["pipeline_parallel"] or 1),
        int(got["zero_stage"] or 0),
    )


def rows(whole: torch.Tensor, parts: int, index: int) -> torch.Tensor:
    """Replica `index`'s shard of `whole` under FSDP2: rows [i c, (i + 1) c), c = ceil(n / parts)
    (the last ones may hold fewer, or none)."""
    per = -(-whole.shape[0] // parts)
    start = min(index * per, whole.shape[0])
    return whole[start : start + per].clone()


def _cut(specs: dict[str, Any], name: str) -> tuple[int, tuple[int, ...]] | None:
    spec = specs.get(name)
    return None if spec is None else (int(spec[0]), tuple(int(c) for c in spec[1]))


def whole_state(meta: Meta) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The whole model's state dict and optimizer state (entries by parameter name) that
    `meta`'s checkpoint holds in parts; one line naming the file when it cannot."""
    workers, tp, pp, _ = saved_layout(meta)
    if pp > 1:
        raise GradmeshError(
            f"checkpoint {meta.checkpoint} was saved with --pipeline-parallel {pp}: its stages "
            "cannot be put together into another layout (resume it with the same layout)"
        )
    first = read_rank(meta.checkpoint, 0)
    record = first.get("layout")
    if not isinstance(record, dict) or not {"specs", "names"} <= set(record):
        raise GradmeshError(
            f"checkpoint {rank_file(meta.checkpoint, 0)} records no layout (written by an older "
            "gradmesh): resume it with the layout that saved it"
        )
    specs, names = record["specs"], record["names"]
    sharded = record.get("dp_shards", {})
    parted = bool(record.get("optimizer_shards"))  # stage 1: each replica's part of the state
    replicas = workers // tp if sharded or parted else 1  # files read: every replica's, or one
    files = [first] + [read_rank(meta.checkpoint, r) for r in range(1, replicas * tp)]

    join = _joiner(specs, sharded, tp)

    def local_like(name: str, value: Any) -> bool:
        held = first["model"].get(name)
        return isinstance(value, torch.Tensor) and held is not None and value.shape == held.shape

    try:
        model = {k: join(k, [f["model"][k] for f in files]) for k in first["model"]}
        saved = first["optimizer"]
        state: dict[str, dict[str, Any]] = {}
        for index, holders in _holders(files, tp, parted).items():
            name = names[int(index)]
            entry = holders[0]["optimizer"]["state"][index]
            state[name] = {
                key: join(name, [f["optimizer"]["state"][index][key] for f in holders])
                if local_like(name, value)
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


def _joiner(
    specs: dict[str, Any], sharded: dict[str, Any], tp: int
) -> Callable[[str, list[Any]], Any]:
    """A function that puts a tensor back together from its pieces in rank order
    (replica-major, tp inner), as the layout `specs` and `sharded` record cut it."""

    def join(name: str, pieces: list[Any]) -> Any:
        if name in sharded:  # each tp slice is its replicas' shards, in order
            pieces = [torch.cat(pieces[t::tp]) for t in range(tp)]
        cut = _cut(specs, name)
        return pieces[0] if cut is None or tp == 1 else unshard(list(pieces[:tp]), *cut)

    return join


def whole_model(meta: Meta) -> dict[str, torch.Tensor]:
    """The whole model's state dict that `meta`'s checkpoint holds in parts, in any layout:
    each pipeline stage's tensors put together from its tp slices (and its replicas' shards
    where they are sharded), the stages' together (a weight two stages share: once). What an
    export writes; one line naming the file when it cannot."""
    workers, tp, pp, _ = saved_layout(meta)
    replicas = workers // (tp * pp)
    model: dict[str, torch.Tensor] = {}
    for stage in range(pp):
        first = read_rank(meta.checkpoint, stage * tp)
        record = first.get("layout")
        if not isinstance(record, dict) or "specs" not in record:
            raise GradmeshError(
                f"checkpoint {rank_file(meta.checkpoint, stage * tp)} records no layout "
                "(written by an older gradmesh)"
            )
        sharded = record.get("dp_shards", {})
        files = [
            read_rank(meta.checkpoint, (r * pp + stage) * tp + t) if (r, t) != (0, 0) else first
            for r in range(replicas if sharded else 1)
            for t in range(tp)
        ]
        join = _joiner(record["specs"], sharded, tp)
        try:
            for name in first["model"]:
                if name not in model:
                    model[name] = join(name, [f["model"][name] for f in files])
        except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as exc:
            raise GradmeshError(
                f"checkpoint {meta.checkpoint} cannot be put back together: {first_line(exc)}"
            ) from None
    return model


def _holders(files: list[Any], tp: int, parted: bool) -> dict[Any, list[Any]]:
    """The files that hold each optimizer entry (by its index), in tp order: every file, or at
    stage 1 the tp slices of the replica whose part of the state it is."""
    if not parted:
        return {index: files for index in files[0]["optimizer"]["state"]}
    found: dict[Any, list[Any]] = {}
    for r in range(len(files) // tp):
        for index in files[r * tp]["optimizer"]["state"]:
            found.setdefault(index, files[r * tp : (r + 1) * tp])
    return found


def rank_part(
    module: nn.Module, parts: int, index: int
) -> Callable[[str, torch.Tensor], torch.Tensor]:
    """A function that cuts a whole tensor of `module`'s state (by its state-dict name) to
    this rank's part, as `module` is cut: tp slice `index` of `parts` where the plan splits it,
    then its own rows where FSDP2 shards it."""
    specs = {n: [dim, list(chunks)] for n, (dim, chunks) in shard_specs(module).items()}
    sharded = dp_shards(module)

    def cut(name: str, value: torch.Tensor) -> torch.Tensor:
        spec = _cut(specs, name)
        if spec is not None and parts > 1:
            value = shard(value, spec[0], parts, index, spec[1])
        return rows(value, *sharded[name]) if name in sharded else value

    return cut


def part_for(
    whole: tuple[dict[str, torch.Tensor], dict[str, Any]],
    module: nn.Module,
    optimizer: Optimizer,
    parts: int,
    index: int,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This rank's model state dict and optimizer state dict, cut from `whole` as `module`
    (tp slice `index` of `parts`, then its own rows where FSDP2 shards it) is cut from the whole
    model: plain tensors, the shards of a sharded model's DTensors."""
    model, saved = whole
    part = rank_part(module, parts, index)

    def cut(name: str, value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or (
            name in model and value.shape != model[name].shape
        ):
            return value  # not shaped like its parameter (a step count): every rank's
        return part(name, value)

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


def load_model(module: nn.Module, saved: dict[str, torch.Tensor]) -> None:
    """`module.load_state_dict(saved)`, where a sharded parameter (a DTensor) takes its shard
    from `saved` as it was written (`to_local`)."""
    held = module.state_dict()
    if not any(hasattr(v, "to_local") for v in held.values()):
        module.load_state_dict(saved)
        return
    missing = sorted(set(held) ^ set(saved))
    if missing:
        raise GradmeshError(f"the state does not name the model's entries: {missing[0]!r}")
    with torch.no_grad():
        for name, target in held.items():
            local(target).copy_(saved[name])


def optimizer_state(optimizer: Optimizer, saved: dict[str, Any]) -> dict[str, Any]:
    """`saved` (an optimizer state dict as written: shards as plain tensors) with each shard of
    a sharded parameter's state made the DTensor the parameter is, for `load_state_dict`."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not any(hasattr(p, "to_local") for p in params):
        return saved
    from torch.distributed.tensor import DTensor

    state = {}
    for index, entry in saved["state"].items():
        p = params[int(index)]
        held = p.to_local() if hasattr(p, "to_local") else None
        state[index] = {
            key: DTensor.from_local(  # the parameter's global shape: shards may be uneven
                value,
                p.device_mesh,
                p.placements,
                run_check=False,
                shape=p.shape,
                stride=p.stride(),
            )
            if held is not None
            and isinstance(value, torch.Tensor)
            and value.shape == held.shape
            and value.dim() > 0
            else value
            for key, value in entry.items()
        }
    return {**saved, "state": state}


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
