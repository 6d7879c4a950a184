"""Options a `gradmesh train` run would not read, refused before launch in one line.

An option given for another strategy, optimizer, layout, dataset or output than the run's has
no effect, and its user believes it has one (`--warmup-epochs 2` without `--lr-scaling linear`
warms up nothing; `--sync-every 4` under allreduce syncs every step): it is a mistake, said
the moment the job is checked, never silently dropped. Each rule names the options one part of
the run reads and when it reads them; an option counts as given when its value is not its
default (`options.given`), so a TOML file's value is caught as a flag's is. A strategy or an
optimizer of the user's (registered by a plugin) may read anything: the built-in ones' rules
are not applied to them. No torch here: the launcher runs this before any worker.
"""

from __future__ import annotations

import dataclasses

from gradmesh.compression.config import READ_BY
from gradmesh.data.registry import is_token_dataset
from gradmesh.errors import GradmeshError
from gradmesh.options import refuse_others, refuse_unread
from gradmesh.registry import canonical_name
from gradmesh.sync.config import ParameterServerConfig
from gradmesh.train.config import TrainConfig

_ALLREDUCE = (
    "sync.allreduce.algorithm",
    "sync.allreduce.fusion_mb",
    "sync.allreduce.on_nonfinite",
)
_LOCAL = (
    "sync.local_sgd.sync_every",
    "sync.local_sgd.averaging_algorithm",
    "sync.local_sgd.warmup_sync_steps",
)
_OUTER = ("sync.local_sgd.outer_lr", "sync.local_sgd.outer_momentum")
STRATEGY_READS = {
    "allreduce": _ALLREDUCE,
    "local-sgd": _LOCAL,
    "diloco": (*_LOCAL, *_OUTER),
    "hogwild": ("sync.hogwild.lock",),
    "ps": tuple(f"sync.ps.{f.name}" for f in dataclasses.fields(ParameterServerConfig)),
}
"""Each built-in strategy's own options (`gradmesh.sync.strategies`); `--compression` and
`--zero-stage` have checks of their own (`SyncConfig.check`, `check_stage`)."""
_SCHEDULING = ("optimizer.lr_scaling", "optimizer.warmup_epochs", "optimizer.reference_batch")


def check_unread(config: TrainConfig) -> None:
    """One line naming the options `config` gives that its run would not read."""
    _check_strategy(config)
    _check_optimizer(config)
    _check_compression(config)
    _check_data(config)
    lay, out, replicas = config.layout, config.output, config.sync.replicas
    if lay.pipeline_parallel == 1:
        refuse_unread(
            config,
            ("layout.schedule", "layout.virtual_stages"),
            "options of a pipeline; this run has none (--pipeline-parallel 1)",
        )
    elif lay.schedule != "interleaved":
        refuse_unread(
            config,
            ("layout.virtual_stages",),
            f"the interleaved schedule's option; this run's is --schedule {lay.schedule}",
        )
    if lay.context_parallel == 1:
        refuse_unread(
            config,
            ("layout.context_attention",),
            "context parallelism's option; this run has none (--context-parallel 1)",
        )
    if not out.timeline:
        refuse_unread(
            config,
            ("output.timeline_per_rank", "output.timeline_steps"),
            "options of --timeline, which this run does not write",
        )
    if not config.checkpoint.dir:
        refuse_unread(
            config,
            ("checkpoint.keep", "checkpoint.asynchronous", "checkpoint.reshard"),
            "options of --checkpoint-dir, which this run does not have",
        )
    if not replicas.enabled:
        refuse_unread(
            config,
            tuple(f"sync.replicas.{f.name}" for f in dataclasses.fields(replicas)),
            "options of replica groups; this run is not in one (--replica-group)",
        )


