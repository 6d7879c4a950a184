"""`--compile`: torch.compile of the model's blocks, or of the whole model where nothing sits at
the blocks' seams, in place, after the layout split it and before sharding, as torchtitan orders
it.

Per block where the seams carry something: FSDP2's gathers (ZeRO 2 and 3), recomputation and
tensor-parallel exchanges sit between blocks, and the data-parallel buckets reduce a block's
gradients while backward goes on through the blocks before it; the blocks are alike, so one
compiled graph serves them all (compile time does not grow with depth).

The whole model at a world of one without recomputation or sharding: there the seams carry
nothing, and each compiled call costs the host its wrappers (dynamo's guards, AOTAutograd's
forward and backward functions), 24 calls a step for a GPT of 12 blocks against 2. On this CPU,
with a GPT of 12 small blocks, the trainer's compiled step went from 1.229x to 1.088x the
compiled plain loop's (`gradmesh bench overhead --compile`, docs/overhead.md); a GPU whose step
is that short waits on the host the same way. The price is compile time, which grows with depth
there: about twice the blocks' for a GPT of 12 blocks (docs/overhead.md).

A pipeline's stages are graphs torch has already traced and cut (`torch.distributed.pipelining`)
and a hybrid plan swaps layers per rank: `--compile` refuses both in one line.

The backend is inductor unless `GRADMESH_COMPILE_BACKEND` names another (`aot_eager`: the same
graphs through autograd without generated kernels, which is how the CPU tests check that
compilation composes with each layout in seconds).
"""

from __future__ import annotations

import os

from torch import nn

from gradmesh.models.blocks import block_list

BACKEND_ENV = "GRADMESH_COMPILE_BACKEND"


def compile_model(model: nn.Module, whole: bool = False) -> list[str]:
    """Compile `model`'s blocks in place, or the whole model (`whole`, or where it has no
    blocks); their names ('' for the whole model)."""
    backend = os.environ.get(BACKEND_ENV) or "inductor"
    names = [] if whole else block_list(model)
    if not names:
        model.compile(backend=backend)
        return [""]
    for name in names:
        model.get_submodule(name).compile(backend=backend)
    return names
