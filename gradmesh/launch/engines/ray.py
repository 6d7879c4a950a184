"""gradmesh on Ray Train's `TorchTrainer` (the `ray` extra).

Ray starts one worker actor per rank, sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR and MASTER_PORT, and forms a Gloo process group (env://) before the training
function runs; `gradmesh.init()` then joins that group instead of forming its own, and the
job's store (timelines, a ps job's token) is the TCPStore Ray's rank 0 serves. Gloo is told the
interface that holds the address Ray chose (GLOO_SOCKET_IFNAME), as Ray's users are advised to
on hosts with several interfaces, unless the caller set one.

`gradmesh train --engine ray` runs the job's own entry point on every worker; `run(fn, ...)`
runs a user's function. A local Ray instance is started (and shut down after) when none is
connected; a worker that dies ends the job with a GradmeshError naming its rank.
"""

from __future__ import annotations

import logging
import os
import re
from typing import TYPE_CHECKING, Any

from gradmesh.errors import GradmeshError
from gradmesh.launch.engines.choice import entry_point, failed_rank_line

if TYPE_CHECKING:
    from collections.abc import Callable

    from gradmesh.train.config import TrainConfig

PASSED_ENV = ("GRADMESH_", "GLOO_", "NCCL_", "OMP_NUM_THREADS")
"""Variables of the caller's environment that Ray's workers get too (Ray's workers are
started by its raylet, not by the caller)."""


class _Result:
    """Holds rank 0's return value for the driver (a Ray actor of no CPU: Train v2 keeps
    reported metrics only with a checkpoint)."""

    def __init__(self) -> None:
        self.value: Any = None

    def put(self, value: Any) -> None:
        self.value = value

    def get(self) -> Any:
        return self.value


def _call(payload: dict[str, Any]) -> None:
    """Every Ray worker: run the function, hand rank 0's result to the driver."""
    import ray
    import ray.train

    result = payload["fn"](*payload["args"])
    if ray.train.get_context().get_world_rank() == 0:
        ray.get(payload["result"].put.remote(result))


def run(
    fn: Callable[..., Any],
    *args: Any,
    workers: int = 2,
    use_gpu: bool = False,
    timeout_s: float = 60.0,
    max_restarts: int = 0,
) -> Any:
    """Run `fn(*args)` on `workers` Ray workers, each a rank of one job (fn calls
    `gradmesh.init()`); returns rank 0's return value (it must pickle)."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    own = not ray.is_initialized()
    env = {k: v for k, v in os.environ.items() if k.startswith(PASSED_ENV)}
    env["RAY_TRAIN_ENABLE_PRINT_PATCH"] = "0"  # its patched print showed every line twice
    if own:
        # one CPU per worker, the driver reserving none: 2 workers fit on 2 cores
        cpus = max(workers, os.cpu_count() or 1)
        ray.init(num_cpus=cpus, include_dashboard=False, logging_level=logging.ERROR)
    try:
        if "GLOO_SOCKET_IFNAME" not in env:
            from gradmesh.runtime.process import interface_of

            iface = interface_of(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
            if iface is not None:
                env["GLOO_SOCKET_IFNAME"] = iface
        actor: Any = ray.remote(num_cpus=0)(_Result)
        holder = actor.remote()
        trainer = TorchTrainer(
            _call,
            train_loop_config={"fn": fn, "args": args, "result": holder},
            scaling_config=ScalingConfig(
                num_workers=workers, use_gpu=use_gpu, resources_per_worker={"CPU": 1}
            ),
            torch_config=TorchConfig(
                backend="nccl" if use_gpu else "gloo", timeout_s=int(timeout_s)
            ),
            run_config=RunConfig(  # type: ignore[call-arg]  # Train v2's RunConfig
                failure_config=FailureConfig(max_failures=max_restarts),
                worker_runtime_env={"env_vars": env},
            ),
        )
        try:
            result = trainer.fit()
        except Exception as exc:  # Ray's TrainingFailedError / WorkerGroupError
            raise GradmeshError(f"ray job failed: {_failure(exc)}") from None
        if result.error is not None:
            raise GradmeshError(f"ray job failed: {failed_rank_line(str(result.error))}")
        return ray.get(holder.get.remote())
    finally:
        if own:
            ray.shutdown()


class RankFailed(RuntimeError):
    """A rank's entry point returned a non-zero exit code (it printed why)."""

    def __init__(self, code: int) -> None:
        super().__init__(f"exited with code {code}")
        self.code = code


def _failure(exc: BaseException) -> str:
    """Which rank failed first and how, from Ray's error: a rank that stopped because a peer
    failed (PEER_FAILED_EXIT) is named only when no other is."""
    from gradmesh.errors import PEER_FAILED_EXIT

    failures: dict[int, BaseException] = getattr(exc, "worker_failures", None) or {}
    if not failures:
        return failed_rank_line(str(exc))
    first = {
        rank: e
        for rank, e in failures.items()
        if not (isinstance(e, RankFailed) and e.code == PEER_FAILED_EXIT)
    }
    rank, error = min((first or failures).items())
    text = str(error)
    if "health check failed" in text:  # the actor's process is gone (killed, crashed)
        pid = re.search(r"pid=(\d+)", text)
        return f"rank {rank}: its Ray worker died" + (f" (pid {pid.group(1)})" if pid else "")
    return f"rank {rank}: {failed_rank_line(text)}"


def _train_rank(module: str, config_json: str) -> int:
    """One rank of `gradmesh train --engine ray`: the entry point `gradmesh train` would run."""
    import importlib

    code = int(importlib.import_module(module).main(["--config", config_json]) or 0)
    if code:
        raise RankFailed(code)
    return code


def train(config: TrainConfig) -> int:
    """`gradmesh train --engine ray`."""
    module, ranks, _roles = entry_point(config)
    return int(
        run(
            _train_rank,
            module,
            config.to_json(),
            workers=ranks,
            timeout_s=config.job.timeout_s,
            max_restarts=config.checkpoint.max_restarts,
        )
    )  # rank 0's exit code, through the same channel a script's function returns by
