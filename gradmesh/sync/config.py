"""Each sync strategy's options, and `SyncConfig`, which picks a strategy and holds them all.
No torch here: the CLI builds its flags from this."""

from __future__ import annotations

from dataclasses import dataclass

from gradmesh.compression.config import CompressionConfig
from gradmesh.errors import GradmeshError
from gradmesh.options import component, option

MODES = ("sync", "async", "ssp")
"""Parameter-server modes: synchronous, Downpour's asynchronous, bounded staleness."""
SERVER_OPTIMIZERS = ("sgd", "adagrad", "adam", "adarevision")
"""The updates a parameter server applies to its shard."""
ON_NONFINITE = ("error", "skip")
SPLIT_LAYOUTS = ("allreduce", "local-sgd", "diloco")
"""The strategies that carry a model split by tensor or pipeline parallelism (the others need
the whole model on every worker)."""


@dataclass
class AllreduceConfig:
    """Allreduce: synchronous data parallelism, gradients averaged every step."""

    algorithm: str = option(
        "native", "allreduce algorithm for gradient averaging", flag="--allreduce", name=True
    )
    fusion_mb: float = option(
        25.0, "gradient fusion bucket size in MiB (torch DDP's bucket_cap_mb default)"
    )
    on_nonfinite: str = option(
        "error", "NaN/Inf in gradients: error, or skip the step", choices=ON_NONFINITE
    )
    zero_stage: int = option(
        0,
        "sharded data parallelism (ZeRO): 1 shards the optimizer state over the replicas, 2 "
        "also the gradients, 3 also the parameters; 0 off",
    )

    def check(self) -> None:
        if self.fusion_mb <= 0:
            raise GradmeshError(f"--fusion-mb must be > 0, got {self.fusion_mb}")


@dataclass
class LocalSGDConfig:
    """Local SGD: K local steps between parameter averages; DiLoCo: the same, the average moved
    by an outer Nesterov SGD."""

    sync_every: int = option(8, "local-sgd: local steps between parameter averages (K)")
    averaging_algorithm: str = option(
        "native", "local-sgd: allreduce algorithm for averaging", name=True
    )
    warmup_sync_steps: int = option(0, "local-sgd: synchronous steps before going local (T)")
    outer_lr: float = option(
        0.7,
        "diloco: the outer Nesterov SGD's learning rate (DiLoCo's 0.7; 1 with momentum 0 is "
        "local SGD)",
    )
    outer_momentum: float = option(0.9, "diloco: the outer SGD's Nesterov momentum")

    def check(self) -> None:
        if self.sync_every < 1 or self.warmup_sync_steps < 0:
            raise GradmeshError("--sync-every must be >= 1 and --warmup-sync-steps >= 0")
        if self.outer_lr <= 0 or not 0 <= self.outer_momentum < 1:
            raise GradmeshError(
                f"--outer-lr must be > 0 and --outer-momentum in [0, 1), got {self.outer_lr} "
                f"and {self.outer_momentum}"
            )


@dataclass
class HogwildConfig:
    """Hogwild!: lock-free updates of one model in shared memory."""

    lock: bool = option(False, "hogwild: serialise the shared-memory updates with a lock")


@dataclass
class ParameterServerConfig:
    """Parameter servers: sharded servers own the parameters; workers pull and push."""

    servers: int = option(1, "ps: parameter-server processes")
    mode: str = option(
        "async", "ps: sync, async (Downpour) or ssp (bounded staleness)", choices=MODES
    )
    max_staleness: int = option(2, "ps --mode ssp: most clocks a worker may run ahead (K)")
    push_every: int = option(1, "ps: push the accumulated gradient every n steps")
    pull_every: int = option(1, "ps: pull the parameters every m steps")
    staleness_lr: bool = option(False, "ps: divide each gradient's step by its staleness")
    server_optimizer: str = option(
        "sgd", "ps: sgd (with --momentum), adagrad, adam, adarevision", choices=SERVER_OPTIMIZERS
    )
    lost_after_s: float = option(10.0, "ps: a worker silent this long is declared lost")

    def check(self) -> None:
        if min(self.servers, self.push_every, self.pull_every) < 1 or self.max_staleness < 0:
            raise GradmeshError(
                "--servers, --push-every and --pull-every must be >= 1, --max-staleness >= 0"
            )
        if self.mode == "sync" and (self.push_every, self.pull_every) != (1, 1):
            raise GradmeshError("--mode sync pushes and pulls every step: drop --push/pull-every")
        if self.lost_after_s <= 0:
            raise GradmeshError(f"--lost-after-s must be > 0, got {self.lost_after_s}")


