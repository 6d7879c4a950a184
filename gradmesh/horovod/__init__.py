"""The Horovod PyTorch API on gradmesh: change `import horovod.torch as hvd` to
`import gradmesh.horovod as hvd` and run the script under `gradmesh run` (or torchrun)."""

from gradmesh.horovod.api import *  # noqa: F403
from gradmesh.horovod.api import __all__ as __all__
