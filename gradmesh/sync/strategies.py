"""Strategies by name: how replicas agree; the training loop exists once (`gradmesh.train`).

A strategy prepares this rank's part of the model and the optimizer built over it (broadcasts,
wrappers) and adds what it knows to the report; the trainer steps the same way for all of them.
Replicas are the ranks of the mesh's `dp` axis: under tensor or pipeline parallelism a strategy
averages each part of the model with the ranks holding the same part, never with the world.
Each is built from its own options in `SyncConfig` (with the layout's micro-batches and the
job's timeout, the two things it needs from outside the sync layer).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn
from torch.optim import Optimizer

from gradmesh.collectives import allreduce
from gradmesh.compression.base import Compressor
from gradmesh.compression.config import CompressionConfig
from gradmesh.compression.registry import make
from gradmesh.errors import GradmeshError
from gradmesh.registry import Registry
from gradmesh.runtime.mesh import EXPERT_PLACED
from gradmesh.runtime.world import Runtime, collective_device
from gradmesh.sync.config import SyncConfig
from gradmesh.sync.data_parallel.optimizer import DistributedOptimizer, broadcast_parameters
from gradmesh.sync.hogwild import HogwildOptimizer, SharedModel, share_model
from gradmesh.sync.local_sgd import Averager, LocalSGDOptimizer
from gradmesh.sync.parameter_server.roles import worker_role
from gradmesh.sync.parameter_server.worker import PSWorker
from gradmesh.sync.sharded.nonfinite import NonfiniteWatch, watch_nonfinite


class Strategy(Protocol):
    """What a strategy does around the one training loop."""

    def prepare(self, model: nn.Module, optimizer: Optimizer, rt: Runtime) -> Optimizer:
        """Make every rank start from the same state; return the optimizer the loop steps."""
        ...

    def shard(self, rt: Runtime) -> tuple[int, int]:
        """(index, count): which slice of each global batch this process trains on."""
        ...

    def finish(self, samples: int, wall_s: float) -> None:
        """After the last step, before evaluation: bring the final model here."""
        ...

    def writes_report(self, rt: Runtime) -> bool:
        """Whether this process prints and writes the run report."""
        ...

    def report(self) -> dict[str, Any]:
        """Strategy-specific entries for the run report."""
        ...

    def place(self, rt: Runtime) -> tuple[int, int, int]:
        """(rank, world, writer): this process's part in a checkpoint, the number of parts, and
        the part whose process writes the metadata."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """What this rank's strategy keeps between steps (compressor residuals, counters), for
        a checkpoint: tensors, numbers, strings and containers of them only."""
        ...

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Restore `state_dict()`'s output (after `prepare`); a GradmeshError if it does not fit."""
        ...


def compressor(config: CompressionConfig) -> Compressor:
    """The compressor `config` asks for, with its settings."""
    return make(config.method, config.ratio, config.rank, config.error_feedback)


class _Defaults:
    """What most strategies do: one data shard per rank, nothing to finish, rank 0 reports."""

    def shard(self, rt: Runtime) -> tuple[int, int]:
        return rt.batch.index, rt.batch.size

    def finish(self, samples: int, wall_s: float) -> None:
        pass

    def writes_report(self, rt: Runtime) -> bool:
        return rt.rank == 0

    def place(self, rt: Runtime) -> tuple[int, int, int]:
        return rt.rank, rt.size, 0

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        pass


StrategyFactory = Callable[[SyncConfig, int, float], "Strategy"]
"""factory(sync options, micro-batches per step, timeout in seconds) -> a strategy."""
STRATEGIES: Registry[StrategyFactory] = Registry("strategy")


def broadcast_replica(model: nn.Module, rt: Runtime) -> None:
    """This part of the model as the first replica holds it, on every replica (this rank's
    experts as the first rank holding the same experts holds them)."""
    placed = {n for n, p in model.named_parameters() if getattr(p, EXPERT_PLACED, False)}
    state = model.state_dict()
    shared = {k: v for k, v in state.items() if k not in placed}
    broadcast_parameters(shared, root_rank=rt.dp.rank_at(0), group=rt.dp.group)
    if placed and rt.mesh.experts.size > 1:
        mine = {k: v for k, v in state.items() if k in placed}
        experts = rt.mesh.experts
        broadcast_parameters(mine, root_rank=experts.rank_at(0), group=experts.group)


