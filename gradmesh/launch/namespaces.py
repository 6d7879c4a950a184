"""Network namespaces, the emulated cluster's hosts: whether they can be made here, which are
ours, and how a namespace is removed with every process in it (also those left by a run that
was killed)."""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import signal
import subprocess
import tempfile

from gradmesh.errors import GradmeshError

PREFIX = "gmesh-"
"""Every namespace (and veth) gradmesh makes starts with this."""
NETNS_ETC = "/etc/netns"


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(list(args), capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise GradmeshError(f"{' '.join(args)} failed: {out.stderr.strip() or out.stdout.strip()}")
    return out


def missing_capability() -> str | None:
    """Why namespaces cannot be built here, in one line, or None when they can."""
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the emulated cluster needs `{tool}` (Debian package iproute2)"
    if os.geteuid() != 0:
        return "the emulated cluster needs root (or CAP_NET_ADMIN) to create network namespaces"
    return None


def netem_available() -> bool:
    """Whether this kernel has the netem qdisc (checked on a throw-away namespace's loopback)."""
    name = f"{PREFIX}{os.getpid()}probe"
    _sh("ip", "netns", "add", name)
    try:
        out = _sh(
            "tc",
            "-n",
            name,
            "qdisc",
            "add",
            "dev",
            "lo",
            "root",
            "netem",
            "delay",
            "1ms",
            check=False,
        )
        return out.returncode == 0
    finally:
        _sh("ip", "netns", "del", name, check=False)


def our_namespaces() -> list[str]:
    out = _sh("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace_processes(namespace: str) -> None:
    pids = _sh("ip", "netns", "pids", namespace, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def _delete_namespace(namespace: str) -> None:
    _kill_namespace_processes(namespace)
    _sh("ip", "netns", "del", namespace, check=False)
    shutil.rmtree(os.path.join(NETNS_ETC, namespace), ignore_errors=True)


def remove_stale() -> list[str]:
    """Delete namespaces of earlier runs whose owning process is gone; return their names."""
    removed = []
    for name in our_namespaces():
        m = re.match(rf"{PREFIX}(\d+)x", name)
        if m and not _pid_alive(int(m.group(1))):
            _delete_namespace(name)
            removed.append(name)
    for folder in glob.glob(os.path.join(tempfile.gettempdir(), f"{PREFIX}*-tmp-*")):
        m = re.match(rf"{PREFIX}(\d+)x", os.path.basename(folder))
        if m and not _pid_alive(int(m.group(1))):
            shutil.rmtree(folder, ignore_errors=True)
    return removed
