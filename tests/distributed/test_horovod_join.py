"""Horovod's join through the drop-in, on 2 and 3 ranks: a rank out of data calls `hvd.join()`
and the others' allreduces and optimizer steps still complete (zeros into sums, and averages
still divide by the world's size, as Horovod's do); training on uneven data ends equal to one
process over the same samples, every replica alike; an operation a joined rank cannot take part
in is one line on each rank that called it, and the joined rank stays joined."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import gradmesh.horovod as hvd
from tests.harness import run_ranks

BATCHES = [4, 2, 3]
"""Batches per rank: rank 1 joins first, rank 2 next, rank 0 last."""
NO_WAIT_S = 15.0
"""A refused operation fails at its announcement: well inside the harness's 30 s collective
timeout, which a call that waited for a joined rank would run into."""


def _batch(r: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * r + i)
    return torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)


def uneven() -> dict[str, Any]:
    hvd.init()
    r = hvd.rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    seen = []
    for i in range(BATCHES[r]):
        x, y = _batch(r, i)
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        seen.append(
            [
                hvd.allreduce(loss.detach(), name="loss").item(),  # over all 3, joined or not
                hvd.allreduce(torch.tensor([1, r]), op=hvd.Sum).tolist(),
            ]
        )
        if i < min(BATCHES):  # nobody has joined yet
            seen[-1].append(hvd.allgather(torch.tensor([[r, i]])).tolist())
        elif i == min(BATCHES):  # rank 1 has: an allgather is refused, as Horovod's is
            try:
                hvd.allgather(torch.tensor([[r, i]]))
                seen[-1].append("no error")
            except hvd.GradmeshError as exc:
                seen[-1].append(str(exc))
    return {"last": hvd.join(), "params": [p.detach() for p in model.parameters()], "seen": seen}


def test_join_lets_the_others_reduce_gather_broadcast_and_step_as_one_process_would() -> None:
    results = run_ranks(uneven, 3, timeout=60)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(max(BATCHES)):
        left = [r for r in range(3) if BATCHES[r] > i]
        opt.zero_grad()
        losses = [F.mse_loss(model(_batch(r, i)[0]), _batch(r, i)[1]) for r in left]
        (sum(losses) / 3).backward()  # a joined rank's zeros count in the average
        mean = float(sum(losses).detach()) / 3
        opt.step()
        for r in left:
            loss, counts, *rest = results[r]["seen"][i]
            assert abs(loss - mean) < 1e-5 * max(1.0, abs(mean))
            assert counts == [len(left), sum(left)]
            if i < min(BATCHES):
                assert rest == [[[k, i] for k in range(3)]]
            elif i == min(BATCHES):
                assert rest[0].startswith(f"rank {r}: allgather 'allgather.noname.")
                assert "rank(s) [1] have joined" in rest[0] and "\n" not in rest[0]
    for got in results:
        assert got["last"] == 0  # rank 0 ran out of data last
        for param, want in zip(got["params"], model.parameters(), strict=True):
            assert torch.allclose(param, want.detach(), atol=1e-6)


def refused() -> list[str]:
    hvd.init()
    r = hvd.rank()
    said = []
    cases = [
        lambda: hvd.broadcast(torch.ones(2), root_rank=1),  # from the joined rank
        lambda: hvd.alltoall(torch.ones(2)),
        lambda: hvd.allreduce(torch.ones(2), op=hvd.Max),  # zeros would change a max
        lambda: hvd.allgather_object(r),
    ]
    if r == 1:
        said.append(str(hvd.join()))  # stays joined through rank 0's refused operations
    else:
        for case in cases:
            started = time.monotonic()
            try:
                case()
                said.append("no error")
            except hvd.GradmeshError as exc:
                said.append(str(exc))
            assert time.monotonic() - started < NO_WAIT_S
        said.append(str(hvd.join()))
    try:  # both training, calling different operations (the unnamed counters still agree)
        hvd.allreduce(torch.ones(2)) if r == 0 else hvd.allgather(torch.ones(3, 2))
        said.append("no error")
    except hvd.GradmeshError as exc:
        said.append(str(exc))
    said.append(str(hvd.allreduce(torch.tensor([r + 1.0]), op=hvd.Sum).item()))  # still in step
    return said


def test_an_operation_a_joined_rank_cannot_serve_is_one_line_on_the_ranks_that_called_it() -> None:
    first, second = run_ranks(refused, 2)
    refusals = ["broadcast", "alltoall", "max", "allgather_object"]
    for line, what in zip(first[:4], refusals, strict=True):
        assert line.startswith(f"rank 0: {what.replace('max', 'allreduce')} ") and "\n" not in line
        assert "rank(s) [1] have joined" in line and what in line
    assert first[4] == second[0] == "0"  # rank 0 joined last
    for r, said in enumerate([first[5:], second[1:]]):
        assert said[0].startswith(f"rank {r}: ") and "called different operations" in said[0]
        assert "rank 0: allreduce (average) of float32 (2,)" in said[0]
        assert "rank 1: allgather of float32 (-1, 2)" in said[0]
        assert said[1] == "3.0"


def on_a_set() -> tuple[int, list[torch.Tensor]] | str:
    hvd.init()
    pair = hvd.add_process_set([0, 1])
    r = hvd.rank()
    if r == 2:  # outside the set: never waited for
        return "outside"
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        process_set=pair,
    )
    for i in range(BATCHES[r]):
        opt.zero_grad()
        F.mse_loss(model(_batch(r, i)[0]), _batch(r, i)[1]).backward()
        opt.step()
    return hvd.join(), [p.detach() for p in model.parameters()]


def test_join_on_a_process_sets_optimizer_waits_for_no_rank_outside_it() -> None:
    first, second, outside = run_ranks(on_a_set, 3, timeout=60)
    assert outside == "outside"
    assert first[0] == second[0] == 0  # rank 0 ran out of data after rank 1
    for a, b in zip(first[1], second[1], strict=True):
        assert torch.equal(a, b)


def alone_after_join(flag: Path) -> tuple[str, float] | str:
    hvd.init()
    assert hvd.join() == 1  # the highest rank of those joining last
    if hvd.rank() == 1:
        # alive, but calling nothing, until rank 0 has its error (not a fixed sleep that a
        # slow machine could outlast); within run_ranks' 60 s
        deadline = time.monotonic() + 45
        while not flag.exists():
            if time.monotonic() > deadline:
                return "rank 0 never had its error"
            time.sleep(0.05)
        return "idle"
    started = time.monotonic()
    try:
        hvd.allreduce(torch.ones(2))
        return "no error", 0.0
    except hvd.GradmeshError as exc:
        return str(exc), time.monotonic() - started
    finally:
        flag.touch()


def test_a_collective_no_other_rank_calls_after_join_names_the_rank_and_the_operation(
    tmp_path: Path,
) -> None:
    flag = tmp_path / "flag"
    (said, waited), idle = run_ranks(alone_after_join, 2, flag, init={"timeout_s": 2.0})
    assert idle == "idle"
    assert said.startswith("rank 0: allreduce 'allreduce.noname.0' on the global process set: ")
    assert "rank 1 did not take part within 2 s" in said and "\n" not in said
    assert waited < NO_WAIT_S