@STRATEGIES.register("allreduce")
class AllreduceStrategy(_Defaults):
    """Synchronous data parallelism: rank 0's initial weights everywhere, gradients averaged."""

    def __init__(self, config: SyncConfig, microbatches: int, timeout_s: float) -> None:
        self.config = config
        self.microbatches = microbatches
        self.timeout_s = timeout_s
        self.optimizer: Optimizer | None = None
        self.sharded = False
        self.watch: NonfiniteWatch | None = None

    def prepare(self, model: nn.Module, optimizer: Optimizer, rt: Runtime) -> Optimizer:
        from torch.distributed.fsdp import FSDPModule

        if isinstance(model, FSDPModule):  # zero stages 2 and 3: FSDP2 reduce-scatters the
            self.sharded = True  # gradients itself (gradmesh.sync.sharded.model)
            stage = self.config.allreduce.zero_stage
            self.watch = watch_nonfinite(model, optimizer, rt.rank, stage)
            return optimizer
        broadcast_replica(model, rt)
        self.optimizer = DistributedOptimizer(
            optimizer,
            named_parameters=model.named_parameters(),
            allreduce=self.config.allreduce.algorithm,
            fusion_mb=self.config.allreduce.fusion_mb,
            compression=compressor(self.config.compression),
            on_nonfinite="skip" if self.config.allreduce.on_nonfinite == "skip" else "error",
            # one backward per micro-batch before the step: a pipeline stage's, or an elastic
            # job's gradient accumulation when it has fewer replicas than it started with
            backward_passes_per_step=self.microbatches,
        )
        return self.optimizer

    def state_dict(self) -> dict[str, Any]:
        if self.sharded:  # FSDP2 keeps no state between steps beyond the optimizer's
            assert self.watch is not None
            self.watch.read(", found before a checkpoint")
            return {}
        assert self.optimizer is not None
        return self.optimizer._gm.state_dict()  # type: ignore[attr-defined,no-any-return]

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        if self.sharded:
            return
        assert self.optimizer is not None
        self.optimizer._gm.load_state_dict(saved)  # type: ignore[attr-defined]

    def report(self) -> dict[str, Any]:
        skipped = self.optimizer._gm.skipped_steps if self.optimizer is not None else 0  # type: ignore[attr-defined]
        return {
            "allreduce": "fsdp2 reduce-scatter"
            if self.sharded
            else self.config.allreduce.algorithm,
            "zero_stage": self.config.allreduce.zero_stage,
            "compression": compressor(self.config.compression).describe(),
            "skipped_steps": skipped,
        }


@STRATEGIES.register("local-sgd")
class LocalSGDStrategy(_Defaults):
    """K local steps, then parameter averaging; synchronous for the first T steps if asked."""

    outer = False
    """Whether the average goes through DiLoCo's outer optimizer."""

    def __init__(self, config: SyncConfig, microbatches: int, timeout_s: float) -> None:
        self.config = config
        self.microbatches = microbatches
        self.timeout_s = timeout_s
        self.averager: Averager | None = None

    def prepare(self, model: nn.Module, optimizer: Optimizer, rt: Runtime) -> Optimizer:
        broadcast_replica(model, rt)
        params = [p for p in model.parameters() if p.requires_grad]
        local = self.config.local_sgd
        self.averager = Averager(
            params,
            local.sync_every,
            local.warmup_sync_steps,
            local.averaging_algorithm,
            compressor=compressor(self.config.compression),
            outer_lr=local.outer_lr if self.outer else None,
            outer_momentum=local.outer_momentum,
        )
        return LocalSGDOptimizer(optimizer, self.averager)

    def state_dict(self) -> dict[str, Any]:
        assert self.averager is not None
        return self.averager.state_dict()

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        assert self.averager is not None
        self.averager.load_state_dict(saved)

    def report(self) -> dict[str, Any]:
        rounds = self.averager.averaging_rounds if self.averager else 0
        return {
            "sync_every": self.config.local_sgd.sync_every,
            "warmup_sync_steps": self.config.local_sgd.warmup_sync_steps,
            "averaging_algorithm": self.config.local_sgd.averaging_algorithm,
            "averaging_rounds": rounds,
            "compression": compressor(self.config.compression).describe(),
            **self._outer_report(),
        }

    def _outer_report(self) -> dict[str, Any]:
        return {}


