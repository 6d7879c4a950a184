"""`--compile`: torch.compile of each of the model's blocks (or of the whole model where it has
none), in place, after the layout split it and before sharding, as torchtitan orders it.

Why per block and not the whole model: the blocks are alike, so one compiled graph serves them
all (compile time does not grow with depth), and the seams between blocks are where FSDP2's
gathers, recomputation and tensor-parallel exchanges sit. A pipeline's stages are graphs torch
has already traced and cut (`torch.distributed.pipelining`) and a hybrid plan swaps layers per
rank: `--compile` refuses both in one line.

The backend is inductor unless `GRADMESH_COMPILE_BACKEND` names another (`aot_eager`: the same
graphs through autograd without generated kernels, which is how the CPU tests check that
compilation composes with each layout in seconds).
"""

from __future__ import annotations

import os

from torch import nn

from gradmesh.models.blocks import block_list

BACKEND_ENV = "GRADMESH_COMPILE_BACKEND"


def compile_model(model: nn.Module) -> list[str]:
    """Compile `model`'s blocks in place (the whole model where it has no blocks); their
    names ('' for the whole model)."""
    backend = os.environ.get(BACKEND_ENV) or "inductor"
    names = block_list(model)
    if not names:
        model.compile(backend=backend)
        return [""]
    for name in names:
        model.get_submodule(name).compile(backend=backend)
    return names
