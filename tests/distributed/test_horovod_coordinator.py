"""The drop-in's coordinator (`gradmesh/horovod/coordinator.py`) on real ranks: operations are
matched by name whatever order each rank submits them in; a second pending operation with one
name is a ValueError on that rank alone while the job goes on (Horovod's duplicate-name tests);
the steady state costs one small all-gather a round (the response cache); a name some rank
never submits, and a set removed under a pending operation, are one line naming the operation,
the name and the ranks; an optimizer over a set this rank is not in steps alone."""

from __future__ import annotations

import time
from typing import Any

import torch

import gradmesh
import gradmesh.horovod as hvd
from gradmesh.horovod.coordinator import _coordinators
from tests.harness import run_ranks

NO_WAIT_S = 15.0
"""Well inside the harness's 30 s collective timeout."""


def out_of_order() -> dict[str, Any]:
    hvd.init()
    r = hvd.rank()
    names = ["a", "b", "c"] if r == 0 else ["c", "a", "b"]  # rank 1 submits another order
    handles = {
        n: hvd.allreduce_async(torch.tensor([float(ord(n)) * (r + 1)]), name=n, op=hvd.Sum)
        for n in names
    }
    sums = {n: hvd.synchronize(h).item() for n, h in handles.items()}
    # Horovod's duplicate-name test: rank 0's first 'dup' waits while both meet at a barrier
    clash = ""
    if r == 0:
        first = hvd.allreduce_async(torch.ones(3), name="dup")
        try:
            hvd.allreduce_async(torch.ones(3), name="dup")
        except ValueError as exc:
            clash = str(exc)
    hvd.barrier()
    if r == 1:
        first = hvd.allreduce_async(torch.ones(3), name="dup")
    dup = hvd.synchronize(first).tolist()
    hvd.barrier()
    return {"sums": sums, "clash": clash, "dup": dup}


def test_operations_match_by_name_in_any_order_and_a_duplicate_name_is_one_ranks_value_error() -> (
    None
):
    first, second = run_ranks(out_of_order, 2)
    for got in (first, second):
        assert got["sums"] == {n: 3.0 * ord(n) for n in "abc"}
        assert got["dup"] == [1.0, 1.0, 1.0]
    assert first["clash"] == (
        "rank 0: an operation named 'dup' is still in flight on the global process set; "
        "synchronize it before starting another of that name"
    )
    assert second["clash"] == ""


def steady_state() -> list[int]:
    hvd.init()
    found = []
    for step in range(12):
        handles = [
            hvd.allreduce_async(torch.full((4,), float(step)), name=f"grad.{i}") for i in range(3)
        ]
        for h in handles:
            hvd.synchronize(h)
        if step == 1:  # every name has run once: cached from now on
            co = _coordinators[0]
            found = [co.rounds, co.new_rounds]
    co = _coordinators[0]
    return [*found, co.rounds, co.new_rounds]


def test_known_names_settle_without_sending_their_rows_again() -> None:
    for before_rounds, before_new, rounds, new in run_ranks(steady_state, 2):
        assert rounds > before_rounds  # ten more steps took rounds ...
        assert new == before_new  # ... none of which sent a request's row: bits only


def never_submitted() -> str:
    hvd.init()
    r = hvd.rank()
    started = time.monotonic()
    try:  # each rank waits for a name the other never submits; their rounds go on meanwhile
        hvd.allreduce(torch.ones(2), name=f"only.{r}")
        return "no error"
    except hvd.GradmeshError as exc:
        assert time.monotonic() - started < NO_WAIT_S
        return str(exc)


def test_a_name_another_rank_never_submits_is_one_line_naming_it_and_the_rank() -> None:
    for r, said in enumerate(run_ranks(never_submitted, 2, init={"timeout_s": 2.0})):
        assert said.startswith(f"rank {r}: allreduce 'only.{r}' on the global process set: ")
        assert "\n" not in said
        # its own wait ran out; or the other rank's ran out first, and that rank, with nothing
        # left to match, took no part in the round this one was in
        assert said.endswith(f"rank(s) [{1 - r}] did not submit it within 2 s") or (
            f"rank {1 - r} did not take part within 2 s" in said
        ), said


def removed_while_pending() -> tuple[str, float]:
    hvd.init()
    pair = hvd.add_process_set([0, 1])
    # each rank waits for a name the other never submits, until the set is removed
    waiting = hvd.allreduce_async(torch.ones(2), name=f"late.{hvd.rank()}", process_set=pair)
    time.sleep(0.3)
    started = time.monotonic()
    hvd.remove_process_set(pair)
    took = time.monotonic() - started
    try:
        hvd.synchronize(waiting)
        return "completed", took
    except hvd.GradmeshError as exc:
        return str(exc), took


def test_removing_a_set_fails_what_is_pending_on_it_in_one_line_at_once() -> None:
    for r, (said, took) in enumerate(run_ranks(removed_while_pending, 2)):
        assert said == (
            f"rank {r}: allreduce 'late.{r}' on process set 1: process set 1 (ranks [0, 1]) was "
            "removed while it was pending"
        )
        assert took < NO_WAIT_S  # the coordinators' threads stopped together, no timeout


def outside_the_set() -> list[float]:
    hvd.init()
    r = hvd.rank()
    pair = hvd.add_process_set([0, 1])
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1, bias=False)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0),
        named_parameters=model.named_parameters(),
        process_set=pair,
    )
    x = torch.full((1, 2), float(r + 1))
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    hvd.barrier()
    hvd.remove_process_set(pair)
    return model.weight.detach().reshape(-1).tolist()


def test_an_optimizer_over_a_set_steps_alone_on_a_rank_outside_it() -> None:
    torch.manual_seed(0)
    start = torch.nn.Linear(2, 1, bias=False).weight.detach().reshape(-1)
    results = run_ranks(outside_the_set, 3)
    averaged = (start - 1.5).tolist()  # the gradient is x: (1 + 2) / 2 on ranks 0 and 1
    assert results[0] == results[1] and torch.allclose(
        torch.tensor(results[0]), torch.tensor(averaged)
    )
    assert torch.allclose(torch.tensor(results[2]), start - 3.0)  # its own gradient, x = 3


def across_a_restart() -> list[float]:
    hvd.init()
    first = hvd.allreduce(torch.ones(1), op=hvd.Sum).item()
    gradmesh.shutdown()  # gradmesh's own shutdown closes the coordinators too
    gradmesh.init()
    return [first, hvd.allreduce(torch.ones(1), op=hvd.Sum, name="again").item()]


def test_the_coordinators_end_with_the_runtime_and_start_again_with_the_next() -> None:
    assert run_ranks(across_a_restart, 2) == [[2.0, 2.0]] * 2
