"""The `gradmesh` command: `train` (the main job), `run` (the launcher), `emulate`, `plan`,
`simulate`, `report`, `export` and `bench NAME`.

Every command's flags are generated from the config dataclass its component owns
(`gradmesh.options`), so a default lives in one place; every choice list comes from a registry.
Errors are one line on stderr and a non-zero exit code, never a traceback.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module
from typing import Any, NamedTuple, NoReturn

from gradmesh.errors import GradmeshError
from gradmesh.launch.config import EmulateConfig, RunConfig
from gradmesh.options import add_flags, from_flags, from_toml, option
from gradmesh.train.config import TrainConfig, check_result_files

USAGE_ERROR = 2


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage mistake in one line."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(USAGE_ERROR)


def _cmd_train(config: TrainConfig, _command: list[str]) -> int:
    from gradmesh.launch.engines.choice import check_engine, entry_point, train_on
    from gradmesh.launch.run import LaunchSpec, cluster_defaults, launch
    from gradmesh.runtime.process import check_gpu_share
    from gradmesh.train.checks import check_train

    check_engine(config.job.engine)
    check_train(config)
    config.place_group_checkpoints()
    where = cluster_defaults()
    if where.get("min_nodes") is not None:
        config.check_elastic()
    config.check_outputs()
    module, nproc, roles = entry_point(config)  # a ps job's servers and workers alike
    worker = [sys.executable, "-m", module, "--config"]
    if config.job.engine == "local":  # its server before the checks below import torch
        from gradmesh.launch.forked import start_early

        start_early(worker, nproc)
    if config.layout.plan:  # placed per layer: checked, inlined, and tp taken from it
        from gradmesh.plan.command import resolve

        config = resolve(config)
    elif config.layout.split or config.layout.microbatches > 1 or config.data.user_code:
        from gradmesh.train.setup import check_layout

        check_layout(config)  # builds the model: the launcher imports torch only when needed
    if config.checkpoint.dir:
        from gradmesh.train.resume import check_resume

        check_resume(config)
    check_gpu_share(config.job.workers)  # the machine's limit after every flag's check
    if config.job.engine != "local":
        return train_on(config)
    worker.append(config.to_json())
    spec = LaunchSpec(
        **{"nproc": nproc, **where},
        timeout_s=config.job.timeout_s,
        passthrough_rank0=True,
        max_restarts=config.checkpoint.max_restarts,
        roles=roles,
    )
    return launch(spec, worker)


def _cmd_report(args: ReportConfig, _command: list[str]) -> int:
    from gradmesh.train.report import RunReport, read_json

    raw = read_json(args.run)
    if isinstance(raw, dict) and "traceEvents" in raw:  # a --timeline file
        from gradmesh.observe.timeline import trace_summary

        if args.plot:
            from gradmesh.observe.plot import timeline_plot

            timeline_plot(args.plot, raw, args.steps)
        print(trace_summary(raw))
        return 0
    report = RunReport.load(args.run, raw)
    if args.plot:
        from gradmesh.observe.plot import run_plot

        run_plot(args.plot, report)
    print(report.summary())
    return 0


def _cmd_plan(config: Any, command: list[str]) -> int:
    """`gradmesh plan`, or with `--memory` each rank's predicted bytes: the simulator's meta
    count (`gradmesh.simulate.memory`), which the planner's package does not import."""
    if config.memory:
        from gradmesh.plan.unread import check_memory
        from gradmesh.simulate.memory import run as memory

        check_memory(config)
        return memory(config)
    from gradmesh.plan.command import run

    return int(run(config, command))


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _cmd_emulate(config: EmulateConfig, command: list[str]) -> int:
    from gradmesh.launch.emulate import EmulatedCluster
    from gradmesh.launch.run import parse_nnodes

    if config.hosts is None:
        raise GradmeshError("--hosts is required")
    if not config.timeout > 0:
        raise GradmeshError(f"--timeout must be > 0, got {config.timeout}")
    min_hosts, hosts = parse_nnodes(config.nnodes) if config.nnodes else (None, config.hosts)
    if hosts != config.hosts:
        raise GradmeshError(f"--nnodes {config.nnodes}: MAX must be --hosts ({config.hosts})")
    cluster = EmulatedCluster(hosts=hosts, bandwidth=config.bandwidth, latency=config.latency)
    with cluster:
        procs, timeout = config.procs_per_host, config.timeout
        return cluster.run(command, procs_per_host=procs, timeout=timeout, min_hosts=min_hosts)


