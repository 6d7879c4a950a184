"""Sparse gradients through the Horovod drop-in on 2 ranks: an `nn.Embedding(sparse=True)`
trains under SparseAdam with its gradient kept sparse from the first step (only the rows a rank
touched travel), or densified to travel with `sparse_as_dense=True` and made sparse again for
the optimizer (as Horovod's), each equal to one process over the same samples; and
`sparse_allreduce_async` equals a dense allreduce."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import gradmesh.horovod as hvd
from gradmesh.runtime.world import get_runtime
from tests.harness import run_ranks

ROWS, DIM, STEPS = 1000, 8, 5


def _batch(r: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * r + i)
    return torch.randint(0, ROWS, (6, 3), generator=g), torch.randn(6, generator=g)


def _loss(table: torch.nn.Embedding, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((table(ids).sum(dim=(1, 2)) - y) ** 2).mean()


def _model(sparse_as_dense: bool) -> tuple[torch.nn.Embedding, torch.optim.Optimizer]:
    torch.manual_seed(0)
    table = torch.nn.Embedding(ROWS, DIM, sparse=True)
    # SparseAdam takes only sparse gradients; a densified gradient needs a dense optimizer
    inner = (
        torch.optim.SGD(table.parameters(), lr=0.05)
        if sparse_as_dense
        else torch.optim.SparseAdam(table.parameters(), lr=0.05)
    )
    return table, inner


def embedding(sparse_as_dense: bool) -> dict[str, Any]:
    hvd.init()
    table, inner = _model(sparse_as_dense)
    opt = hvd.DistributedOptimizer(
        inner, named_parameters=table.named_parameters(), sparse_as_dense=sparse_as_dense
    )
    sparse, sent = [], get_runtime().comm.bytes_sent
    for i in range(STEPS):
        opt.zero_grad()
        _loss(table, *_batch(hvd.rank(), i)).backward()
        opt.step()
        sparse.append(table.weight.grad.is_sparse)
    return {
        "weight": table.weight.detach(),
        "sparse": sparse,
        "sent": get_runtime().comm.bytes_sent - sent,
    }


@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_a_sparse_embedding_trains_as_one_process_sparse_or_densified(
    sparse_as_dense: bool,
) -> None:
    results = run_ranks(embedding, 2, sparse_as_dense)
    table, inner = _model(sparse_as_dense)
    for i in range(STEPS):
        inner.zero_grad()
        ((_loss(table, *_batch(0, i)) + _loss(table, *_batch(1, i))) / 2).backward()
        inner.step()
    dense_bytes = STEPS * ROWS * DIM * 4  # a dense allreduce of the table each step, at least
    for got in results:
        assert torch.allclose(got["weight"], table.weight.detach(), atol=1e-6)
        assert got["sparse"] == [True] * STEPS
        if sparse_as_dense:
            assert got["sent"] >= dense_bytes
        else:  # 18 rows of 8 floats and their indices a step: far below the table's bytes
            assert got["sent"] < dense_bytes / 10


def sparse_allreduce() -> list[Any]:
    hvd.init()
    r = hvd.rank()
    rows = torch.tensor([[0, 3, 3]]) if r == 0 else torch.tensor([[3, 7]])
    values = torch.arange(len(rows[0]) * 2, dtype=torch.float32).view(-1, 2) + 10 * r
    tensor = torch.sparse_coo_tensor(rows, values, (9, 2))
    out = []
    for op in (hvd.Sum, hvd.Average):
        reduced = hvd.synchronize(hvd.sparse_allreduce_async(tensor, f"s.{op}", op))
        dense = hvd.allreduce(tensor.to_dense(), op=op)
        out.append([reduced.is_sparse, torch.equal(reduced.to_dense(), dense)])
    try:
        hvd.sparse_allreduce_async(tensor.to_dense(), "d", hvd.Sum)
    except hvd.GradmeshError as exc:
        out.append(str(exc))
    return out


def test_sparse_allreduce_keeps_the_tensor_sparse_and_equals_a_dense_allreduce() -> None:
    for got in run_ranks(sparse_allreduce, 2):
        assert got[:2] == [[True, True], [True, True]]
        assert got[2] == "sparse_allreduce_async takes a sparse tensor (allreduce: dense ones)"
