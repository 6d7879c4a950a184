"""fp8 training (`--precision fp8`): the linear layers of the model's blocks run their matrix
products in float8 (e4m3 forward, e5m2 for gradients, a scale per tensor computed each step),
everything else as `--precision bf16` (bf16 autocast; weights, gradients and the optimizer in
fp32).

Why torchao's float8 (`torchao.float8.convert_to_float8_training`) and not our own kernels: it
is PyTorch's kept fp8 training library (torchtitan's), its `Float8Linear` composes with FSDP2
and torch.compile, and the scaled matrix product is torch's own `_scaled_mm`. It is an extra
(`pip install 'gradmesh[fp8]'`), imported only when asked for.

Which layers: the `nn.Linear`s inside the model's blocks (`gradmesh.models.blocks`) whose sides
are both multiples of 16, the shape fp8's tensor-core products take. Embeddings, norms and the
output head keep bf16, as torchtitan leaves them. fp8 needs Hopper or Ada tensor cores (CUDA
capability 8.9 or more); `gradmesh train` refuses it elsewhere in one line, while a script may
convert a model on any device torchao runs on (its CPU path is what the tests use).
"""

from __future__ import annotations

from torch import nn

from gradmesh.errors import GradmeshError
from gradmesh.models.blocks import block_list
from gradmesh.models.quiet import torchao_quiet

MIN_CAPABILITY = (8, 9)
"""CUDA compute capability of the first tensor cores with fp8 (Ada, Hopper)."""
SIDE = 16


def fp8_problem() -> str | None:
    """Why `gradmesh train --precision fp8` cannot run on this machine; None where it can."""
    import torch

    if not torch.cuda.is_available():
        return "--precision fp8 needs an NVIDIA GPU with fp8 tensor cores (Hopper or Ada)"
    have = torch.cuda.get_device_capability()
    if have < MIN_CAPABILITY:
        name = torch.cuda.get_device_name()
        return (
            f"--precision fp8 needs CUDA capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or "
            f"more (Hopper, Ada); {name} has {have[0]}.{have[1]}: use --precision bf16"
        )
    return torchao_problem()


def torchao_problem() -> str | None:
    try:
        with torchao_quiet():
            import torchao.float8  # noqa: F401
    except ImportError:
        return "--precision fp8 needs torchao: pip install 'gradmesh[fp8]' (or torchao)"
    return None


def eligible(model: nn.Module) -> list[str]:
    """The names of the linear layers fp8 converts: inside a block, both sides multiples of 16."""
    prefixes = tuple(f"{b}." for b in block_list(model))
    return [
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear)
        and name.startswith(prefixes)
        and m.in_features % SIDE == 0
        and m.out_features % SIDE == 0
    ]


def to_float8(model: nn.Module) -> list[str]:
    """Swap the eligible linear layers of `model` for torchao's `Float8Linear`, in place;
    their names (one line when none is eligible, or torchao is missing)."""
    problem = torchao_problem()
    if problem:
        raise GradmeshError(problem)
    from torchao.float8 import convert_to_float8_training

    names = set(eligible(model))
    if not names:
        raise GradmeshError(
            "--precision fp8 found no linear layer to convert: it converts the linear layers "
            f"of the model's blocks whose sides are multiples of {SIDE}"
        )

    def chosen(module: nn.Module, fqn: str) -> bool:
        return fqn in names

    convert_to_float8_training(model, module_filter_fn=chosen)
    return sorted(names)
