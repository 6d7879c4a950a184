"""Every compressor trains the real digits data on every path that carries it: synchronous
allreduce (2 workers on gradmesh's ring, 3 on the backend's own), local SGD's averaging, the
parameter server's push (sync mode), the DDP comm hook; and error feedback is what makes the
biased ones (top-k 1%, sign) work."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradmesh
from gradmesh.compression.registry import COMPRESSORS, make
from gradmesh.data import GlobalBatchSharder
from gradmesh.data.digits import load_digits
from gradmesh.data.registry import DataOptions
from gradmesh.models.registry import MODELS
from gradmesh.sync.local_sgd import Averager, LocalSGDOptimizer
from gradmesh.sync.parameter_server.roles import WorkerRole
from gradmesh.sync.parameter_server.worker import PSWorker
from tests.distributed.test_parameter_server import ENV, servers
from tests.harness import run_ranks

NAMES = [n for n in COMPRESSORS.names() if n != "none"]  # "none" is trained elsewhere
EPOCHS = 30
"""Enough for every compressor on every path."""
SYNC_EPOCHS = 20
"""3 workers on the backend's allreduce, the sync parameter server and local SGD: every
compressor trains by then, except top-k on gradmesh's ring with 2 workers and local SGD's
PowerSGD averaging, which keep EPOCHS."""
UNBIASED_EPOCHS = 10
"""Synchronous allreduce: the unbiased compressors train by then; the biased ones (sign, top-k,
which lean on error feedback) train longer."""
BATCH = 64
TARGET = 0.90
"""Test accuracy that shows a compressor trains (chance is 0.10; a compressor that breaks the
reduction leaves the model near it). Measured over seeds 0-5 of the model and the data order
(the spread another CPU's rounding or thread count moves a run within), every compressor on the
allreduce and local-SGD paths reached 0.930-0.978, the lowest the unbiased ones after
UNBIASED_EPOCHS on seed 1: the target keeps 3 points (11 of the 360 test images) below the
lowest. The old target, 0.95, failed on AMD EPYC for PowerSGD under local SGD (0.947)."""


def model() -> nn.Module:
    torch.manual_seed(0)
    return MODELS.get("mlp")((1, 8, 8), 10)


def train_digits(
    net: nn.Module, opt: torch.optim.Optimizer, epochs: int = EPOCHS, loss: bool = False
) -> Any:
    """Train on this rank's share of each global batch; the final model's test accuracy (and,
    with `loss`, its mean loss on the whole training set)."""
    rank, world = gradmesh.rank(), gradmesh.size()
    data = load_digits(DataOptions())
    sharder = GlobalBatchSharder(len(data.train.y), BATCH, rank, world, seed=1)
    for epoch in range(epochs):
        for idx, count in sharder.batches(epoch):
            opt.zero_grad()
            total = F.cross_entropy(net(data.train.x[idx]), data.train.y[idx], reduction="sum")
            (total * world / count).backward()
            opt.step()
    with torch.no_grad():
        accuracy = float((net(data.test.x).argmax(1) == data.test.y).float().mean())
        train_loss = float(F.cross_entropy(net(data.train.x), data.train.y))
    return (accuracy, train_loss) if loss else accuracy


def every_compressor(
    make_opt: Callable[[nn.Module, str], torch.optim.Optimizer],
    epochs: int = EPOCHS,
    longer: dict[str, int] | None = None,
) -> dict:
    """{compressor: (test accuracy, the final parameters)}; `longer`: compressors that train for
    more epochs than `epochs`."""
    results = {}
    for name in NAMES:
        net = model()
        accuracy = train_digits(net, make_opt(net, name), (longer or {}).get(name, epochs))
        results[name] = (accuracy, [p.detach().clone() for p in net.parameters()])
    return results


def check(results: list[dict], agree: bool = True) -> None:
    """Every replica ends with the same parameters (where `agree`: local SGD's drift apart
    between averages), at or above the target accuracy."""
    for name, (_, params) in results[0].items() if agree else ():
        for other in results[1:]:
            assert all(torch.equal(a, b) for a, b in zip(params, other[name][1], strict=True))
    low = {n: a for n, (a, _) in results[0].items() if a < TARGET}
    assert not low, f"below {TARGET}: {low}"


def allreduce_run(algorithm: str, biased_epochs: int) -> dict[str, float]:
    def make_opt(net: nn.Module, name: str) -> torch.optim.Optimizer:
        sgd = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        return gradmesh.DistributedOptimizer(
            sgd, net.named_parameters(), allreduce=algorithm, compression=make(name)
        )

    biased = {"sign": biased_epochs, "topk": biased_epochs}
    return every_compressor(make_opt, UNBIASED_EPOCHS, biased)


@pytest.mark.parametrize(
    ("world", "algorithm", "biased_epochs"), [(2, "ring", EPOCHS), (3, "native", SYNC_EPOCHS)]
)
def test_every_compressor_trains_digits_with_allreduce(
    world: int, algorithm: str, biased_epochs: int
) -> None:
    check(run_ranks(allreduce_run, world, algorithm, biased_epochs, timeout=240))


def local_sgd_run() -> dict[str, float]:
    def make_opt(net: nn.Module, name: str) -> torch.optim.Optimizer:
        sgd = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        averager = Averager(list(net.parameters()), sync_every=4, compressor=make(name))
        return LocalSGDOptimizer(sgd, averager)

    return every_compressor(make_opt, SYNC_EPOCHS, {"powersgd": EPOCHS})


def test_every_compressor_trains_digits_with_local_sgd() -> None:
    check(run_ranks(local_sgd_run, 2, timeout=240), agree=False)


def ps_run(ports: list[int], name: str) -> float:
    # a shard is one flat range, folded into a near-square matrix: PowerSGD needs a higher rank
    # there than on a model's own weight matrices
    compressor = make(name, rank=4)
    rank, world = gradmesh.rank(), gradmesh.size()
    net = model()
    sgd = torch.optim.SGD(net.parameters(), lr=0.1)  # the servers hold the real optimizer
    role = WorkerRole(rank, world, "127.0.0.1", ports[0])
    worker = PSWorker(role, 2, 1, 1, timeout_s=30, compressor=compressor)
    accuracy = train_digits(net, worker.attach(net, sgd), SYNC_EPOCHS)
    worker.finish(samples=0, wall_s=1.0)
    return accuracy


@pytest.mark.parametrize("name", NAMES)
def test_every_compressor_trains_digits_on_the_parameter_server(name: str) -> None:
    numel = sum(p.numel() for p in model().parameters())
    options: dict[str, Any] = {"mode": "sync", "lr": 0.1, "momentum": 0.9}
    with servers(2, 2, numel, **options) as (port, stats):
        results = run_ranks(ps_run, 2, [port], name, timeout=120, extra_env=ENV)
    assert min(results) >= TARGET, results
    decoded = sum(s["decompressed_pushes"] for s in stats)
    assert stats and sum(s["dropped_messages"] for s in stats) == 0
    assert decoded > 0  # the pushes travelled compressed


def ddp_run(name: str) -> float:
    net = model()
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    ddp.register_comm_hook(None, gradmesh.ddp_comm_hook(allreduce="ring", compression=make(name)))
    return train_digits(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9))


@pytest.mark.parametrize("name", ["int8", "powersgd"])
def test_the_ddp_hook_trains_digits_compressed(name: str) -> None:
    results = run_ranks(ddp_run, 2, name, timeout=120)
    assert results[0] == results[1] and results[0] >= TARGET


def error_feedback_run(name: str) -> dict[str, tuple[float, float]]:
    out = {}
    for feedback in ("on", "off"):
        net = model()
        sgd = torch.optim.SGD(net.parameters(), lr=0.1)  # plain SGD, where the theory is stated
        compressor = make(name, ratio=0.01, error_feedback=feedback)
        opt = gradmesh.DistributedOptimizer(sgd, net.named_parameters(), compression=compressor)
        out[feedback] = train_digits(net, opt, epochs=6, loss=True)
    return out


@pytest.mark.parametrize("name", ["topk", "sign"])
def test_error_feedback_is_what_makes_biased_compressors_train(name: str) -> None:
    result = run_ranks(error_feedback_run, 2, name, timeout=120)[0]
    (_, loss_on), (_, loss_off) = result["on"], result["off"]
    # the theory's claim is about the objective: without error feedback training stalls. Over
    # seeds 0-5 the training loss came out 2.11-2.69x higher without it (1.5 keeps a wide
    # margin); test accuracy moved less (sign: 1.7-5.3 points better with it), too little to
    # assert on every CPU
    assert loss_off > 1.5 * loss_on, result


def encode_on_rank_zero_only() -> bool:
    compressor = make("powersgd", rank=2)
    state = compressor.new_state(900)
    if gradmesh.rank() == 0:  # a push is one rank's message: no collective may run inside it
        payload, ctx = compressor.encode(torch.randn(900), state)
        out = torch.zeros(900)
        compressor.decode(payload, ctx, out)
        return bool(out.abs().sum() > 0)
    return True


def test_a_parameter_server_message_is_made_without_the_other_ranks() -> None:
    # PowerSGD's power step on a push once ran an allreduce over the world: it hung any rank
    # that pushed when its peers did not (async mode)
    assert run_ranks(encode_on_rank_zero_only, 2, timeout=30) == [True, True]
