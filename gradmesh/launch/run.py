"""`gradmesh run`: start N workers per host through PyTorch's elastic agent (torch.distributed.run).

We do not spawn processes ourselves: the elastic agent starts, watches and stops the workers,
and rendezvous is torchrun's static TCP rendezvous on the master's address. What this module
adds is the user-facing part: input checks with one-line errors, a free port on a single host,
rank-prefixed output, the failing rank's exit code, and the interface variables for multi-host.

`gradmesh run -np 4 --nnodes 2 --node-rank I --master HOST:PORT --iface eth0 -- python train.py`
is the same job as
`torchrun --nproc-per-node 4 --nnodes 2 --node-rank I --master-addr HOST --master-port PORT
train.py` with GLOO_SOCKET_IFNAME=eth0 NCCL_SOCKET_IFNAME=eth0 exported.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import signal
import socket
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any

from gradmesh.errors import PEER_FAILED_EXIT, GradmeshError, first_line
from gradmesh.launch.forked import LauncherEnvironment, forkable, run_module, start_server
from gradmesh.launch.logs import CPP_LOG_ENV, WORKER_CPP_LOG_ENV
from gradmesh.launch.ports import check_port_free, free_port, wait_for_master
from gradmesh.runtime import bound
from gradmesh.runtime.bound import LAUNCHER_PID_ENV
from gradmesh.runtime.process import MAX_WORLD_ENV, TIMEOUT_ENV

DEFAULT_PORT = 29500
PYTHON_NAMES = ("python", "python3", f"python{sys.version_info.major}.{sys.version_info.minor}")


@dataclass
class LaunchSpec:
    """How many workers to start here and how to find the rest of the job."""

    nproc: int
    """Worker processes on this host."""
    nnodes: int = 1
    """Hosts in the job."""
    node_rank: int = 0
    """Index of this host, 0 .. nnodes-1; host 0 runs the rendezvous store."""
    master: str | None = None
    """HOST[:PORT] of host 0; on a single host a free loopback port is chosen when absent."""
    iface: str | None = None
    """Network interface the backends use (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME)."""
    timeout_s: float = 60.0
    """Rendezvous and collective timeout, in seconds."""
    passthrough_rank0: bool = False
    """Give global rank 0 the terminal itself (unprefixed), for a live progress bar."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for the workers."""
    max_restarts: int = 0
    """Times the elastic agent restarts every worker of this host after a failure."""
    min_nodes: int | None = None
    """Elastic (`--nnodes MIN:MAX`): the fewest hosts the job runs on, `nnodes` being the most;
    hosts are then ranked by the rendezvous, and `node_rank` 0 only says who serves its store.
    None: exactly `nnodes` hosts, ranked by `node_rank`."""
    roles: dict[int, str] = field(default_factory=dict)
    """What a rank is, where it is more than a rank (`parameter server 0`): failures say it."""

    @property
    def elastic(self) -> bool:
        return self.min_nodes is not None


def parse_nnodes(text: str) -> tuple[int | None, int]:
    """`--nnodes N` (a fixed number of hosts) or `MIN:MAX` (elastic): (MIN or None, MAX)."""
    low, colon, high = str(text).partition(":")
    try:
        values = [int(low), int(high)] if colon else [int(low)]
    except ValueError:
        raise GradmeshError(f"bad --nnodes {text!r}: expected N or MIN:MAX") from None
    if min(values) < 1:
        raise GradmeshError(f"bad --nnodes {text!r}: host counts must be >= 1")
    if colon and values[0] > values[1]:
        raise GradmeshError(f"bad --nnodes {text!r}: MIN {values[0]} is more than MAX {values[1]}")
    return (values[0] if colon else None), values[-1]


KUBEFLOW_ENV = {
    "nnodes": "PET_NNODES",
    "nproc": "PET_NPROC_PER_NODE",
    "node_rank": "PET_NODE_RANK",
}
"""What Kubeflow's training operator (PyTorchJob, TrainJob) sets for torchrun in every pod; the
master is PET_MASTER_ADDR and PET_MASTER_PORT."""
INDEX_ENV = "JOB_COMPLETION_INDEX"
"""A Kubernetes Indexed Job's pod index: this host's rank where nothing else gives one."""