def _cmd_run(config: RunConfig, command: list[str]) -> int:
    from gradmesh.launch.run import LaunchSpec, cluster_env, launch, parse_nnodes
    from gradmesh.runtime.process import default_timeout_s

    env, kubernetes = cluster_env()
    nnodes = parse_nnodes(config.nnodes) if config.nnodes else None
    given: dict[str, Any] = {"nproc": config.np, "nnodes": nnodes, "node_rank": config.node_rank}
    given["master"] = config.master
    env["nnodes"] = (env.get("min_nodes"), env.get("nnodes"))
    flags = {"nproc": "-np", "nnodes": "--nnodes", "node_rank": "--node-rank", "master": "--master"}
    # a flag that contradicts what Kubernetes set for this pod is a mistake, not an override
    for key, source in kubernetes.items():
        if key in flags and given[key] is not None and given[key] != env[key]:
            shown = config.nnodes if key == "nnodes" else given[key]
            raise GradmeshError(f"{flags[key]} {shown} contradicts {source}")
    nproc = config.np if config.np is not None else env.get("nproc")
    if nproc is None:
        raise GradmeshError("-np is required (worker processes on this host)")
    min_nodes, most = nnodes or (env.get("min_nodes"), env["nnodes"][1] or 1)
    spec = LaunchSpec(
        nproc=nproc,
        nnodes=most,
        min_nodes=min_nodes,
        node_rank=config.node_rank if config.node_rank is not None else env.get("node_rank", 0),
        master=config.master or env.get("master"),
        iface=config.iface or env.get("iface"),
        timeout_s=config.timeout if config.timeout is not None else default_timeout_s(),
        max_restarts=config.max_restarts,
    )
    return launch(spec, command)


@dataclass
class ReportConfig:
    """gradmesh report: print (and plot) a finished run's report or timeline."""

    run: str = option("", "the run's JSON report or merged timeline", positional=True)
    plot: str | None = option(
        None,
        "write a report's loss curve and per-rank step times, or a timeline's last steps per "
        "process and thread, here (PNG)",
    )
    steps: int = option(3, "steps of a timeline to plot")


class Command(NamedTuple):
    """A subcommand: its help, its options' dataclass and what runs it (`module:name` strings
    are imported when the parser is built or the command runs, so `gradmesh --help` needs no
    torch)."""

    help: str
    config: type | str
    handler: Callable[[Any, list[str]], int] | str
    takes_command: bool = False
    interruptible: bool = False
    """SIGTERM ends it as Ctrl-C does (emulated hosts and probes tear themselves down)."""


COMMANDS = {
    "run": Command(
        "start workers on this host: gradmesh run -np N -- CMD ...", RunConfig, _cmd_run, True
    ),
    "train": Command(
        "train a model (default: a CNN on digits, 2 workers)", TrainConfig, _cmd_train
    ),
    "emulate": Command(
        "run a command on emulated hosts: gradmesh emulate --hosts H -- CMD ...",
        EmulateConfig,
        _cmd_emulate,
        True,
        True,
    ),
    "plan": Command(
        "choose data or tensor parallelism per layer from measured costs (--memory: the bytes)",
        "gradmesh.plan.command:PlanConfig",
        _cmd_plan,
        interruptible=True,
    ),
    "simulate": Command(
        "predict step time and scaling on 8..1024 GPUs from the cost model",
        "gradmesh.simulate.command:SimulateConfig",
        "gradmesh.simulate.command:run",
    ),
    "report": Command(
        "print a finished run's report (--json) or timeline (--timeline)", ReportConfig, _cmd_report
    ),
    "lighthouse": Command(
        "decide each step's quorum of replica groups (gradmesh train --replica-group)",
        "gradmesh.sync.replicas.lighthouse:LighthouseConfig",
        "gradmesh.sync.replicas.lighthouse:run",
        interruptible=True,
    ),
    "export": Command(
        "write a checkpoint, from any layout, as a model directory (Hugging Face or safetensors)",
        "gradmesh.train.config:ExportConfig",
        "gradmesh.train.export:run",
    ),
}
"""Command name -> what it is; `bench NAME` comes from `BENCHES`."""

