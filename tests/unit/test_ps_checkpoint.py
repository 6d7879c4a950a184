"""A parameter server's part of a checkpoint: its shard, its optimizer and its version written
as a rank file and read back whole, a malformed part refused in one line (or fallen back from),
and a sync step whose result does not depend on the order its gradients arrived in."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from gradmesh.errors import GradmeshError
from gradmesh.sync.parameter_server.protocol import Kind, Message
from gradmesh.sync.parameter_server.server import Server
from gradmesh.sync.parameter_server.serving import ServerConfig
from gradmesh.train import checkpoint
from gradmesh.train.checkpoint import ShardFolder
from gradmesh.train.config import TrainConfig

TOKEN = bytes(16)
NUMEL = 10


@contextmanager
def server(workers: int = 2, **options: object) -> Iterator[Server]:
    config = ServerConfig.of(0, workers, NUMEL, mode="sync", **options)
    made = Server(config, TOKEN, "127.0.0.1")
    try:
        yield made
    finally:
        made.close()


def push(target: Server, worker: int, grad: torch.Tensor) -> None:
    target._push(Message(Kind.PUSH, worker, clock=target.version + 1, payload=grad))


def trained(target: Server, steps: int) -> None:
    """`steps` sync steps of two workers from a seeded start."""
    torch.manual_seed(0)
    with torch.no_grad():
        target.values.copy_(torch.randn(NUMEL))
    target.initialized = True
    for _ in range(steps):
        push(target, 0, torch.randn(NUMEL))
        push(target, 1, torch.randn(NUMEL))


def complete(folder: Path, config: TrainConfig, step: int, state: dict[str, object]) -> None:
    """A checkpoint of one server (part 0) and one worker (part 1, the metadata's writer)."""
    ShardFolder(str(folder), config.identity()).save(0, step, state)
    worker = checkpoint.Checkpointer(str(folder), 1, 2, config.identity(), 3, False, 5, writer=1)
    rank_state = {**state, "model": {}, "optimizer": {}}
    worker.save(step, 0, step, [], 0, rank_state)
    worker.close()


@pytest.mark.parametrize("optimizer", ["sgd", "adarevision"])
def test_a_shard_resumes_whole_from_its_part(tmp_path: Path, optimizer: str) -> None:
    config = TrainConfig.of(strategy="ps", mode="sync", checkpoint_dir=str(tmp_path))
    with server(optimizer=optimizer, momentum=0.9) as first:
        trained(first, 3)
        complete(tmp_path, config, first.version, first.state_dict())
        trained_on = first.values.detach().clone()
        push(first, 0, torch.ones(NUMEL))  # one more step, compared below
        push(first, 1, torch.ones(NUMEL))
        expected = first.values.detach().clone()
    with server(optimizer=optimizer, momentum=0.9) as second:
        ShardFolder(str(tmp_path), config.identity()).restore(second)
        assert second.version == 3 and second.initialized
        assert torch.equal(second.values.detach(), trained_on)
        push(second, 0, torch.ones(NUMEL))
        push(second, 1, torch.ones(NUMEL))
        # the optimizer's state (momentum, AdaRevision's accumulators) came back too
        assert torch.equal(second.values.detach(), expected)


def test_a_malformed_part_is_one_line_or_fallen_back_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = TrainConfig.of(strategy="ps", mode="sync", checkpoint_dir=str(tmp_path))
    with server() as first:
        trained(first, 2)
        good = first.state_dict()
        complete(tmp_path, config, 2, good)
        complete(tmp_path, config, 4, {**good, "model": {"values": torch.zeros(NUMEL + 1)}})
    with server() as second:
        ShardFolder(str(tmp_path), config.identity()).restore(second)
        assert second.version == 2
    err = capsys.readouterr().err
    assert "rank-00000.pt does not fit this run: the shard's 'values' are not 10 numbers" in err
    assert "falling back to step-00000002" in err
    checkpoint.write_part(tmp_path, 2, 0, {**good, "strategy": {"version": -1}})
    with server() as third, pytest.raises(GradmeshError) as raised:
        ShardFolder(str(tmp_path), config.identity()).restore(third)
    assert "step-00000002/rank-00000.pt does not fit this run" in str(raised.value)
    assert "no earlier complete checkpoint" in str(raised.value)
    assert third.version == 0 and not third.initialized  # nothing half-loaded


def test_a_sync_step_does_not_depend_on_the_order_its_gradients_arrive_in() -> None:
    # in float32, (1e8 + 1) - 1e8 is 0 and (1e8 - 1e8) + 1 is 1: summing as they arrive would
    # make the step depend on the network
    grads = [torch.full((NUMEL,), v) for v in (1e8, -1e8, 1.0)]
    results = []
    for order in ([0, 1, 2], [0, 2, 1], [2, 0, 1]):
        with server(workers=3, lr=1.0) as target:
            target.initialized = True
            for w in order:
                push(target, w, grads[w])
            assert target.version == 1
            results.append(target.values.detach().clone())
    assert all(torch.equal(results[0], r) for r in results)
    assert torch.equal(results[0], torch.full((NUMEL,), -1 / 3))