def cluster_defaults() -> dict[str, Any]:
    """Where this host sits in a multi-host job (see `cluster_env`); empty when nothing says."""
    return cluster_env()[0]


def cluster_env() -> tuple[dict[str, Any], dict[str, str]]:
    """Where this host sits in a multi-host job: from the GRADMESH_* variables that
    `gradmesh emulate` (or a cluster script) sets, the PET_* variables Kubeflow sets, and an
    Indexed Job's JOB_COMPLETION_INDEX; two that disagree are a one-line error naming both.
    Also, for each setting Kubernetes gave, `VAR=value`: a flag of `gradmesh run` that
    contradicts it is an error, not a silent override."""
    from gradmesh.launch.emulate import CLUSTER_ENV

    given: dict[str, list[tuple[str, str]]] = {}
    for key, var in CLUSTER_ENV.items():
        if os.environ.get(var):
            given.setdefault(key, []).append((var, os.environ[var]))
    for key, var in KUBEFLOW_ENV.items():
        if os.environ.get(var):
            given.setdefault(key, []).append((var, os.environ[var]))
    addr, port = os.environ.get("PET_MASTER_ADDR"), os.environ.get("PET_MASTER_PORT")
    if addr:
        pair = f"{addr}:{port}" if port else addr
        given.setdefault("master", []).append(("PET_MASTER_ADDR/PORT", pair))
    if os.environ.get(INDEX_ENV) and "node_rank" not in given:
        given["node_rank"] = [(INDEX_ENV, os.environ[INDEX_ENV])]
    found: dict[str, Any] = {}
    kube: dict[str, str] = {}
    for key, values in given.items():
        (var, raw), *others = values
        value = _cluster_value(key, var, raw)
        for other, their_raw in others:
            if _cluster_value(key, other, their_raw) != value:
                raise GradmeshError(f"{var}={raw} and {other}={their_raw} disagree: set one")
        if key == "nnodes":
            found["min_nodes"], found["nnodes"] = value
        else:
            found[key] = value
        for source, raw in values:
            if not source.startswith("GRADMESH_"):
                kube[key] = f"{source}={raw}"
    return found, kube


def _cluster_value(key: str, var: str, raw: str) -> Any:
    if key == "nnodes":
        return parse_nnodes(raw)
    if key in ("master", "iface"):
        return raw
    if key == "nproc" and raw in ("auto", "cpu", "gpu"):  # torchrun's words
        gpus = len([d for d in os.listdir("/dev") if d.removeprefix("nvidia").isdigit()])
        return gpus if raw == "gpu" or (raw == "auto" and gpus) else (os.cpu_count() or 1)
    try:
        return int(raw)
    except ValueError:
        raise GradmeshError(f"environment variable {var}={raw!r} is not an integer") from None


def parse_master(master: str | None, nnodes: int) -> tuple[str, int]:
    """(host, port) of the rendezvous; a free loopback port for a single host without --master."""
    if master is None:
        if nnodes > 1:
            raise GradmeshError("--master HOST[:PORT] is required when --nnodes > 1")
        return "127.0.0.1", free_port()
    host, _, port_text = master.rpartition(":") if ":" in master else (master, "", "")
    if not port_text:
        return master, DEFAULT_PORT if nnodes > 1 else free_port()
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise GradmeshError(f"bad --master {master!r}: the port must be a number in 1..65535")
    return host, int(port_text)


def resolve_command(command: list[str]) -> list[str]:
    """Check the worker command exists; `python` means this interpreter."""
    if not command:
        raise GradmeshError("no command to run: put it after --, like: -- python train.py")
    program, *args = command
    if program in PYTHON_NAMES:
        program = sys.executable
        script = next((a for a in args if not a.startswith("-")), None)
        if args and not args[0].startswith("-") and script and not os.path.isfile(script):
            raise GradmeshError(f"script {script} does not exist")
    elif shutil.which(program) is None:
        raise GradmeshError(f"command {program!r} not found")
    return [program, *args]


