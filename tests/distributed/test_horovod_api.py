"""Horovod's process sets, differentiable collectives, named operations, init/shutdown cycles and
elastic state through the drop-in, on 2 and 3 ranks, written from Horovod's documentation:
values against the documented results, gradients against autograd on one process, errors on
every rank involved and within the timeout."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

import gradmesh.horovod as hvd
from gradmesh.horovod.headers import BARRIER, header
from gradmesh.horovod.process_sets import submit
from tests.harness import run_ranks

WORLDS = [2, 3]
NO_WAIT_S = 15.0
"""A bad call fails before any peer is waited for: well inside the harness's 30 s collective
timeout, which is what a call that did wait would run into."""


def on_sets() -> dict[str, Any]:
    hvd.init()
    r, world = hvd.rank(), hvd.size()
    even = hvd.add_process_set([k for k in range(world) if k % 2 == 0])
    odd = hvd.add_process_set(hvd.ProcessSet([k for k in range(world) if k % 2 == 1]))
    mine = even if r % 2 == 0 else odd
    x = torch.tensor([float(r + 1), 10.0])
    out: dict[str, Any] = {"ids": [even.process_set_id, odd.process_set_id]}
    out["set"] = [mine.size(), mine.rank(), mine.included(), even.included()]
    out["allreduce"] = hvd.allreduce(x, op=hvd.Sum, process_set=mine).tolist()
    out["grouped"] = [
        t.tolist() for t in hvd.grouped_allreduce([x, x * 2], op=hvd.Sum, process_set=mine)
    ]
    out["allgather"] = hvd.allgather(x.view(1, 2), process_set=mine).tolist()
    root = mine.ranks[-1]  # a global rank, as in Horovod
    out["broadcast"] = hvd.broadcast(x, root_rank=root, process_set=mine).tolist()
    out["reducescatter"] = hvd.reducescatter(
        torch.arange(4.0) * (r + 1), op=hvd.Sum, process_set=mine
    ).tolist()
    out["alltoall"] = hvd.alltoall(
        torch.arange(mine.size(), dtype=torch.float32) + 10 * r, process_set=mine
    ).tolist()
    out["object"] = hvd.broadcast_object({0: (r, "x")}, root_rank=root, process_set=mine)
    out["objects"] = hvd.allgather_object(r, process_set=mine)
    hvd.barrier(process_set=mine)
    # the optimizer averages over the set only
    w = torch.nn.Parameter(torch.zeros(2))
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD([w], lr=1.0), named_parameters=[("w", w)], process_set=mine
    )
    (w * x).sum().backward()
    opt.step()
    out["step"] = w.tolist()
    errors = []
    other = odd if mine is even else even
    for attempt in (
        lambda: hvd.allreduce(x, process_set=other),  # a set this rank is not in
        lambda: hvd.allreduce(x, process_set=hvd.ProcessSet(mine.ranks)),  # never added
        lambda: hvd.broadcast(x, root_rank=other.ranks[0], process_set=mine),  # root outside
    ):
        started = time.monotonic()
        try:
            attempt()
            errors.append("no error")
        except hvd.GradmeshError as exc:
            errors.append(str(exc))
        assert time.monotonic() - started < NO_WAIT_S
    out["errors"] = errors
    out["removed"] = [hvd.remove_process_set(hvd.global_process_set), hvd.remove_process_set(odd)]
    try:
        hvd.allgather_object(r, process_set=odd)
        out["after_removal"] = "no error"
    except hvd.GradmeshError as exc:
        out["after_removal"] = str(exc)
    out["world_after"] = hvd.allreduce(x, op=hvd.Sum).tolist()
    return out


@pytest.mark.parametrize("world", WORLDS)
def test_process_sets_restrict_every_collective_and_the_optimizer(world: int) -> None:
    results = run_ranks(on_sets, world)
    sets = [[k for k in range(world) if k % 2 == p] for p in (0, 1)]
    for r, got in enumerate(results):
        ranks = sets[r % 2]
        n = len(ranks)
        total = sum(k + 1 for k in ranks)
        assert got["ids"] == [1, 2]
        assert got["set"] == [n, ranks.index(r), True, r % 2 == 0]
        assert got["allreduce"] == [total, 10.0 * n]
        assert got["grouped"] == [[total, 10.0 * n], [2.0 * total, 20.0 * n]]
        assert got["allgather"] == [[k + 1.0, 10.0] for k in ranks]
        assert got["broadcast"] == [ranks[-1] + 1.0, 10.0]
        full = [float(i * sum(k + 1 for k in ranks)) for i in range(4)]
        base, extra = divmod(4, n)
        me = ranks.index(r)
        start = me * base + min(me, extra)
        assert got["reducescatter"] == full[start : start + base + (me < extra)]
        assert got["alltoall"] == [float(me + 10 * k) for k in ranks]
        assert got["object"] == {0: (ranks[-1], "x")}
        assert got["objects"] == ranks
        # SGD lr 1 from zero: minus the set's average of x
        assert got["step"] == pytest.approx([-total / n, -10.0])
        assert "is not in process set" in got["errors"][0] and f"rank {r}:" in got["errors"][0]
        assert "unknown process set" in got["errors"][1]
        assert "root rank" in got["errors"][2] and "is not in the process set" in got["errors"][2]
        assert got["removed"] == [False, True]
        assert "unknown process set" in got["after_removal"]
        assert got["world_after"] == [sum(range(1, world + 1)), 10.0 * world]


def disagreeing_sets() -> list[str]:
    hvd.init()
    r = hvd.rank()
    said = []
    for ranks in (
        [0, r] if r else [0],
        [0, 0, 1] if r == 1 else [0, 1],
        [0, 7] if r == 0 else [0, 1],
    ):
        started = time.monotonic()
        try:
            hvd.add_process_set(ranks)
            said.append("no error")
        except hvd.GradmeshError as exc:
            said.append(str(exc))
        assert time.monotonic() - started < NO_WAIT_S
    return said


def test_bad_process_sets_are_one_error_on_every_rank() -> None:
    for r, said in enumerate(run_ranks(disagreeing_sets, 3)):
        assert said[0].startswith(f"rank {r}: add_process_set: the ranks disagree")
        assert "rank 0 gave [0]; rank 1 gave [0, 1]; rank 2 gave [0, 2]" in said[0]
        assert said[1].startswith(f"rank {r}: add_process_set: rank 1 gave bad ranks")
        assert said[2].startswith(f"rank {r}: add_process_set: rank 0 gave bad ranks")
        assert ("outside 0..2" in said[2]) == (r == 0)


def gradients(world: int) -> dict[str, float]:
    """For each collective: the largest difference between this rank's gradient through the
    drop-in and autograd's on one process holding every rank's input."""
    hvd.init()
    r = hvd.rank()

    def inputs() -> list[torch.Tensor]:
        return [
            (torch.arange(8, dtype=torch.float64).view(4, 2) + k).requires_grad_()
            for k in range(world)
        ]

    def loss(k: int, y: torch.Tensor) -> torch.Tensor:  # every rank's own loss
        return ((y * (k + 1)) ** 2).sum() + y.sum() * k

    rows = [k % 2 + 1 for k in range(world)]  # allgather: first dimensions differ
    splits = [[5 - world if j == k else 1 for j in range(world)] for k in range(world)]

    def gathered(xs: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([x[: rows[k]] for k, x in enumerate(xs)])

    def to_all(xs: list[torch.Tensor], k: int) -> torch.Tensor:  # rows rank k receives
        parts = []
        for j, x in enumerate(xs):
            start = sum(splits[j][:k])
            parts.append(x[start : start + splits[j][k]])
        return torch.cat(parts)

    cases = {
        # name: (drop-in on this rank's x, the same on one process for rank k, mean of losses?)
        "allreduce average": (
            lambda x: hvd.allreduce(x),
            lambda xs, k: torch.stack(xs).mean(0),
            False,
        ),
        "allreduce sum scaled": (
            lambda x: hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0),
            lambda xs, k: torch.stack(xs).sum(0) * 1.5,
            False,
        ),
        "grouped allreduce": (
            lambda x: torch.cat(hvd.grouped_allreduce([x[:1], x[1:]], op=hvd.Sum)),
            lambda xs, k: torch.stack(xs).sum(0),
            False,
        ),
        "allgather": (
            lambda x: hvd.allgather(x[: rows[r]]),
            lambda xs, k: gathered(xs),
            True,
        ),
        "broadcast": (
            lambda x: hvd.broadcast(x, root_rank=1),
            lambda xs, k: xs[1],
            True,
        ),
        "alltoall": (
            lambda x: hvd.alltoall(x, splits=splits[r])[0],
            to_all,
            False,
        ),
        "reducescatter average": (
            lambda x: hvd.reducescatter(x),
            lambda xs, k: torch.stack(xs).mean(0)[_block(4, world, k)],
            False,
        ),
        "reducescatter sum": (
            lambda x: hvd.reducescatter(x, op=hvd.Sum),
            lambda xs, k: torch.stack(xs).sum(0)[_block(4, world, k)],
            False,
        ),
    }
    worst = {}
    for name, (dropin, reference, mean) in cases.items():
        xs = inputs()
        loss(r, dropin(xs[r])).backward()
        ref = inputs()
        total = sum(loss(k, reference(ref, k)) for k in range(world))
        (total / world if mean else total).backward()
        assert xs[r].grad is not None
        expected = torch.zeros_like(xs[r]) if ref[r].grad is None else ref[r].grad
        if name.startswith("reducescatter"):  # Horovod's convention: the allgathered gradient,
            expected = expected * world  # times the set's size for Sum: world x the true one
        worst[name] = float((xs[r].grad - expected).abs().max())
    return worst


def _block(n: int, world: int, k: int) -> slice:
    base, extra = divmod(n, world)
    start = k * base + min(k, extra)
    return slice(start, start + base + (k < extra))


@pytest.mark.parametrize("world", WORLDS)
def test_gradients_flow_through_the_collectives_as_horovod_defines_them(world: int) -> None:
    for got in run_ranks(gradients, world, world):
        assert got == {name: pytest.approx(0.0, abs=1e-9) for name in got}, got


def names_and_cycles() -> dict[str, Any]:
    hvd.init()
    hvd.init()  # a second call changes nothing
    r = hvd.rank()
    x = torch.ones(2)
    hold, running = threading.Event(), threading.Event()

    def held(*_: Any) -> None:  # keeps the coordinator's thread busy: "loss" stays in flight
        running.set()
        hold.wait(30)

    submit(hvd.global_process_set, "barrier", header(BARRIER), "hold", held)
    running.wait(30)
    first = hvd.allreduce_async(x, name="loss", op=hvd.Sum)
    started = time.monotonic()
    try:
        hvd.allgather_async(x, name="loss")
        clash = "no error"
    except ValueError as exc:  # Horovod's type; gradmesh's one-line error is one too
        clash = str(exc) if isinstance(exc, hvd.GradmeshError) else f"not gradmesh's: {exc}"
    out: dict[str, Any] = {"clash": clash, "fast": time.monotonic() - started < 5}
    hold.set()
    out["first"] = hvd.synchronize(first).tolist()
    mismatched = []
    for attempt in (
        lambda: hvd.allreduce(torch.ones(2 + r)),  # shapes differ across ranks
        lambda: hvd.grouped_allreduce(
            [torch.ones(2), torch.ones(1, dtype=torch.float32 if r else torch.float64)]
        ),
        lambda: hvd.broadcast(torch.ones(2, 1 + r), root_rank=0),
    ):
        try:
            attempt()
            mismatched.append("no error")
        except hvd.GradmeshError as exc:
            mismatched.append(str(exc))
    out["mismatched"] = mismatched
    out["reused"] = hvd.allreduce(x, name="loss", op=hvd.Sum).tolist()
    cycles = []
    for _ in range(3):  # Horovod's shutdown / init cycle, then a collective on the new world
        hvd.shutdown()
        cycles.append(hvd.is_initialized())
        hvd.init()
        cycles.append(hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum).item())
    out["cycles"] = cycles
    return out


@pytest.mark.parametrize("world", WORLDS)
def test_names_in_flight_are_unique_and_init_shutdown_cycles_work(world: int) -> None:
    for r, got in enumerate(run_ranks(names_and_cycles, world)):
        assert got["clash"] == f"rank {r}: an operation named 'loss' is still in flight on " + (
            "the global process set; synchronize it before starting another of that name"
        )
        assert got["fast"]
        for said in got["mismatched"]:  # on every rank, naming both ranks' tensors
            assert said.startswith(f"rank {r}: ") and "\n" not in said
            assert "the ranks called different operations: rank 0: " in said
            assert "; rank 1: " in said
        assert got["first"] == got["reused"] == [float(world)] * 2
        assert got["cycles"] == [False, float(sum(range(world)))] * 3


def elastic_state() -> dict[str, Any]:
    hvd.init()
    r = hvd.rank()
    torch.manual_seed(r)  # the replicas start different: sync gives them rank 0's
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler = hvd.elastic.ElasticSampler(list(range(10)), shuffle=False)
    state = hvd.elastic.TorchState(model, opt, epoch=r, batch=0, sampler=sampler)
    seen: dict[str, Any] = {}

    @hvd.elastic.run
    def train(state: Any) -> None:
        seen["synced"] = hvd.allgather_object([state.epoch, model.weight.tolist()])
        seen["mine"] = list(iter(sampler))
        sampler.record_batch(0, 2)
        state.batch = 1
        state.commit()
        before = model.weight.detach().clone()
        model(torch.ones(3, 2)).sum().backward()
        opt.step()
        state.batch = 2
        state.restore()
        seen["restored"] = [state.batch, torch.equal(model.weight, before)]
        state.sync()
        sampler.reset()
        seen["left"] = list(iter(sampler))

    train(state)
    return seen


def test_elastic_state_syncs_commits_and_restores_with_its_sampler() -> None:
    results = run_ranks(elastic_state, 2)
    for got in results:
        assert got["synced"][0] == got["synced"][1]  # rank 0's epoch and weights everywhere
        assert got["synced"][0][0] == 0
        assert got["restored"] == [1, True]
    assert results[0]["mine"] == [0, 2, 4, 6, 8] and results[1]["mine"] == [1, 3, 5, 7, 9]
    # both ranks' first batch (0, 2 and 1, 3) is done: the rest is shared out again
    assert results[0]["left"] == [4, 6, 8] and results[1]["left"] == [5, 7, 9]


def elastic_failure() -> list[Any]:
    from gradmesh.errors import PeerFailure

    hvd.init()
    model = torch.nn.Linear(2, 1)
    state = hvd.elastic.TorchState(model, None, batch=0)

    @hvd.elastic.run
    def train(state: Any) -> None:
        state.batch = 5
        state.commit()
        committed = model.weight.detach().clone()
        state.batch = 9
        with torch.no_grad():
            model.weight.add_(1.0)
        state.committed = committed
        raise PeerFailure("rank 0: native allreduce #3 on world: rank 1 left")

    try:
        train(state)
    except PeerFailure as exc:
        return [str(exc), state.batch, torch.equal(model.weight, state.committed)]
    return ["no error"]


def test_a_lost_worker_in_elastic_run_restores_the_commit_and_says_what_is_missing() -> None:
    (said, batch, restored), *_ = run_ranks(elastic_failure, 1)
    assert said.startswith("rank 0: native allreduce #3 on world: rank 1 left (recovering")
    assert "issue 15" in said and "the last commit was restored" in said
    assert batch == 5 and restored


def test_compression_objects_have_horovods_interface() -> None:
    t = torch.linspace(-3, 3, 7)
    half, ctx = hvd.Compression.fp16.compress(t)
    assert half.dtype == torch.float16 and ctx == torch.float32
    back = hvd.Compression.fp16.decompress(half, ctx)
    assert back.dtype == torch.float32 and torch.allclose(back, t, atol=2e-3)
    ids = torch.arange(5)
    assert hvd.Compression.fp16.decompress(*hvd.Compression.fp16.compress(ids)).equal(ids)
    same, none_ctx = hvd.Compression.none.compress(t)
    assert same is t and hvd.Compression.none.decompress(same, none_ctx) is t


class Doubled:
    """A script's own compressor, Horovod style: two static methods."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor * 2, "doubled"

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        assert ctx == "doubled"
        return tensor / 2


