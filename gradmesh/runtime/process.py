"""What a gradmesh process knows of the launcher that started it, without importing torch: a
parameter-server job's worker supervisors need no more than this, and start faster for it."""

from __future__ import annotations

import os
import socket
import sys
from typing import TYPE_CHECKING

from gradmesh.errors import GradmeshError
from gradmesh.runtime.bound import LAUNCHER_PID_ENV, die_with_parent

if TYPE_CHECKING:
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

STORE_ENV = "GRADMESH_PS_STORE"
"""Set by a ps worker's supervisor: the job's rendezvous store, HOST:PORT (it has no torchrun
world of its own)."""
RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"
"""Set by torch's elastic agent: how many times it has restarted the job (0 at first)."""
DEFAULT_TIMEOUT_S = 60.0
TIMEOUT_ENV = "GRADMESH_TIMEOUT_S"
BACKEND_ENV = "GRADMESH_BACKEND"
ROUND_ENV = "GRADMESH_RDZV_ROUND"
"""Set by an elastic job's agent: the rendezvous round its workers were started in."""
MAX_WORLD_ENV = "GRADMESH_MAX_WORLD"
"""Set by `gradmesh run --nnodes MIN:MAX` to the most workers the elastic job can have."""


def visible_gpus() -> int:
    """CUDA devices this process can use; torch is imported only where an NVIDIA driver is
    (so that a CPU machine's launcher stays without it)."""
    if not os.path.exists("/dev/nvidiactl") or os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_share_problem(ranks: int, gpus: int, backend: str) -> str | None:
    """Why `ranks` processes on one host cannot each have a GPU of their own; None where they
    can, where there is no GPU (the job trains on the CPU), or where Gloo was asked for."""
    if gpus == 0 or ranks <= gpus or backend == "gloo":
        return None
    return (
        f"{ranks} ranks on this host but {gpus} GPU{'s' if gpus > 1 else ''}: gradmesh runs one "
        f"rank per GPU; use --workers {gpus} (or {BACKEND_ENV}=gloo to train on the CPU)"
    )


def check_gpu_share(ranks: int) -> None:
    """`gpu_share_problem` for this host, as one line: what a command checks after every value
    it was given is known good, so that a flag's mistake reads the same on every machine and
    comes before any machine's limit (a one-GPU host named its GPUs first: 31 unit tests that
    pass on a CPU failed on an H200)."""
    problem = gpu_share_problem(ranks, visible_gpus(), os.environ.get(BACKEND_ENV, ""))
    if problem:
        raise GradmeshError(problem)


def cpu_jiffies() -> tuple[int, int]:
    """(idle, total) CPU time of the whole machine so far, in jiffies, from /proc/stat (network
    namespaces share it: on an emulated cluster it is every host's)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return fields[3] + fields[4], sum(fields)


def idle_since(before: tuple[int, int]) -> float:
    """The machine's idle CPU share since `before` (a `cpu_jiffies()`)."""
    idle, total = (a - b for a, b in zip(cpu_jiffies(), before, strict=True))
    return idle / total if total else 0.0


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise GradmeshError(f"environment variable {name}={raw!r} is not an integer") from None


def restarts() -> int:
    """How many times the launcher has restarted this job (0 in its first attempt)."""
    return _env_int(RESTART_ENV, 0)


def stay_with_launcher(launcher: int | None = None) -> None:
    """A launcher's forkserver: ends when the launcher does (SIGKILL included), and at once
    if the launcher is gone already (`launcher`: its pid; by default the one its environment
    names, for a server started as a new interpreter)."""
    die_with_parent()
    expected = str(launcher) if launcher is not None else os.environ.get(LAUNCHER_PID_ENV)
    if str(os.getppid()) != expected:  # gone before the kernel watched
        os._exit(1)


def _parent_of(pid: int) -> str:
    """The parent pid of process `pid` ("" when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[1]
    except (OSError, IndexError):
        return ""


def bind_to_launcher(rank: int) -> None:
    """A worker never outlives its launcher: when the launcher dies by any signal (SIGKILL
    included, which it cannot pass on), the kernel ends this worker too. Exits at once if the
    launcher is already gone."""
    raw = os.environ.get(LAUNCHER_PID_ENV)
    if not raw:
        return
    die_with_parent()
    parent = os.getppid()
    # a worker forked by the launcher's forkserver (`gradmesh.launch.forked`) is its grandchild;
    # the server dies with the launcher, and this worker with the server
    if str(parent) != raw and _parent_of(parent) != raw:  # it died before the kernel watched
        print(
            f"gradmesh: rank {rank}: the launcher (pid {raw}) is gone; stopping",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)


def local_address(toward: str) -> str:
    """The address of the interface this host uses to reach `toward`: listeners (ps servers,
    the timeline's clock) bind there only."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((toward, 9))  # no packet is sent: this only picks a route
        return str(probe.getsockname()[0])


def connect_store(host: str, port: int, timeout_s: float) -> TCPStore:
    """A client of the job's rendezvous store (torch is imported here, not by this module)."""
    from datetime import timedelta

    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    try:
        return TCPStore(
            host,
            port,
            is_master=False,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
    except (RuntimeError, ValueError) as exc:
        raise GradmeshError(f"cannot reach the job's store at {host}:{port}: {exc}") from None


def interface_of(address: str) -> str | None:
    """The name of this host's interface that holds `address` (None when none does): what
    GLOO_SOCKET_IFNAME must name for Gloo to use the address an engine (Ray) chose. Read with
    the SIOCGIFADDR ioctl, which needs no package (psutil is only a test dependency)."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _index, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on this interface
                continue
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None


def default_timeout_s() -> float:
    """GRADMESH_TIMEOUT_S when set, else 60 s."""
    return timeout_s(None)


def timeout_s(timeout_s: float | None) -> float:
    if timeout_s is not None:
        return timeout_s
    raw = os.environ.get(TIMEOUT_ENV)
    try:
        return float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        raise GradmeshError(f"environment variable {TIMEOUT_ENV}={raw!r} is not a number") from None
