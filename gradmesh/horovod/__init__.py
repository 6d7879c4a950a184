"""The Horovod PyTorch API on gradmesh: change `import horovod.torch as hvd` to
`import gradmesh.horovod as hvd` and run the script under `gradmesh run` (or torchrun)."""

from gradmesh.horovod import api, compression, elastic, gathers, process_sets, reductions
from gradmesh.horovod.api import *  # noqa: F403
from gradmesh.horovod.compression import *  # noqa: F403
from gradmesh.horovod.gathers import *  # noqa: F403
from gradmesh.horovod.process_sets import *  # noqa: F403
from gradmesh.horovod.reductions import *  # noqa: F403

__all__ = [
    "elastic",
    *api.__all__,
    *compression.__all__,
    *gathers.__all__,
    *process_sets.__all__,
    *reductions.__all__,
]
