"""Collectives fail clearly: mismatched tensors name ranks and shapes; a lost peer is named."""

from __future__ import annotations

import time

import pytest
import torch

import gradmesh
from gradmesh.collectives import allreduce
from gradmesh.errors import GradmeshError
from tests.harness import run_ranks


def mismatched(algorithm: str, debug_later: bool) -> str:
    r = gradmesh.rank()
    try:
        if debug_later:  # agree first, then differ on a call whose signature was already checked
            allreduce(torch.zeros(10), algorithm=algorithm)
        allreduce(
            torch.zeros(10 + r, dtype=torch.float32 if r < 2 else torch.float64),
            algorithm=algorithm,
        )
    except GradmeshError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("algorithm", ["ring", "butterfly", "native"])
def test_mismatched_lengths_and_dtypes_name_ranks_and_shapes(algorithm: str) -> None:
    messages = run_ranks(mismatched, 3, algorithm, False, timeout=60)
    want = (
        "ranks disagree on the tensor: rank 0 has 10 x float32, rank 1 has 11 x float32, "
        "rank 2 has 12 x float64"
    )
    for rank, message in enumerate(messages):
        assert message.startswith(f"rank {rank}: {algorithm} allreduce: ")
        assert want in message


def test_debug_mode_checks_every_call() -> None:
    messages = run_ranks(mismatched, 2, "ring", True, extra_env={"GRADMESH_DEBUG": "1"})
    assert all("rank 0 has 10 x float32, rank 1 has 11 x float32" in m for m in messages)


def peer_leaves(algorithm: str, hang: bool) -> str:
    allreduce(torch.ones(1000), algorithm=algorithm)  # agree on the signature first
    if gradmesh.rank() == 1:
        if hang:
            time.sleep(6)  # alive but silent, past rank 0's timeout
        return "left"  # returning shuts this rank's process group down
    started = time.monotonic()
    try:
        allreduce(torch.ones(1000), algorithm=algorithm)
    except GradmeshError as exc:
        return f"{time.monotonic() - started:.1f}s {exc}"
    return "no error"


@pytest.mark.parametrize("algorithm", ["ring", "tree", "star", "butterfly"])
def test_a_peer_that_exits_is_named(algorithm: str) -> None:
    message, _ = run_ranks(peer_leaves, 2, algorithm, False, extra_env={"GRADMESH_TIMEOUT_S": "5"})
    assert f"rank 0: {algorithm} allreduce: " in message
    assert "rank 1 failed" in message


def test_a_silent_peer_times_out_naming_it() -> None:
    message, _ = run_ranks(peer_leaves, 2, "ring", True, extra_env={"GRADMESH_TIMEOUT_S": "2"})
    seconds = float(message.split("s ")[0])
    assert seconds < 5.5
    assert "rank 0: ring allreduce: receive from rank 1 failed" in message


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
