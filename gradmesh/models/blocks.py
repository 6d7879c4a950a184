"""A model's blocks: the repeated units that pipelines cut between and activation
checkpointing recomputes (a GPT's `blocks.0`, `blocks.1`, ...; a sequence of layers' layers
with weights)."""

from __future__ import annotations

from torch import nn


def _container(model: nn.Module) -> str | None:
    """The model's list of blocks: its largest ModuleList or Sequential (by parameters)."""
    best, size = None, -1
    for name, module in model.named_modules():
        if name and isinstance(module, nn.ModuleList | nn.Sequential) and len(module) > 1:
            n = sum(p.numel() for p in module.parameters())
            if n > size:
                best, size = name, n
    return best


def block_list(model: nn.Module) -> list[str]:
    """The names of the model's blocks, in order: a sequence of layers' layers with weights, or
    the children of any other model's largest list of modules; empty when it has none."""
    if isinstance(model, nn.Sequential):
        return [n for n, m in model.named_children() if any(True for _ in m.parameters())]
    name = _container(model)
    if name is None:
        return []
    return [f"{name}.{child}" for child, _ in model.get_submodule(name).named_children()]
