"""gradmesh on Spark through `pyspark.ml.torch.distributor.TorchDistributor` (the `spark` extra).

In local mode (a `local[N]` master, what `gradmesh train --engine spark` starts when no Spark
session is active) TorchDistributor runs torchrun on the driver with N processes; on a cluster
it starts barrier tasks, each of which runs torchrun on its executor. Either way every rank is a
torchrun worker, so gradmesh's own entry points run unchanged: `gradmesh.train.worker` (or a ps
job's `gradmesh.train.ps_node`) given as a file, and a user's function or script that
calls `gradmesh.init()`.
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import io
import sys
from typing import TYPE_CHECKING, Any, TextIO

from gradmesh.errors import GradmeshError
from gradmesh.launch.engines.choice import entry_point, failed_rank_line

if TYPE_CHECKING:
    from collections.abc import Callable

    from gradmesh.train.config import TrainConfig


def run(
    train_object: Callable[..., Any] | str,
    *args: Any,
    num_processes: int = 2,
    use_gpu: bool = False,
    local_mode: bool | None = None,
) -> Any:
    """Run `train_object` (a function, or the path of a Python file given `args` as its
    command line) on `num_processes` ranks; returns what rank 0's function returned.

    Uses the active Spark session, or starts a `local[num_processes]` one (driver bound to
    loopback, no UI) and stops it after. `local_mode` defaults to whether the master is local.
    A rank that fails ends the job with a GradmeshError naming it."""
    from pyspark.ml.torch.distributor import TorchDistributor
    from pyspark.sql import SparkSession

    session = SparkSession.getActiveSession()
    own = session is None
    if session is None:
        session = (
            SparkSession.builder.master(f"local[{num_processes}]")
            .appName("gradmesh")
            .config("spark.ui.enabled", "false")
            .config("spark.driver.host", "127.0.0.1")
            .config("spark.driver.bindAddress", "127.0.0.1")
            .getOrCreate()
        )
        session.sparkContext.setLogLevel("ERROR")
    if local_mode is None:
        local_mode = (session.sparkContext.master or "").startswith("local")
    distributor = TorchDistributor(
        num_processes=num_processes, local_mode=local_mode, use_gpu=use_gpu
    )
    # pyspark's torchrun wrapper exits 0 whatever torchrun returned (pyspark 4.3), so a failed
    # rank shows only in the output it streams to this process's stdout: keep a copy to read
    shown = _Tee(sys.stdout)
    try:
        with contextlib.redirect_stdout(shown):
            result = distributor.run(train_object, *args)
    except Exception as exc:  # TorchDistributor raises RuntimeError with torchrun's output
        raise GradmeshError(f"spark job failed: {failed_rank_line(str(exc))}") from None
    finally:
        if own:
            session.stop()
    if "Root Cause (first observed failure)" in shown.text():
        raise GradmeshError(f"spark job failed: {failed_rank_line(shown.text())}")
    return result


class _Tee(io.TextIOBase):
    """Writes through to `sink` and keeps the last lines written."""

    def __init__(self, sink: TextIO, keep: int = 400) -> None:
        self.sink, self.lines = sink, collections.deque[str](maxlen=keep)

    def write(self, text: str) -> int:
        self.sink.write(text)
        self.lines.extend(text.splitlines())
        return len(text)

    def flush(self) -> None:
        self.sink.flush()

    def text(self) -> str:
        return "\n".join(self.lines)


def train(config: TrainConfig) -> int:
    """`gradmesh train --engine spark`: the job's entry point as a file under TorchDistributor."""
    if config.checkpoint.max_restarts:
        raise GradmeshError(
            "--engine spark does not restart workers: use --max-restarts with --engine local or ray"
        )
    module, ranks, _roles = entry_point(config)
    path = importlib.import_module(module).__file__
    assert path is not None
    run(path, "--config", config.to_json(), num_processes=ranks)
    return 0