@STRATEGIES.register("diloco")
class DiLoCoStrategy(LocalSGDStrategy):
    """DiLoCo: H inner steps (`--sync-every`) with the run's optimizer, then the replicas' mean
    outer gradient (start minus end parameters, compressed by `--compression`) applied by an
    outer Nesterov SGD (`--outer-lr`, `--outer-momentum`)."""

    outer = True

    def _outer_report(self) -> dict[str, Any]:
        local = self.config.local_sgd
        return {"outer_lr": local.outer_lr, "outer_momentum": local.outer_momentum}


@STRATEGIES.register("hogwild")
class HogwildStrategy(_Defaults):
    """Lock-free updates of one model in this host's shared memory (`--lock` serialises them)."""

    def __init__(self, config: SyncConfig, microbatches: int, timeout_s: float) -> None:
        self.config = config
        self.microbatches = microbatches
        self.timeout_s = timeout_s
        self.shared: SharedModel | None = None

    def prepare(self, model: nn.Module, optimizer: Optimizer, rt: Runtime) -> Optimizer:
        self.shared = share_model(model, lock=self.config.hogwild.lock)
        return HogwildOptimizer(optimizer, self.shared)

    def report(self) -> dict[str, Any]:
        """Collective: the updates every worker applied, summed."""
        assert self.shared is not None
        updates = torch.tensor(
            [float(self.shared.updates)], dtype=torch.float64, device=collective_device()
        )
        allreduce(updates, op="sum")
        return {
            "lock": self.config.hogwild.lock,
            "updates_applied": int(updates[0]),
            "shared_bytes": self.shared.nbytes,
        }


@STRATEGIES.register("ps")
class ParameterServerStrategy:
    """A worker of a parameter-server job: pull parameters, push gradients; the servers update."""

    def __init__(self, config: SyncConfig, microbatches: int, timeout_s: float) -> None:
        self.config = config
        self.microbatches = microbatches
        self.timeout_s = timeout_s
        self.worker: PSWorker | None = None

    def prepare(self, model: nn.Module, optimizer: Optimizer, rt: Runtime) -> Optimizer:
        role = worker_role()
        if role is None:
            raise GradmeshError(
                "strategy ps needs its servers: start it with gradmesh train --strategy ps"
            )
        self.worker = PSWorker(
            role,
            self.config.ps.servers,
            self.config.ps.push_every,
            self.config.ps.pull_every,
            self.timeout_s,
            compressor(self.config.compression),
        )
        return self.worker.attach(model, optimizer)

    def shard(self, rt: Runtime) -> tuple[int, int]:
        assert self.worker is not None
        return self.worker.role.index, self.worker.role.workers

    def finish(self, samples: int, wall_s: float) -> None:
        assert self.worker is not None
        self.worker.finish(samples, wall_s)

    def writes_report(self, rt: Runtime) -> bool:
        return self.worker is not None and self.worker.reporter

    def place(self, rt: Runtime) -> tuple[int, int, int]:
        """Servers are parts 0..S-1 (they write their shards), workers S..S+W-1; the first
        worker writes the metadata."""
        assert self.worker is not None
        servers = self.config.ps.servers
        return servers + self.worker.role.index, servers + self.worker.role.workers, servers

    def state_dict(self) -> dict[str, Any]:
        """This worker's counters; the first worker also has every server write its shard's
        part of the same checkpoint (sync mode: they stand at this step until it pushes)."""
        assert self.worker is not None and self.worker.client is not None
        if self.worker.role.index == 0:
            self.worker.client.save()
        return self.worker.state_dict()

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        assert self.worker is not None
        self.worker.load_state_dict(saved)

    def report(self) -> dict[str, Any]:
        assert self.worker is not None
        return {
            "mode": self.config.ps.mode,
            "max_staleness": self.config.ps.max_staleness,
            "staleness_lr": self.config.ps.staleness_lr,
            "server_optimizer": self.config.ps.server_optimizer,
            "compression": compressor(self.config.compression).describe(),
            **self.worker.report(),
        }