def own_compressor() -> list[list[float]]:
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 2)
    grads = []
    for compression in (Doubled, hvd.Compression.fp16, hvd.Compression.none):
        model = torch.nn.Linear(3, 2)
        model.load_state_dict(layer.state_dict())
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            model.named_parameters(),
            compression=compression,
        )
        x = torch.full((4, 3), float(hvd.rank() + 1))
        model(x).sum().backward()
        opt.synchronize()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]).tolist())
    return grads


def test_a_scripts_own_compressor_class_works_in_the_optimizer() -> None:
    for doubled, fp16, plain in run_ranks(own_compressor, 2):
        assert doubled == pytest.approx(plain, rel=1e-6)
        assert fp16 == pytest.approx(plain, rel=1e-3)


def unnamed_and_objects() -> dict[str, Any]:
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    sent = {"ranks": {0, 1}, "pair": (1, "a"), "frozen": frozenset({b"x"}), "rank": hvd.rank()}
    return {
        "names": [opt._parameter_names[p] for p in model.parameters()],  # type: ignore[attr-defined]
        "broadcast": hvd.broadcast_object(sent, root_rank=1),
        "gathered": hvd.allgather_object({hvd.rank()}),
    }


def test_unnamed_parameters_get_horovods_names_and_objects_keep_their_types() -> None:
    results = run_ranks(unnamed_and_objects, 2)
    for got in results:
        assert got["names"] == [f"allreduce.noname.{i}" for i in range(4)]
        assert got["broadcast"] == {
            "ranks": {0, 1},
            "pair": (1, "a"),
            "frozen": frozenset({b"x"}),
            "rank": 1,
        }
        assert type(got["broadcast"]["frozen"]) is frozenset
        assert got["gathered"] == [{0}, {1}]
