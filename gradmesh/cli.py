"""The `gradmesh` command: `run` (the launcher) and `train` (the main job).

Every choice list comes from a registry and every `train` flag from a `TrainConfig` field.
Errors are one line on stderr and a non-zero exit code, never a traceback.
"""

from __future__ import annotations

import argparse
import signal
import sys
from importlib import import_module
from typing import NoReturn

from gradmesh.errors import GradmeshError
from gradmesh.options import add_flags, from_flags
from gradmesh.train.config import TrainConfig

USAGE_ERROR = 2


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage mistake in one line."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(USAGE_ERROR)


def _train_config(args: argparse.Namespace) -> TrainConfig:
    """Defaults, then the TOML file, then the flags: every value checked against its type."""
    config = TrainConfig.from_toml(args.config) if args.config else TrainConfig()
    return from_flags(TrainConfig, args, config)


def _cmd_train(args: argparse.Namespace, _command: list[str]) -> int:
    from gradmesh.launch.engines.choice import check_engine
    from gradmesh.launch.run import LaunchSpec, cluster_defaults, launch
    from gradmesh.train.checks import check_train

    config = _train_config(args)
    check_engine(config.job.engine)
    check_train(config)
    where = cluster_defaults()
    if where.get("min_nodes") is not None:
        config.check_elastic()
    config.check_outputs()
    if config.layout.plan:  # placed per layer: checked, inlined, and tp taken from it
        from gradmesh.plan.command import resolve

        config = resolve(config)
    elif config.layout.split or config.layout.microbatches > 1:
        from gradmesh.train.trainer import check_layout

        check_layout(config)  # builds the model: the launcher imports torch only when needed
    if config.checkpoint.dir:
        from gradmesh.train.trainer import check_resume

        check_resume(config)
    from gradmesh.launch.engines.choice import entry_point, train_on

    if config.job.engine != "local":
        return train_on(config)
    module, nproc, roles = entry_point(config)  # a ps job's servers and workers alike
    worker = [sys.executable, "-m", module, "--config", config.to_json()]
    spec = LaunchSpec(
        **{"nproc": nproc, **where},
        timeout_s=config.job.timeout_s,
        passthrough_rank0=True,
        max_restarts=config.checkpoint.max_restarts,
        roles=roles,
    )
    return launch(spec, worker)


BENCHES = {
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
    "scaling": (
        "each strategy at 1, 2, 4 emulated hosts: efficiency, overhead, the simulator's prediction",
        "gradmesh.bench.scaling",
    ),
    "plan": (
        "the hybrid planner's plan against data, tensor parallelism and the rule: measured "
        "next to predicted",
        "gradmesh.bench.plan",
    ),
}
"""Benchmark name -> (one-line help, module with add_arguments(parser) and run(args))."""


def _cmd_bench(args: argparse.Namespace, _command: list[str]) -> int:
    signal.signal(signal.SIGTERM, _interrupt)  # a bench on emulated hosts tears them down too
    return int(import_module(args.bench_module).run(args))


def _cmd_plan(args: argparse.Namespace, _command: list[str]) -> int:
    signal.signal(signal.SIGTERM, _interrupt)  # a probe on emulated hosts tears them down too
    return int(import_module("gradmesh.plan.command").run(args))


def _cmd_simulate(args: argparse.Namespace, _command: list[str]) -> int:
    return int(import_module("gradmesh.simulate.model").run(args))


def _cmd_report(args: argparse.Namespace, _command: list[str]) -> int:
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


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _cmd_emulate(args: argparse.Namespace, command: list[str]) -> int:
    from gradmesh.launch.emulate import EmulatedCluster
    from gradmesh.launch.run import parse_nnodes

    signal.signal(signal.SIGTERM, _interrupt)  # tear the namespaces down on SIGTERM too
    min_hosts, hosts = parse_nnodes(args.nnodes) if args.nnodes else (None, args.hosts)
    if hosts != args.hosts:
        raise GradmeshError(f"--nnodes {args.nnodes}: MAX must be --hosts ({args.hosts})")
    with EmulatedCluster(hosts=args.hosts, bandwidth=args.bandwidth, latency=args.latency) as c:
        return c.run(
            command, procs_per_host=args.procs_per_host, timeout=args.timeout, min_hosts=min_hosts
        )


