"""gradmesh: distributed deep-learning training for PyTorch.

Horovod-style use from a script::

    import gradmesh
    gradmesh.init()
    gradmesh.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = gradmesh.DistributedOptimizer(opt, named_parameters=model.named_parameters())

The names come from `gradmesh.api`, loaded on first use, so that `gradmesh --help` and the
launcher start without importing torch (and the launcher can set torch's log level first).
Module paths that moved in 0.2 (and the layouts' modules, into a folder per parallelism) still
import, with a DeprecationWarning, until 0.3 (`MOVED`).
"""

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gradmesh.api import *  # noqa: F403

MOVED = {
    "gradmesh.axes": "gradmesh.runtime.mesh",
    "gradmesh.process": "gradmesh.runtime.process",
    "gradmesh.timeline": "gradmesh.observe.timeline",
    "gradmesh.metrics": "gradmesh.observe.metrics",
    "gradmesh.hogwild": "gradmesh.sync.hogwild",
    "gradmesh.local_sgd": "gradmesh.sync.local_sgd",
    "gradmesh.data_parallel": "gradmesh.sync.data_parallel",
    "gradmesh.parameter_server": "gradmesh.sync.parameter_server",
    "gradmesh.horovod_elastic": "gradmesh.horovod.elastic",
    "gradmesh.integrations": "gradmesh.launch.engines.choice",
    "gradmesh.integrations.ray": "gradmesh.launch.engines.ray",
    "gradmesh.integrations.spark": "gradmesh.launch.engines.spark",
    "gradmesh.layout.tensor_parallel": "gradmesh.layout.tensor.layers",
    "gradmesh.layout.tp_plan": "gradmesh.layout.tensor.plan",
    "gradmesh.layout.vocab_parallel": "gradmesh.layout.tensor.vocab",
    "gradmesh.layout.sequence_parallel": "gradmesh.layout.tensor.sequence",
    "gradmesh.layout.hybrid": "gradmesh.layout.tensor.hybrid",
    "gradmesh.layout.stage_engine": "gradmesh.layout.pipeline.engine",
    "gradmesh.layout.graph_routes": "gradmesh.layout.pipeline.routes",
    "gradmesh.layout.graph_pipeline": "gradmesh.layout.pipeline.stages",
    "gradmesh.layout.blocks": "gradmesh.models.blocks",
    "gradmesh.layout.sharded": "gradmesh.sync.sharded.model",
    "gradmesh.sync.data_parallel.zero": "gradmesh.sync.sharded.optimizer",
    "gradmesh.layout.planner": "gradmesh.planner",
}
"""Old module path -> new; a module under an old package path moved with it."""


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    if f"gradmesh.{name}" in sys.modules:  # a subpackage still being imported
        return sys.modules[f"gradmesh.{name}"]
    return getattr(importlib.import_module("gradmesh.api"), name)


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old module path as a copy of the new module's names, warning once."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        return importlib.machinery.ModuleSpec(name, self) if self._new(name) else None

    def _new(self, name: str) -> str | None:
        parent = name.rpartition(".")[0]
        if name in MOVED:
            return MOVED[name]
        return f"{MOVED[parent]}{name[len(parent) :]}" if parent in MOVED else None

    def exec_module(self, module: ModuleType) -> None:
        new = self._new(module.__name__) or ""
        warnings.warn(f"{module.__name__} is now {new}", DeprecationWarning, stacklevel=2)
        real = importlib.import_module(new)
        module.__dict__.update({k: v for k, v in vars(real).items() if not k.startswith("__")})
        module.__path__ = getattr(real, "__path__", [])


sys.meta_path.insert(0, _MovedModules())


from gradmesh.runtime.compat import check_at_import  # noqa: E402  (no torch: a version read)

check_at_import()
