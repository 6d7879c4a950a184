"""An emulated cluster: H hosts as Linux network namespaces joined by shaped links.

Each host is a namespace with one interface, `eth0`, at 10.77.0.(i+1)/24, joined by a veth pair to
a bridge that lives in a namespace of its own (so nothing touches the machine's own network).
Both ends of every host's veth are shaped with `tc tbf` to the link rate, so each direction is
limited; TSO/GSO/GRO are turned off on them so the shaper sees real packet sizes. `netem` adds
latency only where the kernel has it (these machines do not: that is said in one line).

A job runs as a real multi-node launch: on every host, in its namespace, one `gradmesh run` agent
(torchrun's elastic agent) with --nnodes H --node-rank i --master 10.77.0.1 --iface eth0, passed
through GRADMESH_* environment variables so that `gradmesh train` and `gradmesh bench` launch
the same way. Namespace names carry a per-run id (`gmesh-<pid><rand>-...`); a run removes the
namespaces of runs whose process is gone, so a crashed run leaves nothing behind for long.

We write this ourselves: no maintained Python library builds namespace testbeds with tc shaping
(mininet needs Open vSwitch and a Python 2-era code base); iproute2 is the tool, driven here.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO

from gradmesh.errors import PEER_FAILED_EXIT, GradmeshError
from gradmesh.launch.namespaces import (
    NETNS_ETC,
    PREFIX,
    _delete_namespace,
    _kill_namespace_processes,
    _sh,
    missing_capability,
    netem_available,
    remove_stale,
)
from gradmesh.units import parse_latency, parse_rate

SUBNET = "10.77.0"
MASTER_PORT = 29400
IFACE = "eth0"
CLUSTER_ENV = {
    "nnodes": "GRADMESH_NNODES",
    "node_rank": "GRADMESH_NODE_RANK",
    "master": "GRADMESH_MASTER",
    "iface": "GRADMESH_IFACE",
    "nproc": "GRADMESH_NPROC",
}
"""How an emulated host tells `gradmesh run` / `train` / `bench` where it sits in the job."""
JOB_TOKEN_ENV = "GRADMESH_JOB_TOKEN"
"""The job's random token (hex), drawn at launch; parameter-server messages carry it."""


