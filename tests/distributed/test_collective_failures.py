"""Collectives fail clearly: every call is checked, numbered and bounded by the timeout; a
mismatch names every rank's signature, a lost or silent peer is named."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

import gradmesh
from gradmesh.collectives import ALGORITHMS, allreduce, broadcast
from gradmesh.errors import GradmeshError, PeerFailure
from tests.harness import run_ranks

EVERY_ALGORITHM = sorted(ALGORITHMS.names())


def mismatched(algorithm: str) -> str:
    r = gradmesh.rank()
    try:
        allreduce(
            torch.zeros(10 + r, dtype=torch.float32 if r < 2 else torch.float64),
            algorithm=algorithm,
        )
    except PeerFailure as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("algorithm", ["ring", "butterfly", "native"])
def test_mismatched_lengths_and_dtypes_name_ranks_and_shapes(algorithm: str) -> None:
    messages = run_ranks(mismatched, 3, algorithm, timeout=60)
    want = (
        "ranks disagree: rank 0 has call #1 of 10 float32, rank 1 has call #1 of 11 float32, "
        "rank 2 has call #1 of 12 float64"
    )
    for rank, message in enumerate(messages):
        assert message.startswith(f"rank {rank}: {algorithm} allreduce #1 on world: ")
        assert want in message


def later_call_goes_wrong(algorithm: str, how: str) -> tuple[str, float]:
    """Three calls agree, then rank 1 brings another shape (same element count), or skips the
    call and goes on to its next one (a broadcast)."""
    r = gradmesh.rank()
    for _ in range(3):
        allreduce(torch.ones(2, 3), algorithm=algorithm)
    started = time.monotonic()
    try:
        if how == "shape":
            allreduce(torch.ones(2, 3) if r == 0 else torch.ones(3, 2), algorithm=algorithm)
        elif r == 0:
            allreduce(torch.ones(2, 3), algorithm=algorithm)
        else:
            broadcast(torch.ones(4), root=0)
    except PeerFailure as exc:
        return str(exc), time.monotonic() - started
    return "no error", 0.0


@pytest.mark.parametrize("algorithm", EVERY_ALGORITHM)
def test_a_later_mismatch_or_skipped_call_is_named_at_once(algorithm: str) -> None:
    env = {"GRADMESH_TIMEOUT_S": "15"}
    shape = run_ranks(later_call_goes_wrong, 2, algorithm, "shape", timeout=30, extra_env=env)
    for rank, (message, seconds) in enumerate(shape):
        assert message.startswith(f"rank {rank}: {algorithm} allreduce #4 on world: ")
        assert "rank 0 has call #4 of 2x3 float32, rank 1 has call #4 of 3x2 float32" in message
        assert seconds < 15, "found by the signature check, before the 15 s timeout"
    skipped = run_ranks(later_call_goes_wrong, 2, algorithm, "skip", timeout=30, extra_env=env)
    for rank, (message, seconds) in enumerate(skipped):
        assert f"rank {rank}: " in message and "#4 on world: ranks disagree" in message
        assert "another operation or name" in message and seconds < 15


def named_differently() -> str:
    name = "grad.a" if gradmesh.rank() == 0 else "grad.b"
    try:
        allreduce(torch.ones(3), name=name)
    except PeerFailure as exc:
        return str(exc)
    return "no error"


def test_a_different_name_is_a_mismatch() -> None:
    for message in run_ranks(named_differently, 2):
        assert "rank 1 has call #1 of 3 float32, another operation or name than rank 0" in message


def stay_silent_until(flag: Path, limit_s: float = 60.0) -> None:
    """Keep this rank alive without joining any call until `flag` exists (a peer has its error)
    or `limit_s` passes: a silent peer for as long as the test needs, and no longer."""
    deadline = time.monotonic() + limit_s
    while not flag.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def peer_leaves(algorithm: str, flag: Path | None) -> str:
    """Rank 1 leaves after one call (or, with `flag`, stays silent); rank 0 makes a second."""
    allreduce(torch.ones(1000), algorithm=algorithm)  # agree on the signature first
    if gradmesh.rank() == 1:
        if flag is not None:
            stay_silent_until(flag)
        return "left"  # returning shuts this rank's process group down
    started = time.monotonic()
    try:
        allreduce(torch.ones(1000), algorithm=algorithm)
    except PeerFailure as exc:
        return f"{time.monotonic() - started:.1f}s {exc}"
    finally:
        if flag is not None:
            flag.touch()
    return "no error"


@pytest.mark.parametrize("algorithm", ["ring", "tree", "star", "butterfly", "native"])
def test_a_peer_that_exits_is_named(algorithm: str) -> None:
    env = {"GRADMESH_TIMEOUT_S": "20"}
    message, _ = run_ranks(peer_leaves, 2, algorithm, None, extra_env=env)
    seconds = float(message.split("s ")[0])
    assert seconds < 20, "a peer that left is noticed at once, before the 20 s timeout"
    assert f"rank 0: {algorithm} allreduce #2 on world: " in message
    assert "rank(s) 1 did not join the call" in message


SILENT_TIMEOUT_S = 2
LATE_S = 10
"""How long after its timeout a call may end: much more than a busy machine adds, much less than
the 30 minutes torch gives a group without one."""


def test_a_silent_peer_times_out_naming_it(tmp_path: Path) -> None:
    env = {"GRADMESH_TIMEOUT_S": str(SILENT_TIMEOUT_S)}
    message, _ = run_ranks(peer_leaves, 2, "ring", tmp_path / "flag", extra_env=env)
    seconds = float(message.split("s ")[0])
    assert SILENT_TIMEOUT_S - 0.5 < seconds < SILENT_TIMEOUT_S + LATE_S  # never early
    assert "rank 0: ring allreduce #2 on world: rank(s) 1 did not join the call (timeout 2 s)" in (
        message
    )


def hierarchical_with_a_silent_peer(flag: Path) -> str:
    allreduce(torch.ones(10), algorithm="hierarchical")
    if gradmesh.rank() == 3:
        stay_silent_until(flag)
        return "left"
    started = time.monotonic()
    try:
        allreduce(torch.ones(10), algorithm="hierarchical")
    except PeerFailure as exc:
        return f"{time.monotonic() - started:.1f}s {exc}"
    finally:
        flag.touch()
    return "no error"


def test_subgroups_have_the_jobs_timeout(tmp_path: Path) -> None:
    """hierarchical runs on the host-local and cross-host groups: they time out with the job."""
    messages = run_ranks(
        hierarchical_with_a_silent_peer,
        4,
        tmp_path / "flag",
        local_size=2,
        extra_env={"GRADMESH_TIMEOUT_S": str(SILENT_TIMEOUT_S)},
    )
    for message in messages[:3]:
        assert float(message.split("s ")[0]) < SILENT_TIMEOUT_S + LATE_S, message
        assert "hierarchical allreduce #2 on world" in message


def unknown_algorithm() -> str:
    try:
        allreduce(torch.ones(2), algorithm="gossip")
    except GradmeshError as exc:
        return str(exc)
    return "no error"


def test_unknown_algorithm_lists_the_valid_ones() -> None:
    valid = "auto, butterfly, hierarchical, native, ring, star, tree"
    assert (
        run_ranks(unknown_algorithm, 2)
        == [f"unknown allreduce algorithm 'gossip' (valid: {valid})"] * 2
    )


def optimizers_out_of_order() -> str:
    """Two DistributedOptimizers stepped in another order on rank 1: each has its own group, so
    each rank waits for its partner on its optimizer's group (instead of reducing one
    optimizer's buckets with the other's, which Gloo answers by aborting the process) and the
    timeout names the optimizer."""
    from gradmesh.sync.data_parallel.optimizer import DistributedOptimizer

    models = [torch.nn.Linear(4, 2), torch.nn.Linear(8, 3)]
    opts = [
        DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters())
        for m in models
    ]
    order = [0, 1] if gradmesh.rank() == 0 else [1, 0]
    try:
        for i in order:
            models[i](torch.ones(3, models[i].in_features)).sum().backward()
            opts[i].step()
    except PeerFailure as exc:
        return str(exc)
    return "no error"


def test_optimizers_stepped_out_of_order_time_out_naming_the_optimizer() -> None:
    first, second = run_ranks(optimizers_out_of_order, 2, extra_env={"GRADMESH_TIMEOUT_S": "3"})
    for rank, message in enumerate((first, second)):
        assert message.startswith(
            f"rank {rank}: comparing the model's parameters on DistributedOptimizer {rank + 1} "
            "failed: "
        )
