"""The process world on real gloo ranks: identities, host groups, broadcast, timeouts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import gradmesh
from gradmesh.collectives import allreduce, broadcast
from gradmesh.launch.ports import free_port
from tests.harness import run_ranks


def identity() -> tuple[int, int, int, int, int, int]:
    return (
        gradmesh.rank(),
        gradmesh.size(),
        gradmesh.local_rank(),
        gradmesh.local_size(),
        gradmesh.cross_rank(),
        gradmesh.cross_size(),
    )


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_identity_on_one_host(world: int) -> None:
    got = run_ranks(identity, world)
    assert got == [(r, world, r, world, 0, 1) for r in range(world)]


def test_two_hosts_of_two_have_local_and_cross_groups() -> None:
    got = run_ranks(identity, 4, local_size=2)
    # ranks 0,1 on host 0 and 2,3 on host 1: cross rank is the host index
    assert got == [(0, 4, 0, 2, 0, 2), (1, 4, 1, 2, 0, 2), (2, 4, 0, 2, 1, 2), (3, 4, 1, 2, 1, 2)]


def sums_in_groups() -> tuple[float, float]:
    rt = gradmesh.get_runtime()
    local = torch.tensor([float(rt.rank)])
    allreduce(local, group=rt.local_group)
    cross = torch.tensor([float(rt.rank)])
    allreduce(cross, group=rt.cross_group)
    return float(local), float(cross)


def test_host_groups_reduce_only_their_members() -> None:
    got = run_ranks(sums_in_groups, 4, local_size=2)
    # host sums: 0+1, 2+3; cross sums (same local rank): 0+2, 1+3
    assert got == [(1.0, 2.0), (1.0, 4.0), (5.0, 2.0), (5.0, 4.0)]


def broadcast_seeded_model() -> list[torch.Tensor]:
    torch.manual_seed(100 + gradmesh.rank())  # every rank starts different
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.BatchNorm1d(3))
    model.state_dict()["1.num_batches_tracked"].fill_(7 * gradmesh.rank())
    gradmesh.broadcast_parameters(model.state_dict(), root_rank=1)
    return [t.clone() for t in model.state_dict().values()]


@pytest.mark.parametrize("world", [2, 3])
def test_broadcast_parameters_gives_root_state_everywhere(world: int) -> None:
    states = run_ranks(broadcast_seeded_model, world)
    for state in states:
        for got, want in zip(state, states[1], strict=True):
            assert torch.equal(got, want)
    assert not torch.equal(states[0][0], _seeded_weight(0))  # rank 0 really was overwritten
    assert torch.equal(states[0][0], _seeded_weight(1))


def _seeded_weight(rank: int) -> torch.Tensor:
    torch.manual_seed(100 + rank)
    return torch.nn.Linear(5, 3).weight.detach()


def reduce_kinds() -> tuple[list[float], list[int], list[float]]:
    r = gradmesh.rank()
    avg = torch.arange(6, dtype=torch.float64).reshape(2, 3).t() * (r + 1)  # non-contiguous
    allreduce(avg, op="average")
    ints = torch.tensor([r, 10 * r], dtype=torch.int64)
    allreduce(ints)
    root = torch.full((3,), float(r))
    broadcast(root, root=gradmesh.size() - 1)
    return avg.flatten().tolist(), ints.tolist(), root.tolist()


def test_allreduce_average_sum_and_broadcast() -> None:
    got = run_ranks(reduce_kinds, 3)
    mean_factor = (1 + 2 + 3) / 3
    want_avg = [v * mean_factor for v in torch.arange(6.0).reshape(2, 3).t().flatten().tolist()]
    for avg, ints, root in got:
        assert avg == pytest.approx(want_avg)
        assert ints == [3, 30]
        assert root == [2.0, 2.0, 2.0]


def count_bytes() -> int:
    before = gradmesh.get_runtime().comm.bytes_sent
    allreduce(torch.zeros(1000))
    return gradmesh.get_runtime().comm.bytes_sent - before


def test_native_allreduce_counts_ring_volume() -> None:
    assert run_ranks(count_bytes, 4) == [2 * 3 * 4000 // 4] * 4


def test_world_of_one_without_launcher() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    code = (
        "import gradmesh, torch\n"
        "rt = gradmesh.init()\n"
        "t = torch.ones(3); gradmesh.broadcast_parameters({'t': t})\n"
        "print(gradmesh.rank(), gradmesh.size(), rt.backend)\n"
        "gradmesh.shutdown()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.split() == ["0", "1", "gloo"]


def test_unreachable_master_fails_within_timeout_naming_it() -> None:
    port = free_port()
    env = {
        **os.environ,
        "RANK": "1",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "GRADMESH_TIMEOUT_S": "2",
        "TORCH_CPP_LOG_LEVEL": "FATAL",
    }
    code = (
        "import sys, gradmesh\n"
        "try:\n    gradmesh.init()\n"
        "except gradmesh.GradmeshError as e:\n    print(e); sys.exit(3)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 3, out.stderr
    assert f"master 127.0.0.1:{port}" in out.stdout
    assert "rank 1" in out.stdout


def failing_rank() -> None:
    if dist.get_rank() == 1:
        raise ValueError("boom on purpose")


def test_harness_surfaces_the_failing_rank() -> None:
    with pytest.raises(AssertionError, match=r"rank 1 of 2 failed:(.|\n)*boom on purpose"):
        run_ranks(failing_rank, 2, timeout=20)


def groups_left_after_shutdown() -> tuple[int, int, str]:
    """Weak references to every process group a job holds, taken before `shutdown()`."""
    import weakref

    from gradmesh.errors import GradmeshError
    from gradmesh.runtime.world import resolve_world, shutdown

    rt = gradmesh.get_runtime()
    model = torch.nn.Linear(4, 2)
    opt = gradmesh.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    groups = [resolve_world(), rt.async_group, rt.local_group, rt.cross_group, *rt.owned]
    refs = [weakref.ref(g) for g in groups if g is not None]
    del groups
    shutdown()
    try:
        opt.step()
        error = ""
    except GradmeshError as exc:
        error = str(exc)
    return len(refs), [i for i, r in enumerate(refs) if r() is not None], error


def test_shutdown_frees_every_group_while_the_job_still_holds_its_optimizer() -> None:
    # a group kept alive into interpreter exit keeps its Gloo threads, and one of them releasing
    # a finished call's tensors while Python finalizes aborted the process ("terminate called")
    got = run_ranks(groups_left_after_shutdown, 2)
    for made, alive, _ in got:
        assert made >= 3 and alive == []
    assert got[1][2] == "rank 1: DistributedOptimizer used after gradmesh.shutdown()"