def _check_strategy(config: TrainConfig) -> None:
    """The options of the strategies other than the run's; inside replica groups the run's
    own strategy is allreduce (across the groups: every step, or DiLoCo's rounds); at ZeRO 2
    and 3, FSDP2 reduce-scatters the gradients itself."""
    sync = config.sync
    if sync.strategy not in STRATEGY_READS:
        return
    reads = set(STRATEGY_READS[sync.strategy])
    how = f"--strategy {sync.strategy}"
    if sync.replicas.enabled:
        outer = {"sync.local_sgd.sync_every", *_OUTER} if sync.strategy == "diloco" else set()
        reads = {*_ALLREDUCE, *outer}
        how += " in replica groups"
    stage = sync.allreduce.zero_stage
    if stage >= 2:  # FSDP2's step stops at a non-finite gradient (`sharded.nonfinite`), no skip
        if sync.allreduce.on_nonfinite == "skip":
            raise GradmeshError(
                f"--on-nonfinite skip: not at --zero-stage {stage}, whose step on FSDP2's "
                "sharded gradients stops at a non-finite one (the default, error)"
            )
        reads -= {"sync.allreduce.algorithm", "sync.allreduce.fusion_mb"}
        how += f" at --zero-stage {stage} (FSDP2 reduces the gradients)"
    refuse_others(config, STRATEGY_READS, [sync.strategy], reads, how)


def _check_optimizer(config: TrainConfig) -> None:
    """A parameter server's workers never step an optimizer of their own: its servers update
    with --server-optimizer at --lr; SGD's momentum is no option of Adam's; the warm-up and the
    reference batch belong to the linear scaling rule."""
    opt, ps = config.optimizer, config.sync.ps
    if config.sync.strategy == "ps":
        refuse_unread(
            config,
            ("optimizer.name", *_SCHEDULING),
            "not read by --strategy ps: its servers update the parameters with "
            "--server-optimizer at --lr",
        )
        if ps.server_optimizer != "sgd":
            refuse_unread(
                config,
                ("optimizer.momentum",),
                f"SGD's option; this run's servers use --server-optimizer {ps.server_optimizer}",
            )
        if ps.server_optimizer == "adarevision":
            refuse_unread(
                config, ("optimizer.weight_decay",), "not read by --server-optimizer adarevision"
            )
        if ps.mode != "ssp":
            refuse_unread(
                config, ("sync.ps.max_staleness",), f"read by --mode ssp, not --mode {ps.mode}"
            )
        if ps.mode == "sync":
            refuse_unread(
                config,
                ("sync.ps.staleness_lr",),
                "--mode sync has no stale gradients to scale (--mode async or ssp)",
            )
        return
    if canonical_name(opt.name) in ("adam", "adamw"):
        refuse_unread(
            config, ("optimizer.momentum",), f"SGD's option, not --optimizer {opt.name}'s"
        )
    if opt.lr_scaling != "linear":
        refuse_unread(
            config,
            _SCHEDULING[1:],
            "options of --lr-scaling linear (the warm-up rises to the scaled rate); this run "
            f"keeps --lr (--lr-scaling {opt.lr_scaling})",
        )


def _check_compression(config: TrainConfig) -> None:
    """Each compressor's own setting, and error feedback, which needs one."""
    method = canonical_name(config.sync.compression.method)
    for dest, owner in READ_BY.items():
        if method != owner:
            refuse_unread(
                config,
                (f"sync.compression.{dest}",),
                f"--compression {owner}'s option, not --compression {method}'s",
            )
    if method == "none":
        refuse_unread(
            config,
            ("sync.compression.error_feedback",),
            "keeps what a compressor left out; this run has none (--compression none)",
        )


def _check_data(config: TrainConfig) -> None:
    """The synthetic dataset's options; the token datasets' sequence length and MFU peak."""
    data = config.data  # a factory of the user's takes none of them
    if data.dataset != "synthetic":
        refuse_unread(
            config,
            ("data.synthetic_shape", "data.synthetic_classes", "data.synthetic_samples"),
            f"options of --dataset synthetic, not of --dataset {data.dataset}",
        )
    if not is_token_dataset(data.dataset):
        refuse_unread(
            config,
            ("data.sequence_length", "output.peak_tflops"),
            f"options of token datasets (text, tokens:...), not of --dataset {data.dataset}",
        )