def _cmd_run(args: argparse.Namespace, command: list[str]) -> int:
    from gradmesh.launch.run import LaunchSpec, cluster_env, launch, parse_nnodes

    min_nodes, nnodes = parse_nnodes(args.nnodes)
    # a flag that contradicts what Kubernetes set for this pod is a mistake, not an override
    given = {"nproc": args.np, "nnodes": (min_nodes, nnodes), "node_rank": args.node_rank}
    given["master"] = args.master
    env, kubernetes = cluster_env()
    env["nnodes"] = (env.get("min_nodes"), env.get("nnodes"))
    flags = {"nproc": "-np", "nnodes": "--nnodes", "node_rank": "--node-rank", "master": "--master"}
    for key, source in kubernetes.items():
        if key in flags and given[key] != env[key]:
            shown = args.nnodes if key == "nnodes" else given[key]
            raise GradmeshError(f"{flags[key]} {shown} contradicts {source}")
    spec = LaunchSpec(
        nproc=args.np,
        nnodes=nnodes,
        min_nodes=min_nodes if min_nodes is not None else getattr(args, "min_nodes", None),
        node_rank=args.node_rank,
        master=args.master,
        iface=args.iface,
        timeout_s=args.timeout,
        max_restarts=args.max_restarts,
    )
    return launch(spec, command)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="gradmesh", description="Distributed deep-learning training for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    from gradmesh.launch.run import cluster_defaults
    from gradmesh.runtime.process import default_timeout_s

    on_cluster = cluster_defaults()  # gradmesh emulate's host, or a Kubernetes pod
    run = sub.add_parser("run", help="start workers on this host: gradmesh run -np N -- CMD ...")
    run.add_argument(
        "-np",
        type=int,
        required="nproc" not in on_cluster,
        default=on_cluster.get("nproc"),
        help="worker processes on this host",
    )
    run.add_argument(
        "--nnodes",
        default="1",
        help="hosts in the job: N, or MIN:MAX for an elastic job that goes on with fewer "
        "hosts after one is lost (default: 1)",
    )
    run.add_argument("--node-rank", type=int, default=0, help="index of this host (default: 0)")
    run.add_argument("--master", help="HOST[:PORT] of host 0 (default: a free loopback port)")
    run.add_argument("--iface", help="network interface for Gloo/NCCL traffic (multi-host)")
    run.add_argument(
        "--timeout",
        type=float,
        default=default_timeout_s(),
        help="rendezvous and collective timeout, s (default: GRADMESH_TIMEOUT_S or 60)",
    )
    run.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart every worker up to N times after a failure (default: 0)",
    )
    run.set_defaults(handler=_cmd_run, **{k: v for k, v in on_cluster.items() if k != "nproc"})
    train = sub.add_parser("train", help="train a model (default: a CNN on digits, 2 workers)")
    train.add_argument("--config", metavar="TOML", help="read options from a TOML file first")
    add_flags(train, TrainConfig)
    train.set_defaults(handler=_cmd_train)
    emulate = sub.add_parser(
        "emulate", help="run a command on emulated hosts: gradmesh emulate --hosts H -- CMD ..."
    )
    emulate.add_argument("--hosts", type=int, required=True, help="emulated hosts")
    emulate.add_argument("--procs-per-host", type=int, default=1, help="workers per host")
    emulate.add_argument("--bandwidth", default="1gbit", help="link rate per host (default: 1gbit)")
    emulate.add_argument("--latency", help="added one-way latency, like 1ms (needs netem)")
    emulate.add_argument("--timeout", type=float, default=600.0, help="end the job after S seconds")
    emulate.add_argument(
        "--nnodes", help="MIN:MAX (MAX = --hosts): an elastic job that goes on with MIN hosts"
    )
    emulate.set_defaults(handler=_cmd_emulate)
    plan = sub.add_parser(
        "plan", help="choose data or tensor parallelism per layer from measured costs"
    )
    import_module("gradmesh.plan.command").add_arguments(plan)
    plan.set_defaults(handler=_cmd_plan)
    simulate = sub.add_parser(
        "simulate", help="predict step time and scaling on 8..1024 GPUs from the cost model"
    )
    import_module("gradmesh.simulate.model").add_arguments(simulate)
    simulate.set_defaults(handler=_cmd_simulate)
    report = sub.add_parser(
        "report", help="print a finished run's report (--json) or timeline (--timeline)"
    )
    report.add_argument("run", help="the run's JSON report or merged timeline")
    report.add_argument(
        "--plot",
        help="write a report's loss curve and per-rank step times, or a timeline's last "
        "steps per process and thread, here (PNG)",
    )
    report.add_argument(
        "--steps", type=int, default=3, help="steps of a timeline to plot (default 3)"
    )
    report.set_defaults(handler=_cmd_report)
    bench = sub.add_parser("bench", help="measure: gradmesh bench NAME --help")
    benches = bench.add_subparsers(dest="bench", required=True, parser_class=_Parser)
    for name, (summary, module) in BENCHES.items():
        one = benches.add_parser(name, help=summary)
        import_module(module).add_arguments(one)
        one.set_defaults(handler=_cmd_bench, bench_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    from gradmesh.launch.logs import quiet_cpp_logs

    quiet_cpp_logs()
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1 :]
    try:  # the parser's defaults come from the environment, which can be wrong
        parser = build_parser()
    except GradmeshError as exc:
        print(f"gradmesh: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    args = parser.parse_args(argv)
    if args.command not in ("run", "emulate") and command:
        print(f"gradmesh {args.command}: error: unexpected arguments after --", file=sys.stderr)
        return USAGE_ERROR
    try:
        return int(args.handler(args, command))
    except GradmeshError as exc:
        print(f"gradmesh {args.command}: error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        print(f"gradmesh {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
