"""The data-parallel engine's behaviours on real ranks: overlap, join, bad input, Horovod API."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradmesh
import gradmesh.horovod as hvd
from gradmesh.errors import GradmeshError
from tests.harness import run_ranks


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5)
    )


def traced_steps(path: str, algorithm: str) -> str:
    gradmesh.start_timeline(path)
    model = _model()
    opt = gradmesh.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        fusion_mb=0.005,
        allreduce=algorithm,
    )
    for _ in range(3):
        opt.zero_grad()
        F.cross_entropy(model(torch.randn(32, 20)), torch.randint(0, 5, (32,))).backward()
        opt.step()
    return str(gradmesh.stop_timeline())


@pytest.mark.parametrize("algorithm", ["native", "ring"])
def test_timeline_shows_bucket_reductions_starting_before_backward_ends(
    tmp_path: Path, algorithm: str
) -> None:
    paths = run_ranks(traced_steps, 2, str(tmp_path / "trace.json"), algorithm)
    assert paths == [str(tmp_path / "trace.rank0.json"), str(tmp_path / "trace.rank1.json")]
    events = json.loads(Path(paths[0]).read_text())["traceEvents"]
    names = {e["name"] for e in events}
    assert {"backward", "pack", "reduce", "unpack", "step"} <= names
    backwards = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] == "backward")
    reduces = [e for e in events if e["name"] == "reduce"]
    assert len({e["args"]["bucket"] for e in reduces}) >= 3  # several buckets
    if algorithm == "ring":  # gradmesh's own algorithms run on the communication thread
        (comm,) = {e["tid"] for e in reduces}
        threads = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
        assert threads[comm] == "communication"
    overlapped = [r for r in reduces if any(start <= r["ts"] < end for start, end in backwards)]
    assert overlapped, "no bucket reduction started while backward was still running"


def differing_models() -> str:
    width = 64 if gradmesh.rank() == 0 else 65
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, width), nn.Linear(width, 5))
    opt = gradmesh.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    try:
        model(torch.randn(4, 20)).sum().backward()
        opt.step()
    except GradmeshError as exc:
        return str(exc)
    return "no error"


def test_ranks_with_different_models_name_the_first_differing_parameter() -> None:
    for rank, message in enumerate(run_ranks(differing_models, 2)):
        assert message.startswith(f"rank {rank}: models differ across ranks at parameter #")
        assert "rank 0: 1.bias [5] float32" not in message  # it names the first difference:
        assert "rank 0: 0.weight [64, 20] float32; rank 1: 0.weight [65, 20] float32" in message


def nonfinite(mode: str) -> tuple[str, list[float], int]:
    model = _model()
    opt = gradmesh.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        on_nonfinite=mode,
    )
    before = [float(p.detach().sum()) for p in model.parameters()]
    loss = model(torch.randn(4, 20)).sum()
    if gradmesh.rank() == 1:
        loss = loss * float("nan")  # only one rank sees the NaN; the reduction spreads it
    loss.backward()
    try:
        opt.step()
    except GradmeshError as exc:
        return str(exc), before, -1
    after = [float(p.detach().sum()) for p in model.parameters()]
    return "stepped" if after != before else "skipped", after, opt._gm.skipped_steps  # type: ignore[attr-defined]


def test_nonfinite_gradients_error_by_default_naming_parameter_and_step() -> None:
    for rank, (message, _, _) in enumerate(run_ranks(nonfinite, 2, "error")):
        assert message.startswith(f"rank {rank}: step 1: non-finite gradient in parameter '")


def test_nonfinite_skip_skips_on_every_rank() -> None:
    (a, pa, na), (b, pb, nb) = run_ranks(nonfinite, 2, "skip")
    assert a == b == "skipped" and na == nb == 1 and pa == pb


def uneven(steps_by_rank: list[int]) -> list[torch.Tensor]:
    model = _model()
    opt = gradmesh.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        fusion_mb=0.01,
    )
    g = torch.Generator().manual_seed(gradmesh.rank())
    for _ in range(steps_by_rank[gradmesh.rank()]):
        opt.zero_grad()
        model(torch.randn(8, 20, generator=g)).sum().backward()
        opt.step()
    hvd.join()
    return [p.detach().clone() for p in model.parameters()]


def test_join_lets_a_rank_run_out_of_data_without_hanging() -> None:
    results = run_ranks(uneven, 3, [2, 5, 3], timeout=60)
    for params in results[1:]:
        for got, want in zip(params, results[0], strict=True):
            assert torch.equal(got, want)


def frozen_and_clipped() -> tuple[list[float], float]:
    model = _model()
    model[0].weight.requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    opt = gradmesh.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    model(torch.randn(4, 20) * (gradmesh.rank() + 1)).sum().backward()
    opt.synchronize()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01))
    with opt.skip_synchronize():
        opt.step()
    assert torch.equal(model[0].weight, frozen)
    return [float(p.detach().sum()) for p in model.parameters()], norm


def test_frozen_parameters_and_clipping_between_synchronize_and_step() -> None:
    (pa, na), (pb, nb) = run_ranks(frozen_and_clipped, 2)
    assert pa == pb and na == nb > 0.01


def horovod_api() -> dict[str, object]:
    r = hvd.rank()
    t = torch.tensor([1.0, 2.0]) * (r + 1)
    out: dict[str, object] = {
        "avg": hvd.allreduce(t).tolist(),
        "sum": hvd.allreduce(t, op=hvd.Sum).tolist(),
        "untouched": t.tolist(),
        "fp16": hvd.allreduce(t, compression=hvd.Compression.fp16).tolist(),
        "gather": hvd.allgather(torch.full((r + 1, 2), float(r))).tolist(),
        "bcast": hvd.broadcast(t, root_rank=1).tolist(),
        "object": hvd.broadcast_object({"epoch": 3, "name": f"rank{r}"}, root_rank=0),
    }
    out["scaled"] = hvd.allreduce(t, op=hvd.Sum, prescale_factor=3.0, postscale_factor=0.5).tolist()
    out["min"] = hvd.allreduce(t, op=hvd.Min).tolist()
    out["product"] = hvd.allreduce(t, op=hvd.Product).tolist()
    u = t.clone()
    in_place = hvd.allreduce_async_(u, op=hvd.Max)
    out["in_place"] = [hvd.synchronize(in_place) is u, u.tolist()]
    handle = hvd.allreduce_async(t, op=hvd.Sum)
    out["async"] = hvd.synchronize(handle).tolist()
    out["polled"] = hvd.poll(handle)
    with pytest.raises(NotImplementedError):
        hvd.allreduce(t, op=hvd.Adasum)
    with pytest.raises(GradmeshError, match="cannot send type Tensor .*never pickle"):
        hvd.broadcast_object({"t": torch.ones(1)} if r == 0 else None)
    hvd.barrier()
    out["meta"] = [
        hvd.size(),
        hvd.local_rank(),
        hvd.local_size(),
        hvd.cross_rank(),
        hvd.cross_size(),
        hvd.is_initialized(),
    ]
    out["build"] = [hvd.mpi_built(), hvd.mpi_enabled(), hvd.gloo_built(), hvd.gloo_enabled()]
    return out


def test_horovod_api_surface() -> None:
    a, b = run_ranks(horovod_api, 2)
    assert a["avg"] == b["avg"] == [1.5, 3.0]
    assert a["sum"] == [3.0, 6.0] and a["untouched"] == [1.0, 2.0]
    assert a["fp16"] == [1.5, 3.0]
    assert a["gather"] == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
    assert a["bcast"] == b["bcast"] == [2.0, 4.0]
    assert a["object"] == b["object"] == {"epoch": 3, "name": "rank0"}
    assert a["async"] == [3.0, 6.0] and a["polled"] is True
    assert a["meta"] == [2, 0, 2, 0, 1, True]
    assert a["build"] == [False, False, True, True]
    assert a["scaled"] == b["scaled"] == [4.5, 9.0]  # (1 + 2) * 3 * 0.5, Horovod's order
    assert a["min"] == [1.0, 2.0] and a["product"] == [2.0, 8.0]
    assert a["in_place"] == b["in_place"] == [True, [2.0, 4.0]]


def optimizer_state() -> list[float]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * (hvd.rank() + 1), momentum=0.9)
    if hvd.rank() == 0:  # only the root has momentum buffers
        model(torch.randn(4, 20)).sum().backward()
        opt.step()
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    buffers = [opt.state[p]["momentum_buffer"] for p in model.parameters()]
    return [opt.param_groups[0]["lr"], *[float(b.sum()) for b in buffers]]


def test_broadcast_optimizer_state_creates_and_copies_state() -> None:
    a, b = run_ranks(optimizer_state, 2)
    assert a == b and a[0] == pytest.approx(0.1)


def ddp_steps(algorithm: str) -> list[torch.Tensor]:
    model = _model()
    ddp = nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(None, gradmesh.ddp_comm_hook(allreduce=algorithm))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(40, 20, generator=g), torch.randint(0, 5, (40,), generator=g)
    for step in range(4):
        idx = torch.arange(step * 10, step * 10 + 10)
        mine = torch.tensor_split(idx, gradmesh.size())[gradmesh.rank()]
        opt.zero_grad()
        F.cross_entropy(ddp(x[mine]), y[mine]).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_ddp_comm_hook_equals_one_process() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(40, 20, generator=g), torch.randint(0, 5, (40,), generator=g)
    for step in range(4):
        opt.zero_grad()
        F.cross_entropy(
            model(x[step * 10 : step * 10 + 10]), y[step * 10 : step * 10 + 10]
        ).backward()
        opt.step()
    for params in run_ranks(ddp_steps, 2, "ring"):
        for got, want in zip(params, model.parameters(), strict=True):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)


def horovod_optimizer() -> dict[str, object]:
    import warnings

    r = hvd.rank()
    out: dict[str, object] = {}
    model = _model()
    x, y = torch.randn(8, 20) * (r + 1), torch.randint(0, 5, (8,))
    # Horovod's positional order: (optimizer, named_parameters, compression, ...)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model.named_parameters(),
        hvd.Compression.none,
        1,
        hvd.Average,
        4.0,  # gradient_predivide_factor
    )
    out["names"] = sorted(opt._parameter_names.values())  # type: ignore[attr-defined]
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.synchronize()
    out["predivided"] = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()  # after synchronize(), outside skip_synchronize(): Horovod warns
    out["warned"] = [str(w.message) for w in caught]
    # the same gradients averaged without the factor
    plain = _model()
    ref = gradmesh.DistributedOptimizer(torch.optim.SGD(plain.parameters(), lr=0.1))
    ref.zero_grad()
    F.cross_entropy(plain(x), y).backward()
    ref.synchronize()
    out["plain"] = [p.grad.clone() for p in plain.parameters()]  # type: ignore[union-attr]
    # a non-finite gradient reaches the optimizer, as in plain torch and Horovod
    opt.zero_grad()
    (model(x).sum() * float("inf")).backward()
    opt.step()
    out["stepped_on_inf"] = not all(bool(torch.isfinite(p).all()) for p in model.parameters())
    for named, message in (
        ([("a", p) for p in model.parameters()], "repeats the name(s) a"),
        (list(model.named_parameters())[:-1], "does not name 1 of the optimizer's 6"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)) as err:  # Horovod's type
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named)
        assert isinstance(err.value, GradmeshError)
    return out


def test_horovod_distributed_optimizer_behaves_as_horovod_documents() -> None:
    for out in run_ranks(horovod_optimizer, 2):
        assert out["names"] == sorted(n for n, _ in _model().named_parameters())
        for got, want in zip(out["predivided"], out["plain"], strict=True):  # type: ignore[call-overload]
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        assert len(out["warned"]) == 1  # type: ignore[arg-type]
        horovods = "optimizer.step() called without optimizer.skip_synchronize()"
        assert out["warned"][0].startswith(horovods)  # type: ignore[index]
        assert out["stepped_on_inf"] is True
