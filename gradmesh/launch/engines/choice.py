"""gradmesh on the engines teams already run their jobs on.

- Ray Train (`gradmesh.launch.engines.ray`): a gradmesh job, or a user's function, on Ray's
  `TorchTrainer`; `gradmesh.init()` joins the process group Ray formed.
- Spark (`gradmesh.launch.engines.spark`): the same through `pyspark`'s `TorchDistributor`, which
  runs torchrun (local mode) or barrier tasks that each run torchrun (cluster mode).
- Kubernetes needs no module: `gradmesh run` and `gradmesh train` read the variables Kubeflow's
  training operator or an Indexed Job sets (`gradmesh/launch/run.py`); manifests are in
  `deploy/kubernetes/`.

`gradmesh train --engine local|ray|spark` picks one; docs/engines.md says what each needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from gradmesh.errors import GradmeshError

if TYPE_CHECKING:
    from gradmesh.train.config import TrainConfig

ENGINES = {
    "local": None,
    "ray": ("ray.train.torch", "Ray Train"),
    "spark": ("pyspark.ml.torch.distributor", "pyspark"),
}
"""Engine -> (the module it needs, what to call it), None for gradmesh's own launcher."""


def check_engine(name: str) -> None:
    """A one-line error for an unknown engine or one whose extra is not installed."""
    if name not in ENGINES:
        raise GradmeshError(f"unknown engine {name!r} (valid: {', '.join(ENGINES)})")
    needed = ENGINES[name]
    if needed is None:
        return
    try:
        importlib.import_module(needed[0])
    except ImportError:
        raise GradmeshError(
            f"--engine {name} needs {needed[1]}: pip install 'gradmesh[{name}]'"
        ) from None


def entry_point(config: TrainConfig) -> tuple[str, int, dict[int, str]]:
    """What every rank of `config`'s job runs, whatever starts it: the module, how many ranks,
    and the roles of those that are more than a rank (a ps job's servers and workers)."""
    if config.sync.strategy != "ps":
        return "gradmesh.train.worker", config.job.workers, {}
    roles = {i: f"parameter server {i}" for i in range(config.sync.ps.servers)}
    roles.update({config.sync.ps.servers + i: f"ps worker {i}" for i in range(config.job.workers)})
    return "gradmesh.train.ps_node", config.sync.ps.servers + config.job.workers, roles


def train_on(config: TrainConfig) -> int:
    """Run `config`'s job on its engine (not local); the exit code."""
    check_engine(config.job.engine)
    engine = importlib.import_module(f"gradmesh.launch.engines.{config.job.engine}")
    return int(engine.train(config))


def failed_rank_line(text: str) -> str:
    """The line of an engine's error output that says which rank failed first and why:
    torchrun's root cause names the rank (its `gradmesh: rank R: ...` line says why, where it
    wrote one); else the last gradmesh line, else the first line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    ours = [line.removeprefix("gradmesh: ") for line in lines if line.startswith("gradmesh: rank ")]
    cause = _root_cause(lines)
    if cause is not None:
        rank, code = cause
        own = [line for line in ours if line.startswith(f"rank {rank}: ")]
        return own[-1] if own else f"rank {rank}: exited with {code}"
    if ours:
        return ours[-1]
    return lines[0] if lines else "failed"


def _root_cause(lines: list[str]) -> tuple[str, str] | None:
    """(rank, exit code) from torchrun's "Root Cause (first observed failure)" block."""
    try:
        start = next(i for i, line in enumerate(lines) if line.startswith("Root Cause"))
    except StopIteration:
        return None
    fields = dict(
        (key.strip(), value.strip())
        for key, _, value in (line.partition(":") for line in lines[start + 1 : start + 8])
    )
    if "rank" not in fields:
        return None
    return fields["rank"].split()[0], fields.get("exitcode", "an error")