@dataclass
class HostJob:
    """One command running on every emulated host; output is streamed with a host prefix."""

    procs: list[subprocess.Popen[str]]
    threads: list[threading.Thread] = field(default_factory=list)
    elastic: bool = False
    """Whether the job goes on when a host is lost (`--nnodes MIN:MAX`)."""

    def _lost(self, code: int) -> bool:
        """A host whose launcher was killed by a signal (kill_host, a power cut) is lost; an
        elastic job goes on without it."""
        return self.elastic and code < 0

    def wait(self, timeout: float) -> int:
        """The job's exit code: the failing host's (named on stderr), 0 when all succeed (an
        elastic job: all that were not lost), 124 on timeout. A host whose ranks only stopped
        because of another host's failure (PEER_FAILED_EXIT) is named only when no host failed
        by itself."""
        deadline = time.monotonic() + timeout
        codes: dict[int, int] = {}
        while len(codes) < len(self.procs):
            for i, proc in enumerate(self.procs):
                if i not in codes and proc.poll() is not None:
                    codes[i] = proc.returncode
            failed = [c for c in codes.values() if c != 0 and not self._lost(c)]
            if failed or len(codes) == len(self.procs):
                break
            if time.monotonic() > deadline:
                print(
                    f"gradmesh emulate: the job did not finish within {timeout:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )
                return 124
            time.sleep(0.05)
        if [c for c in codes.values() if c != 0 and not self._lost(c)]:
            grace = time.monotonic() + 10  # the other hosts see the failure and stop on their own
            while any(p.poll() is None for p in self.procs) and time.monotonic() < grace:
                time.sleep(0.05)
            for i, proc in enumerate(self.procs):
                if i not in codes and proc.poll() is not None:
                    codes[i] = proc.returncode
            ranked = [
                (c == PEER_FAILED_EXIT, order, host, c)
                for order, (host, c) in enumerate(codes.items())
                if c != 0 and not self._lost(c)
            ]
            _, _, host, code = min(ranked)
            for t in self.threads:  # the hosts' own last lines come before ours
                t.join(timeout=2)
            print(
                f"gradmesh emulate: host {host} failed (exit code {code})",
                file=sys.stderr,
                flush=True,
            )
            return code
        for t in self.threads:
            t.join(timeout=5)
        for host, code in sorted(codes.items()):
            if self._lost(code):
                print(
                    f"gradmesh emulate: host {host} was lost (killed by "
                    f"{signal.Signals(-code).name}); the job went on without it",
                    file=sys.stderr,
                    flush=True,
                )
        return 0


def _tbf(bps: int) -> list[str]:
    """tc's token bucket at `bps` bits a second, its burst one millisecond of traffic."""
    burst = max(16 * 1024, bps // 8 // 1000)
    return f"tbf rate {bps}bit burst {burst} latency 50ms".split()


def _start(command: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    """A host's command (`ip netns exec NS ...`) in a session of its own, its output piped (the
    test suite forks its `gradmesh` commands into the namespace instead: tests/zygote.py)."""
    pipe = subprocess.PIPE
    return subprocess.Popen(
        command, stdout=pipe, stderr=pipe, text=True, env=env, start_new_session=True
    )


def _pump(stream: IO[str], prefix: str, sink: IO[str]) -> None:
    for line in stream:
        sink.write(f"{prefix}{line}")
        sink.flush()


@dataclass
class EmulatedCluster:
    """`with EmulatedCluster(hosts=4, bandwidth="1gbit") as cluster: cluster.run(cmd)`."""

    hosts: int
    bandwidth: str = "1gbit"
    latency: str | None = None
    run_id: str = field(default_factory=lambda: f"{os.getpid()}x{secrets.token_hex(2)}")
    notes: list[str] = field(default_factory=list)
    """One-line remarks about the emulation (netem missing, ...), for reports."""

    def __post_init__(self) -> None:
        if self.hosts < 1:
            raise GradmeshError(f"--hosts must be >= 1, got {self.hosts}")
        if self.hosts > 250:
            raise GradmeshError(f"--hosts {self.hosts} is more than one /24 subnet holds (250)")
        self.bandwidth_bps = parse_rate(self.bandwidth)
        self.latency_s = parse_latency(self.latency) if self.latency else 0.0
        self._created: list[str] = []
        self.job_token = ""
        self.jobs = 0
        """Jobs started on this cluster: each gets its own master port, since the last job's
        store port may still be held (TIME_WAIT) when the next one starts."""
        """The token of the job now started: one for every host's launcher."""
        self.tmpdir: str | None = None
        """Temporary files of the hosts' processes (TMPDIR): removed with the cluster, even
        when its processes had to be killed before they could clean up."""

    # -- names -----------------------------------------------------------------------------
    def namespace(self, host: int) -> str:
        return f"{PREFIX}{self.run_id}-h{host}"

    def address(self, host: int) -> str:
        return f"{SUBNET}.{host + 1}"

    @property
    def switch(self) -> str:
        return f"{PREFIX}{self.run_id}-sw"

    # -- life cycle ------------------------------------------------------------------------
    def __enter__(self) -> EmulatedCluster:
        if why := missing_capability():
            raise GradmeshError(why)
        remove_stale()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add_namespace(self, name: str) -> None:
        _sh("ip", "netns", "add", name)
        self._created.append(name)
        _sh("ip", "-n", name, "link", "set", "lo", "up")

    def _shape(self, namespace: str, dev: str) -> None:
        if shutil.which("ethtool"):
            _sh(
                *f"ip netns exec {namespace} ethtool -K {dev} tso off gso off gro off".split(),
                check=False,
            )
        _sh(
            *f"tc -n {namespace} qdisc add dev {dev} root handle 1:".split(),
            *_tbf(self.bandwidth_bps),
        )
        if self.latency_s:
            delay = f"{self.latency_s / 2 * 1e6:.0f}us"  # half each way: the round trip adds up
            _sh(
                *f"tc -n {namespace} qdisc add dev {dev} parent 1:1 handle 10: netem delay "
                f"{delay}".split()
            )

    def _write_hosts_file(self, namespace: str) -> None:
        """`ip netns exec` mounts /etc/netns/NAME/hosts over /etc/hosts: name every emulated host
        so that reverse look-ups of peers (c10d does them) answer at once."""
        folder = os.path.join(NETNS_ETC, namespace)
        os.makedirs(folder, exist_ok=True)
        lines = ["127.0.0.1 localhost"]
        lines += [f"{self.address(h)} h{h}" for h in range(self.hosts)]
        lines += [f"::ffff:{self.address(h)} h{h}" for h in range(self.hosts)]  # dual-stack peers
        with open(os.path.join(folder, "hosts"), "w") as f:
            f.write("\n".join(lines) + "\n")

    def _build(self) -> None:
        self.tmpdir = tempfile.mkdtemp(prefix=f"{PREFIX}{self.run_id}-tmp-")
        if self.latency_s and not netem_available():
            note = "netem is not available on this kernel: --latency is not applied"
            self.notes.append(note)
            print(f"gradmesh emulate: {note}", file=sys.stderr, flush=True)
            self.latency_s = 0.0
        self._add_namespace(self.switch)
        _sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self.switch, "link", "set", "br0", "up")
        for host in range(self.hosts):
            ns, port = self.namespace(host), f"p{host}"
            self._add_namespace(ns)
            veth = f"ip link add name {IFACE} netns {ns} type veth peer name {port} netns"
            _sh(*veth.split(), self.switch)
            _sh("ip", "-n", self.switch, "link", "set", port, "master", "br0")
            _sh("ip", "-n", self.switch, "link", "set", port, "up")
            _sh("ip", "-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", IFACE)
            _sh("ip", "-n", ns, "link", "set", IFACE, "up")
            self._write_hosts_file(ns)
            self._shape(ns, IFACE)  # host -> switch
            self._shape(self.switch, port)  # switch -> host

    def close(self) -> None:
        """Stop every process on every host and delete the namespaces (idempotent)."""
        for name in self._created:
            _kill_namespace_processes(name)
        for name in reversed(self._created):
            _delete_namespace(name)
        self._created.clear()
        if self.tmpdir is not None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None

    # -- jobs ------------------------------------------------------------------------------
    def host_env(
        self, host: int, procs_per_host: int, min_hosts: int | None = None
    ) -> dict[str, str]:
        nnodes = str(self.hosts) if min_hosts is None else f"{min_hosts}:{self.hosts}"
        return {
            JOB_TOKEN_ENV: self.job_token,
            CLUSTER_ENV["nnodes"]: nnodes,
            CLUSTER_ENV["node_rank"]: str(host),
            CLUSTER_ENV["master"]: f"{self.address(0)}:{MASTER_PORT + self.jobs}",
            CLUSTER_ENV["iface"]: IFACE,
            CLUSTER_ENV["nproc"]: str(procs_per_host),
        }

    def start(
        self,
        command: list[str],
        procs_per_host: int = 1,
        min_hosts: int | None = None,
        host_env: Callable[[int], dict[str, str]] | None = None,
    ) -> HostJob:
        """Start `command` on every host (a gradmesh command, or any program under gradmesh run);
        with `min_hosts`, as an elastic job that goes on while that many hosts remain.
        `host_env(host)` replaces the GRADMESH_* variables that place each host in the job (a
        test giving each host what a Kubernetes pod would get instead)."""
        if not command:
            raise GradmeshError("no command to run: put it after --, like: -- gradmesh train")
        if procs_per_host < 1:
            raise GradmeshError(f"--procs-per-host must be >= 1, got {procs_per_host}")
        self.job_token = secrets.token_hex(16)
        self.jobs += 1
        gradmesh = [sys.executable, "-m", "gradmesh.cli"]
        argv = (
            gradmesh + command[1:]
            if command[0] == "gradmesh"
            else [*gradmesh, "run", "--", *command]
        )
        procs: list[subprocess.Popen[str]] = []
        threads: list[threading.Thread] = []
        for host in range(self.hosts):
            placed = (
                self.host_env(host, procs_per_host, min_hosts)
                if host_env is None
                else host_env(host)
            )
            procs.append(self._spawn(host, argv, placed, procs_per_host, threads))
        return HostJob(procs, threads, elastic=min_hosts is not None)

    def start_on(
        self, host: int, command: list[str], procs: int = 1, env: dict[str, str] | None = None
    ) -> HostJob:
        """Start a gradmesh command (`["gradmesh", ...]`) on one host only, as a job of its own
        placed there (one node, its master on that host): a replica group, or the lighthouse."""
        if not command or command[0] != "gradmesh":
            raise GradmeshError("start_on runs a gradmesh command, like: gradmesh train ...")
        self.jobs += 1
        placed = {
            **self.host_env(host, procs),
            CLUSTER_ENV["nnodes"]: "1",
            CLUSTER_ENV["node_rank"]: "0",
            CLUSTER_ENV["master"]: f"{self.address(host)}:{MASTER_PORT + self.jobs}",
            **(env or {}),
        }
        threads: list[threading.Thread] = []
        argv = [sys.executable, "-m", "gradmesh.cli", *command[1:]]
        return HostJob([self._spawn(host, argv, placed, procs, threads)], threads)

    def _spawn(
        self,
        host: int,
        argv: list[str],
        placed: dict[str, str],
        procs_per_host: int,
        threads: list[threading.Thread],
    ) -> subprocess.Popen[str]:
        """`argv` in host's namespace, its output streamed with the host's prefix."""
        env = {**os.environ, **placed}
        if self.tmpdir is not None:
            env["TMPDIR"] = self.tmpdir
        # every emulated host shares this machine's cores: do not let each think it has all
        omp = max(1, (os.cpu_count() or 1) // (self.hosts * procs_per_host))
        env.setdefault("OMP_NUM_THREADS", str(omp))
        proc = _start(["ip", "netns", "exec", self.namespace(host), *argv], env)
        for stream, sink in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
            assert stream is not None
            t = threading.Thread(target=_pump, args=(stream, f"[h{host}] ", sink), daemon=True)
            t.start()
            threads.append(t)
        return proc

    def run(
        self,
        command: list[str],
        procs_per_host: int = 1,
        timeout: float = 600.0,
        min_hosts: int | None = None,
    ) -> int:
        """Run `command` on every host to the end; return the job's exit code."""
        return self.start(command, procs_per_host, min_hosts).wait(timeout)

    # -- faults and counters -----------------------------------------------------------------
    def set_link(self, host: int, up: bool) -> None:
        """Unplug (up=False) or replug a host's link."""
        _sh("ip", "-n", self.namespace(host), "link", "set", IFACE, "up" if up else "down")

    def set_bandwidth(self, host: int, rate: str) -> None:
        """Shape a host's link to `rate` (like 1gbit) from now on, both ways."""
        for ns, dev in ((self.namespace(host), IFACE), (self.switch, f"p{host}")):
            _sh(
                *f"tc -n {ns} qdisc change dev {dev} root handle 1:".split(),
                *_tbf(parse_rate(rate)),
            )

    def kill_host(self, host: int) -> None:
        """Kill every process on one host at once, as a power failure would."""
        _kill_namespace_processes(self.namespace(host))

    def bytes_sent(self, host: int) -> int:
        """Bytes the host's interface has transmitted (the kernel's counter)."""
        out = _sh("ip", "-j", "-s", "-n", self.namespace(host), "link", "show", "dev", IFACE)
        return int(json.loads(out.stdout)[0]["stats64"]["tx"]["bytes"])