def _check(spec: LaunchSpec) -> None:
    if spec.nproc < 1:
        raise GradmeshError(f"-np must be >= 1, got {spec.nproc}")
    if spec.nnodes < 1 or not 0 <= spec.node_rank < spec.nnodes:
        raise GradmeshError(f"--node-rank {spec.node_rank} is not in 0..{spec.nnodes - 1}")
    if spec.timeout_s <= 0:
        raise GradmeshError(f"--timeout must be > 0, got {spec.timeout_s}")
    if spec.max_restarts < 0:
        raise GradmeshError(f"--max-restarts must be >= 0, got {spec.max_restarts}")
    if spec.min_nodes is not None and not 1 <= spec.min_nodes <= spec.nnodes:
        raise GradmeshError(f"--nnodes {spec.min_nodes}:{spec.nnodes}: MIN must be in 1..MAX")
    if spec.elastic and spec.nnodes == 1:
        raise GradmeshError("--nnodes MIN:MAX is for jobs over several hosts: MAX must be > 1")
    names = [name for _, name in socket.if_nameindex()]
    if spec.iface is not None and spec.iface not in names:  # else each rank's Gloo says so
        raise GradmeshError(
            f"--iface {spec.iface}: no such network interface here (this host has "
            f"{', '.join(names)})"
        )


def _worker_env(spec: LaunchSpec, host: str) -> dict[str, str]:
    cpp_level = os.environ.get(WORKER_CPP_LOG_ENV, os.environ.get(CPP_LOG_ENV, "WARNING"))
    from gradmesh.launch.emulate import JOB_TOKEN_ENV

    env = {
        TIMEOUT_ENV: str(spec.timeout_s),
        CPP_LOG_ENV: cpp_level,
        LAUNCHER_PID_ENV: str(os.getpid()),  # workers end when this process does
        **spec.env,
    }
    env.setdefault(JOB_TOKEN_ENV, os.environ.get(JOB_TOKEN_ENV) or secrets.token_hex(16))
    if spec.elastic:
        env[MAX_WORLD_ENV] = str(spec.nproc * spec.nnodes)
    threads = max(1, (os.cpu_count() or 1) // spec.nproc)
    env.setdefault("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", str(threads)))
    iface = spec.iface or ("lo" if host in ("127.0.0.1", "localhost") else None)
    if iface:
        env["GLOO_SOCKET_IFNAME"] = iface
        env["NCCL_SOCKET_IFNAME"] = iface
    return env


def own_address(master: str, port: int) -> str:
    """This host's address on the route to the master (no packet is sent): how the hosts of an
    elastic job name themselves to each other."""
    family = socket.getaddrinfo(master, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family[0], socket.SOCK_DGRAM) as s:
        s.connect(family[4])
        return str(s.getsockname()[0])


def _quiet_agent() -> None:
    """Silence the elastic agent's own log lines: we print one line of our own per outcome."""
    for name in list(logging.Logger.manager.loggerDict):
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def _first_failure(failures: dict[int, Any]) -> tuple[int, Any]:
    """The failure that caused the others. The agent's timestamps are whole seconds, so order
    by kind first: a rank that raised, exited non-zero or was killed by a signal comes before
    one that stopped on a peer's failure (PEER_FAILED_EXIT), and that before one the agent itself
    ended with SIGTERM after the first failure; then by time, then by rank."""

    def kind(exitcode: int) -> int:
        if exitcode == PEER_FAILED_EXIT:
            return 1
        return 2 if exitcode == -signal.SIGTERM else 0

    order = {rank: i for i, rank in enumerate(failures)}
    rank = min(
        failures, key=lambda r: (kind(failures[r].exitcode), failures[r].timestamp, order[r])
    )
    return rank, failures[rank]


def _failure_message(
    exc: BaseException, max_restarts: int = 0, roles: dict[int, str] | None = None
) -> tuple[str, int]:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    assert isinstance(exc, ChildFailedError)
    rank, failure = _first_failure(exc.failures)
    code = failure.exitcode
    if code < 0:
        how, code = f"was killed by signal {signal.Signals(-code).name}", 128 - code
    elif code == PEER_FAILED_EXIT:
        how = "stopped: a collective with other ranks failed (its line above says which)"
    else:
        how = f"exited with code {code}"
    detail = failure.message if isinstance(failure.message, str) else ""
    detail = detail.strip().splitlines()[-1] if detail.strip() else ""
    # torch's own placeholders ("To enable traceback...", "Signal 9 (SIGKILL) received by PID")
    # add nothing to what is said already
    told = detail.startswith(("To enable traceback", "Signal "))
    reason = f": {detail}" if detail and not told else ""
    # the agent raises only once every restart is spent
    restarts = f" after {max_restarts} restart(s)" if max_restarts else ""
    role = f" ({roles[rank]})" if roles and rank in roles else ""
    return f"rank {rank}{role} {how}{reason}; the job was stopped{restarts}", code or 1


