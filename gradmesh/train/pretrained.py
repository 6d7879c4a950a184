"""A pretrained Hugging Face model's weights read into each rank's part (`--model hf:PATH`).

The model was built with its parameters on the meta device (`gradmesh.models.hf`), the layout
cut it (tensor slices, pipeline stages, FSDP2 shards), and only then does each rank make its
parameters for real and fill them: every tensor of its part is read from the memory-mapped
safetensors file, one at a time, and cut to the rank's slice as the layout cut the module
(`checkpoint.rank_part`, the cut a resharded checkpoint takes). A rank never holds more than
its part and one whole tensor. A pipeline is the exception: its stages are cut on the graph of
the whole model's forward (`gradmesh.layout.pipeline.graph`), so there every rank reads the
whole model before the cut, as a randomly initialised one is made whole there too.

`--init-from DIR` takes the same path for any model: the run's model is made with its
parameters on the meta device (`init_skeleton`) and named to read `DIR`'s weights, a model
directory `gradmesh export --format safetensors` wrote (its `config.json` must name the same
model and arguments). Only the weights: the optimizer starts afresh, at step 0.

A head tied to the embedding, absent from the files (`save_pretrained` writes a tied tensor
once), is read under the name it is tied to. Every tensor the model holds must be in the files
at the shape the config makes: otherwise one line names it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradmesh.errors import GradmeshError
from gradmesh.models.hf import empty_parameters, pretrained_source, weight_files
from gradmesh.sync.sharded.model import local
from gradmesh.train.checkpoint import rank_part
from gradmesh.train.checkpoint.files import complete

PREFIX = "net."


def file_name(name: str) -> str:
    """The tensor's name in a Hugging Face directory: gradmesh's wrapper's prefix taken off."""
    return name[len(PREFIX) :] if name.startswith(PREFIX) else name


def tied_names(module: nn.Module) -> dict[str, str]:
    """Each parameter name another name shares the tensor of: name -> the first name."""
    first: dict[int, str] = {}
    tied = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        tied[name] = first.setdefault(id(p), name)
    return {k: v for k, v in tied.items() if k != v}


def retie(module: nn.Module, tied: dict[str, str]) -> None:
    """Point each name of `tied` (`tied_names`) back at the parameter it shares: what loading
    a state dict with `assign=True` undoes."""
    for name, first in tied.items():
        parent, _, leaf = name.rpartition(".")
        setattr(module.get_submodule(parent), leaf, module.get_parameter(first))


def read_pretrained(module: nn.Module, directory: str, device: Any, tp: tuple[int, int]) -> int:
    """Make `module`'s meta parameters for real on `device` and fill them, and its other
    state, from `directory`'s safetensors, each cut to this rank's part (`tp` = (parts,
    index)); returns the tensors read."""
    from safetensors import safe_open

    where = weight_files(directory)
    kept = {n: b.detach().clone() for n, b in module.named_buffers() if not b.is_meta}
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)  # the same Parameter objects:
    try:  # ties, and the engine's and the pipeline's references, hold
        module.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)
    with torch.no_grad():
        for name, buffer in module.named_buffers():
            if name in kept:
                buffer.copy_(kept[name])
    cut = rank_part(module, *tp)
    tied = tied_names(module)
    renamed: dict[str, str] = getattr(module, "file_names", None) or {}  # model -> files

    def in_files(name: str) -> str:
        return renamed.get(file_name(name), file_name(name))

    read = 0
    with ExitStack() as files:
        opened: dict[Any, Any] = {}
        for name, target in module.state_dict().items():
            if name in kept:
                continue  # a buffer the model's own code made (rotary frequencies)
            key = in_files(name)
            if key not in where and name in tied:
                key = in_files(tied[name])
            if key not in where:
                raise GradmeshError(f"weights {directory}: no tensor {key} of the model")
            path = where[key]
            if path not in opened:
                opened[path] = files.enter_context(safe_open(str(path), framework="pt"))
            value = cut(name, opened[path].get_tensor(key))
            held = local(target)
            if value.shape != held.shape:
                raise GradmeshError(
                    f"weights {directory}: tensor {key} does not match the model: this rank's "
                    f"part is {tuple(value.shape)} in the weights, {tuple(held.shape)} in the model"
                )
            with torch.no_grad():
                held.copy_(value)
            read += 1
    return read


def init_skeleton(
    build: Callable[[], nn.Module], directory: str, model: str, model_args: str
) -> nn.Module:
    """The model `build()` makes, its parameters on the meta device, to read `directory`'s
    weights once the layout has cut it (`--init-from`); one line where the directory holds no
    weights or another model's."""
    if model.startswith("hf:"):
        raise GradmeshError(f"--init-from {directory}: model {model} reads its own weights")
    if complete(directory):
        raise GradmeshError(
            f"--init-from {directory}: that is a checkpoint directory; `gradmesh export "
            f"{directory} --to MODEL_DIR` makes the model directory --init-from reads"
        )
    weight_files(directory)
    config_file = Path(directory) / "config.json"
    if config_file.is_file():
        try:
            made = json.loads(config_file.read_text())
        except (OSError, ValueError) as exc:
            raise GradmeshError(
                f"--init-from {directory}: config.json is unreadable: {exc}"
            ) from None
        wrote = (made.get("gradmesh_model"), made.get("model_args", ""))
        if "gradmesh_model" in made and wrote != (model, model_args):
            raise GradmeshError(
                f"--init-from {directory}: its weights are model {wrote[0]} with arguments "
                f"{wrote[1]!r}, this run trains {model} with {model_args!r}"
            )
    with empty_parameters():
        skeleton: nn.Module = build()
    skeleton.pretrained = directory  # type: ignore[assignment]
    return skeleton


def needs_whole(model: nn.Module, pp: int) -> bool:
    """Whether a pretrained `model` must be read whole before the layout cuts it: in a
    pipeline (the module docstring)."""
    return pretrained_source(model) is not None and pp > 1


def read_whole(model: nn.Module, device: Any) -> None:
    """Read a pretrained `model`'s weights into it whole (on `device`)."""
    source = pretrained_source(model)
    if source is not None:
        read_pretrained(model, source, device, (1, 0))