BENCHES = {  # each module has Config (its options) and run(config)
    "allreduce": (
        "every allreduce algorithm, interleaved, with the cost model",
        "gradmesh.bench.allreduce",
    ),
    "dataparallel": (
        "gradmesh's DistributedOptimizer against torch DDP, interleaved",
        "gradmesh.bench.dataparallel",
    ),
    "horovod-synthetic": (
        "Horovod's synthetic benchmark: the drop-in against gradmesh's API and DDP, img/s",
        "gradmesh.bench.horovod_synthetic",
    ),
    "hogwild": (
        "Hogwild! samples/s and accuracy, 1..N workers, lock-free and locked",
        "gradmesh.bench.hogwild",
    ),
    "ps": (
        "parameter servers 1..S against ring allreduce, on emulated hosts",
        "gradmesh.bench.ps",
    ),
    "memory": (
        "activation checkpointing's peak activation bytes and step time, per worker",
        "gradmesh.bench.memory",
    ),
    "tp-styles": (
        "gradmesh's tensor-parallel layers against torch's DTensor styles, on the GPT's MLPs",
        "gradmesh.bench.tp_styles",
    ),
    "layout": (
        "one model data-parallel, tensor-parallel and pipelined over the same ranks",
        "gradmesh.bench.layout",
    ),
    "compression": (
        "every compressor over a slow link: bytes, step time, time to accuracy, torch's hook",
        "gradmesh.bench.compression",
    ),
    "checkpoint": (
        "checkpoint size, training stall (sync and async) and restart-to-first-step time",
        "gradmesh.bench.checkpoint",
    ),
    "link": (
        "native allreduce over emulated hosts, as a fraction of the link",
        "gradmesh.bench.link",
    ),
    "observe": (
        "the default job's step time with and without --tensorboard and --timeline",
        "gradmesh.bench.observe",
    ),
    "overhead": (
        "the trainer's step against a plain PyTorch loop: same model, batch, precision, optimizer",
        "gradmesh.bench.overhead",
    ),
    "scaling": (
        "each strategy at 1, 2, 4 emulated hosts: efficiency, overhead, the simulator's prediction",
        "gradmesh.bench.scaling",
    ),
    "diloco": (
        "DiLoCo against synchronous data parallelism on emulated hosts behind slow links: bytes "
        "a step, wall-clock to the same loss, the loss after the same tokens",
        "gradmesh.bench.diloco",
    ),
    "replicas": (
        "replica groups whose average across groups goes through each compressor, on emulated "
        "hosts: bytes a step, step time, the loss after the same steps",
        "gradmesh.bench.replicas",
    ),
    "loader": (
        "tokens/s the token-file loader feeds one rank from one core, against the GPT's training",
        "gradmesh.bench.loader",
    ),
    "plan": (
        "the hybrid planner's plan against data, tensor parallelism and the rule: measured "
        "next to predicted",
        "gradmesh.bench.plan",
    ),
}
"""Benchmark name -> (one-line help, module with `Config` and `run(config)`)."""


def _load(spec: Any) -> Any:
    if not isinstance(spec, str):
        return spec
    module, _, name = spec.partition(":")
    return getattr(import_module(module), name)


def _add_command(sub: Any, name: str, command: Command, table: str, flags: bool = True) -> None:
    parser = sub.add_parser(name, help=command.help)
    parser.add_argument("--config", metavar="TOML", help=f"read options from [{table}] first")
    if flags:
        add_flags(parser, _load(command.config))
    parser.set_defaults(command_spec=command, table=table)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The command line's parser. Given the arguments, only the command they name gets its
    options (the others are listed by name and help): building every command's options imports
    every command's module, and with them torch and the benchmarks, which cost a `gradmesh
    train` launcher a second before it starts a worker."""
    words = [a for a in (argv or []) if not a.startswith("-")]
    wanted = (
        words[:2] if argv is not None and words[:1] and words[0] in {*COMMANDS, "bench"} else []
    )
    parser = _Parser(prog="gradmesh", description="Distributed deep-learning training for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, command in COMMANDS.items():
        _add_command(sub, name, command, name, not wanted or wanted[0] == name)
    bench = sub.add_parser("bench", help="measure: gradmesh bench NAME --help")
    benches = bench.add_subparsers(dest="bench", required=True, parser_class=_Parser)
    for name, (summary, module) in BENCHES.items():
        spec = Command(summary, f"{module}:Config", f"{module}:run", interruptible=True)
        full = not wanted or wanted == ["bench", name]
        _add_command(benches, name, spec, f"bench.{name}", full)
    return parser


def _config(args: argparse.Namespace) -> Any:
    """The command's defaults, then its table of the TOML file, then the flags."""
    cls = _load(args.command_spec.config)
    base = from_toml(cls, args.config, args.table) if args.config else cls()
    return from_flags(cls, args, base)


def main(argv: list[str] | None = None) -> int:
    from gradmesh.launch.logs import quiet_cpp_logs

    quiet_cpp_logs()
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1 :]
    args = build_parser(argv).parse_args(argv)
    spec: Command = args.command_spec
    if command and not spec.takes_command:
        print(f"gradmesh {args.command}: error: unexpected arguments after --", file=sys.stderr)
        return USAGE_ERROR
    if spec.interruptible:
        signal.signal(signal.SIGTERM, _interrupt)
    try:
        config = _config(args)
        check_result_files(config)
        return int(_load(spec.handler)(config, command))
    except GradmeshError as exc:
        print(f"gradmesh {args.command}: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        print(f"gradmesh {args.command}: interrupted", file=sys.stderr)
        return 130


def program() -> int:
    """The `gradmesh` command (and `python -m gradmesh.cli`): `main` in a process of its own,
    whose launcher may fork gradmesh's workers from a server of its own
    (`gradmesh.launch.forked`), which `main` called inside another program does not."""
    from gradmesh.launch import forked

    forked.PROGRAM = True
    return main()


if __name__ == "__main__":
    sys.exit(program())
