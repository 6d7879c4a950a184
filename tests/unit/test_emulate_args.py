"""Emulated-cluster arguments and capability checks that need no namespaces."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from gradmesh import units
from gradmesh.errors import GradmeshError
from gradmesh.launch import emulate, namespaces


def test_rates_and_latencies() -> None:
    assert units.parse_rate("1gbit") == 10**9
    assert units.parse_rate("100mbit") == 10**8
    assert units.parse_rate("2.5gbit") == 2_500_000_000
    assert units.parse_rate("10mbps") == 80_000_000
    assert units.parse_latency("250us") == pytest.approx(250e-6)
    for bad in ("fast", "1 parsec", "10"):
        with pytest.raises(GradmeshError):
            units.parse_rate(bad) if bad != "10" else units.parse_latency(bad)


def test_missing_root_is_one_clear_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Which line comes depends on what PATH holds and who runs it, set here: not on whether
    this machine has iproute2 or runs as root."""
    tools = tmp_path / "bin"
    tools.mkdir()
    monkeypatch.setenv("PATH", str(tools))
    assert namespaces.missing_capability() == (
        "the emulated cluster needs `ip` (Debian package iproute2)"
    )
    for tool in ("ip", "tc"):
        (tools / tool).write_text("#!/bin/sh\n")
        (tools / tool).chmod(0o755)
    (tools / "tc").chmod(0o644)  # not executable: not found
    assert namespaces.missing_capability() == (
        "the emulated cluster needs `tc` (Debian package iproute2)"
    )
    (tools / "tc").chmod(0o755)
    monkeypatch.setattr(emulate.os, "geteuid", lambda: 1000)
    assert namespaces.missing_capability() == (
        "the emulated cluster needs root (or CAP_NET_ADMIN) to create network namespaces"
    )
    monkeypatch.setattr(emulate.os, "geteuid", lambda: 0)
    assert namespaces.missing_capability() is None


def test_cluster_checks_its_size() -> None:
    with pytest.raises(GradmeshError, match="--hosts must be >= 1"):
        emulate.EmulatedCluster(hosts=0)
    with pytest.raises(GradmeshError, match="more than one /24"):
        emulate.EmulatedCluster(hosts=300)


@pytest.mark.parametrize("timeout", ["0", "-1"])
def test_a_timeout_that_has_passed_is_one_line_before_any_host(
    timeout: str, cli_line: Callable[..., str]
) -> None:
    """Once it created the hosts and ended the job at once as if it had run out of time."""
    line = cli_line(["emulate", "--hosts", "2", "--timeout", timeout, "--", "true"])
    assert line == f"gradmesh emulate: error: --timeout must be > 0, got {float(timeout)}"