ON_LOST_REPLICA = ("keep", "rescale")


@dataclass
class ReplicaConfig:
    """Replica groups: this job is one of R groups whose gradients are averaged over the groups
    alive each step (`gradmesh lighthouse` decides which)."""

    replica_group: int = option(-1, "this job's replica group, 0..R-1 (-1: not in replica groups)")
    replica_groups: int = option(1, "replica groups in the whole job (R)")
    lighthouse: str = option("", "host:port of the lighthouse that decides each step's quorum")
    on_lost_replica: str = option(
        "keep",
        "a step with fewer groups: keep the global batch (split over the groups alive) or "
        "rescale (each group keeps its slice; the batch shrinks)",
        choices=ON_LOST_REPLICA,
    )
    quorum_timeout_s: float = option(
        10.0, "seconds a collective across groups waits before the step is taken again"
    )

    @property
    def enabled(self) -> bool:
        return self.replica_group >= 0

    def check(self) -> None:
        if not self.enabled:
            return
        if not self.replica_group < self.replica_groups:
            raise GradmeshError(
                f"--replica-group must be in 0..{self.replica_groups - 1} (--replica-groups "
                f"{self.replica_groups}), got {self.replica_group}"
            )
        host, _, port = self.lighthouse.rpartition(":")
        if not host or not port.isdigit():
            raise GradmeshError(
                f"--replica-group needs --lighthouse HOST:PORT, got {self.lighthouse!r}"
            )
        if self.quorum_timeout_s <= 0:
            raise GradmeshError(f"--quorum-timeout-s must be > 0, got {self.quorum_timeout_s}")


@dataclass
class SyncConfig:
    """Strategy: how the replicas agree."""

    strategy: str = option("allreduce", "how workers cooperate (a registered strategy)", name=True)
    allreduce: AllreduceConfig = component(AllreduceConfig)
    local_sgd: LocalSGDConfig = component(LocalSGDConfig)
    hogwild: HogwildConfig = component(HogwildConfig)
    ps: ParameterServerConfig = component(ParameterServerConfig)
    compression: CompressionConfig = component(CompressionConfig)
    replicas: ReplicaConfig = component(ReplicaConfig)

    def check(self) -> None:
        """One line for values no strategy can use (names are the registries' to check)."""
        self.replicas.check()
        self.allreduce.check()
        self.local_sgd.check()
        self.ps.check()
        self.compression.check()
        if self.compression.method != "none" and self.strategy == "hogwild":
            raise GradmeshError("hogwild shares memory: it sends nothing to compress")


ZERO_STAGES = (0, 1, 2, 3)
"""Sharded data parallelism (`gradmesh.sync.sharded`): 0 off, 1 optimizer state, 2 and
gradients, 3 and parameters."""


def check_stage(
    stage: int,
    pp: int,
    strategy: str,
    compression: str,
    plan: bool = False,
    tensorboard: bool = False,
) -> None:
    """One line unless sharded data parallelism at `stage` can run with these settings (the
    ZeRO stages' one check; `gradmesh.sync.sharded` runs them)."""
    if stage not in ZERO_STAGES:
        raise GradmeshError(f"--zero-stage {stage}: valid stages are 0 (off), 1, 2, 3")
    if not stage:
        return
    if plan:
        raise GradmeshError(f"--zero-stage {stage} with --plan is not supported yet")
    if stage >= 2 and tensorboard:
        raise GradmeshError(
            f"--zero-stage {stage} with --tensorboard is not supported yet (its per-epoch "
            "accuracy scores a copy of the whole model, which no rank holds)"
        )
    if strategy != "allreduce":
        raise GradmeshError(
            f"--zero-stage {stage} shards the state of synchronous data parallelism; strategy "
            f"{strategy} keeps its own copies (use --strategy allreduce)"
        )
    if pp > 1 and stage > 1:
        raise GradmeshError(
            f"--zero-stage {stage} with --pipeline-parallel is not supported: FSDP2 gathers a "
            "module's parameters around its own forward, which a pipeline stage traced on the "
            "model's graph never calls (--zero-stage 1 shards the optimizer's state in a pipeline)"
        )
    if compression != "none" and stage > 1:  # stage 1 averages with gradmesh's own reducer
        raise GradmeshError(
            f"--zero-stage {stage} reduce-scatters gradients with FSDP2's own collectives; "
            "--compression applies to gradmesh's allreduce (--zero-stage 0 or 1)"
        )