def _launch_config(spec: LaunchSpec, host: str, port: int, log_dir: str, start: str) -> Any:
    """torch's elastic `LaunchConfig` for `spec`: gradmesh's rendezvous, every rank's output
    prefixed (rank 0's left alone when it owns the terminal), logs under `log_dir`."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig

    from gradmesh.launch.rendezvous import register

    redirects: Std | dict[int, Std] = Std.ALL
    if spec.passthrough_rank0 and spec.node_rank == 0:
        redirects = {i: (Std.NONE if i == 0 else Std.ALL) for i in range(spec.nproc)}
    rdzv_configs: dict[str, Any] = {"timeout": int(max(1, spec.timeout_s))}
    if spec.elastic:  # ranks come from the rendezvous; host 0 serves its store
        rdzv_configs["is_host"] = spec.node_rank == 0
        local_addr: str | None = own_address(host, port)
    else:
        rdzv_configs["rank"] = spec.node_rank
        local_addr = host if spec.nnodes == 1 else None
    return LaunchConfig(
        min_nodes=spec.min_nodes or spec.nnodes,
        max_nodes=spec.nnodes,
        nproc_per_node=spec.nproc,
        run_id=f"gradmesh-{port}",
        rdzv_backend=register(spec.elastic),
        rdzv_endpoint=f"{host}:{port}",
        rdzv_configs=rdzv_configs,
        max_restarts=spec.max_restarts,
        monitor_interval=0.1,
        start_method=start,
        log_line_prefix_template="[${rank}] ",
        logs_specs=DefaultLogsSpecs(log_dir=log_dir, redirects=redirects, tee=redirects),
        local_addr=local_addr,
    )


def _verbatim(arg: str) -> str:
    """`arg` escaped for torch elastic's `${local_rank}` substitution (string.Template), which
    turned a shell's `$$` into `$`: only `${local_rank}` / `$local_rank` are substituted."""
    return re.sub(r"\$(?!\{local_rank\}|local_rank(?!\w))", "$$", arg)


def launch(spec: LaunchSpec, command: list[str]) -> int:
    """Run `command` as `spec.nproc` workers on this host; return the job's exit code."""
    _check(spec)
    command = resolve_command(command)
    host, port = parse_master(spec.master, spec.nnodes)
    if spec.node_rank == 0:
        check_port_free(host if spec.nnodes > 1 else "127.0.0.1", port)
    else:
        wait_for_master(host, port, spec.timeout_s, spec.node_rank)
    os.environ.update(_worker_env(spec, host))
    forked = forkable(command, spec.nproc)  # before the log folder: a bad choice leaves none
    # before the agent's threads: the server is a fork of this process once torch is imported
    server_env = start_server(forked[0]) if forked else {}
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    _quiet_agent()
    log_dir = tempfile.mkdtemp(prefix=f"gradmesh-run-{os.getpid()}x-")  # owner: leak checks
    config = _launch_config(spec, host, port, log_dir, "forkserver" if forked else "spawn")
    try:
        if forked:  # gradmesh's own module: forked from a server that imported torch once
            elastic_launch(config, run_module)(*forked, LauncherEnvironment(), server_env)
        else:  # any other command, through the shim that binds it to this launcher
            shim = ["-I", "-S", bound.__file__, *map(_verbatim, command)]
            elastic_launch(config, sys.executable)(*shim)
        return 0
    except ChildFailedError as exc:
        message, code = _failure_message(exc, spec.max_restarts, spec.roles)
        print(f"gradmesh run: {message}", file=sys.stderr, flush=True)
        return code
    except SignalException as exc:
        print(
            f"gradmesh run: stopped by {exc.sigval.name}; every worker was ended", file=sys.stderr
        )
        return 128 + int(exc.sigval)
    except (RuntimeError, ValueError, OSError) as exc:  # rendezvous: unreachable, timed out
        first = first_line(exc)
        where = f"{host}:{port}"
        raise GradmeshError(
            f"node {spec.node_rank}: rendezvous with master {where} failed: {first}"
        ) from None
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
