"""Parameter servers over real ZeroMQ sockets: servers in threads of the test process, workers in
real gloo ranks. sync equals synchronous allreduce training; ssp bounds the staleness."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import TCPStore  # type: ignore[attr-defined]

import gradmesh
from gradmesh.sync.parameter_server.client import shard_ranges
from gradmesh.sync.parameter_server.roles import WorkerRole, key
from gradmesh.sync.parameter_server.server import Server
from gradmesh.sync.parameter_server.serving import ServerConfig
from gradmesh.sync.parameter_server.worker import PSWorker
from tests.distributed.sgd_steps import cnn, run_steps
from tests.harness import run_ranks

TOKEN_HEX = "ab" * 16
ENV = {"GRADMESH_JOB_TOKEN": TOKEN_HEX}
STEPS = 10
LR = 0.1


@contextmanager
def servers(count: int, workers: int, numel: int, **options: Any) -> Iterator[tuple[int, list]]:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store.set(key("numel"), str(numel))
    stats: list[dict[str, Any]] = []
    threads = []
    for i, (a, b) in enumerate(shard_ranges(numel, count)):
        config = ServerConfig.of(i, workers, b - a, timeout_s=30, **options)
        server = Server(config, bytes.fromhex(TOKEN_HEX), "127.0.0.1")
        store.set(key(f"server{i}"), server.endpoint)
        thread = threading.Thread(target=lambda s=server: stats.append(s.serve()), daemon=True)
        thread.start()
        threads.append(thread)
    yield store.port, stats
    for thread in threads:
        thread.join(timeout=30)
        assert not thread.is_alive(), "a server did not stop after its workers closed it"


def ps_steps(port: int, count: int, momentum: float) -> tuple[list[torch.Tensor], bool]:
    rank, world = gradmesh.rank(), gradmesh.size()
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=LR)  # the servers hold the real optimizer
    worker = PSWorker(WorkerRole(rank, world, "127.0.0.1", port), count, 1, 1, timeout_s=30)
    opt = worker.attach(model, opt)
    params = run_steps(model, opt, 48, rank, world, STEPS)
    worker.finish(samples=0, wall_s=1.0)
    return params, worker.reporter


@pytest.mark.parametrize(("count", "momentum"), [(1, 0.0), (3, 0.9)])
def test_sync_mode_equals_synchronous_allreduce(count: int, momentum: float) -> None:
    reference_model = cnn()
    reference_opt = torch.optim.SGD(reference_model.parameters(), lr=LR, momentum=momentum)
    reference = run_steps(reference_model, reference_opt, 48, 0, 1, STEPS)
    numel = sum(p.numel() for p in cnn().parameters())
    with servers(count, 2, numel, mode="sync", lr=LR, momentum=momentum) as (port, stats):
        results = run_ranks(ps_steps, 2, port, count, momentum, extra_env=ENV)
    assert sorted(r for _, r in results) == [False, True]  # exactly one reporter
    for params, _ in results:
        for got, want in zip(params, reference, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert len(stats) == count
    for s in stats:  # every gradient of sync is fresh
        assert all(set(h) == {"0"} for h in s["staleness"].values())
        assert s["dropped_messages"] == 0 and s["lost_workers"] == []


def uneven_steps(port: int, steps: int) -> dict[str, Any]:
    """Worker r sleeps r x 4 ms per step: the fast ones run ahead of the slow one."""
    rank, world = gradmesh.rank(), gradmesh.size()
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    worker = PSWorker(WorkerRole(rank, world, "127.0.0.1", port), 1, 1, 1, timeout_s=30)
    opt = worker.attach(model, opt)
    x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
        opt.step()
        time.sleep(0.004 * rank)
    worker.finish(samples=steps * 16, wall_s=1.0)
    return worker.report() if worker.reporter else {}


@pytest.mark.parametrize("mode", ["ssp", "async"])
def test_ssp_bounds_the_staleness_async_does_not(mode: str) -> None:
    k = 2
    with servers(1, 3, 8 * 2 + 2, mode=mode, max_staleness=k, lr=0.01) as (port, stats):
        reports = run_ranks(uneven_steps, 3, port, 40, extra_env=ENV)
    (report,) = [r for r in reports if r]
    histogram = report["staleness_histogram"]
    assert set(histogram) == {"0", "1", "2"}  # every worker's gradients are recorded
    assert sum(sum(h.values()) for h in histogram.values()) == 3 * 40
    worst = max(int(s) for h in histogram.values() for s in h)
    if mode == "ssp":
        assert worst <= k
    else:
        assert worst > k  # without the bound the fast workers run far ahead
    assert stats[0]["requests"]["push"] == 3 * 40
