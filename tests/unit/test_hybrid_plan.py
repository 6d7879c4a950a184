"""The hybrid planner without processes: plan files checked before launch, the search exact
against every placement, predictions read from the collectives' formulas."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
from pathlib import Path

import pytest

from gradmesh.collectives.cost import CostParams
from gradmesh.collectives.ring import allgather_cost, ring_cost
from gradmesh.errors import GradmeshError
from gradmesh.layout.tensor.hybrid import conversions
from gradmesh.plan.command import make_plan, resolve
from gradmesh.plan.setting import Setting
from gradmesh.planner import (
    LARGEST_FIT,
    SMALLEST_FIT,
    Links,
    Profile,
    Unit,
    exchange_sizes,
    memory_bytes,
    predict,
    search_tp,
)
from gradmesh.train.config import TrainConfig

LINK = CostParams(alpha=50e-6, beta=8e-9, gamma=1e-10)
LINKS = Links(LINK, LINK, 1)


def fake_profile(n: int, workers: int = 4, seed: int = 0) -> Profile:
    """`n` units with random times and sizes for every placement at tp 2 and 4."""
    rng = random.Random(seed)
    units = []
    for i in range(n):
        unit = Unit(
            name=str(i),
            kind=rng.choice(["Conv2d", "Linear"]),
            param_bytes=rng.randrange(1, 8 << 20),
            bias_bytes=64,
            in_bytes=rng.randrange(64, 16384),
            mid_bytes=rng.randrange(64, 16384),
            out_bytes=rng.randrange(64, 16384),
            dims=(64, 64),
        )
        for key in ["data"] + [
            f"{c}@{t}" for t in (2, 4) for c in ("replicate", "colwise", "rowwise")
        ]:
            unit.fwd[key] = rng.uniform(1e-4, 5e-3)
            unit.bwd[key] = rng.uniform(1e-4, 1e-2)
        units.append(unit)
    return Profile("fake", workers, 64, units, 1, 1, 0.0)


def additive(prof: Profile, choices: list[str], tp: int) -> float:
    """The search's objective computed directly: every term of `predict` with the gradient
    sync fully exposed and without its per-message latency."""
    layers = {u.name: c for u, c in zip(prof.units, choices, strict=True)}
    pred = predict(prof, layers, tp, LINKS, fusion_mb=1e9)
    w = prof.workers
    sync_latency = sum(
        ring_cost(p, 0, LINK)
        for group, p in (("batch", w), ("dp", w // tp))
        if any((c == "data" and tp > 1) == (group == "batch") for c in choices)
    )
    return pred.compute_s + pred.blocking_comm_s + pred.sync_s - sync_latency


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_search_is_exact_over_every_placement(tp: int) -> None:
    prof = fake_profile(6, seed=tp)
    got = search_tp(prof, tp, LINKS)
    assert got is not None
    options = ["data"] if tp == 1 else ["data", "replicate", "colwise", "rowwise"]
    best = None
    for choices in itertools.product(options, repeat=len(prof.units)):
        try:
            conversions(list(choices))
        except ValueError:
            continue
        if tp > 1 and not {"colwise", "rowwise"} & set(choices):
            continue
        cost = additive(prof, list(choices), tp)
        best = cost if best is None else min(best, cost)
    assert best is not None
    assert additive(prof, [got[u.name] for u in prof.units], tp) == pytest.approx(best, rel=1e-9)


def test_a_fifty_layer_model_is_planned() -> None:
    prof = fake_profile(50)
    for tp in (2, 4):
        layers = search_tp(prof, tp, LINKS)
        assert layers is not None and len(layers) == 50
        conversions([layers[u.name] for u in prof.units])  # a chain that runs


def test_prediction_reads_the_collectives_formulas() -> None:
    """Pure data parallelism of one layer: its compute, then one ring allreduce of its
    parameters; one split pair: the gather before it, the pair's two allreduces, no sync."""
    prof = fake_profile(2)
    for u in prof.units:
        u.kind = "Linear"
    a, b = prof.units
    dp = predict(prof, {"0": "data", "1": "data"}, 1, LINKS)
    compute = sum(u.fwd["data"] + u.bwd["data"] for u in prof.units)
    grads = a.param_bytes + b.param_bytes
    assert dp.step_s == pytest.approx(compute + ring_cost(4, grads, LINK))
    tp = predict(prof, {"0": "colwise", "1": "rowwise"}, 4, LINKS)
    compute = a.fwd["colwise@4"] + a.bwd["colwise@4"] + b.fwd["rowwise@4"] + b.bwd["rowwise@4"]
    exchanges = ring_cost(4, 64 * a.in_bytes, LINK) + ring_cost(4, 64 * b.mid_bytes, LINK)
    assert tp.step_s == pytest.approx(compute + exchanges)
    hybrid = predict(prof, {"0": "data", "1": "replicate"}, 4, LINKS)
    assert hybrid.blocking_comm_s == pytest.approx(allgather_cost(4, 64 * b.in_bytes, LINK))


CNN = {
    "model": "cnn",
    "tensor_parallel": 2,
    "layers": {"0": "data", "2": "data", "6": "colwise", "8": "rowwise"},
}


@pytest.mark.parametrize(
    ("change", "workers", "message"),
    [
        ({"layers": {**CNN["layers"], "5": "data"}}, 4, "model cnn has no layer '5' with weights"),
        (
            {"layers": {**CNN["layers"], "8": "replicate"}},
            4,
            "layer 6: a colwise layer must be followed by a rowwise one",
        ),
        (
            {"layers": {**CNN["layers"], "2": "rowwise"}},
            4,
            "layer 2: a rowwise layer must follow a colwise one",
        ),
        (
            {"layers": {**CNN["layers"], "0": "sideways"}},
            4,
            "layer 0: unknown placement 'sideways'",
        ),
        ({"tensor_parallel": 3}, 4, "tensor_parallel 3 does not divide the 4 workers"),
        ({"tensor_parallel": 128}, 128, "does not divide the 64 output features of layer 6"),
        ({"model": "mlp"}, 4, "--plan is for model mlp, not --model cnn"),
    ],
)
def test_a_plan_that_cannot_run_is_one_line_before_launch(
    change: dict[str, object], workers: int, message: str, tmp_path: Path
) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({**CNN, **change}))
    config = TrainConfig.of(model="cnn", workers=workers, batch_size=256, plan=str(path))
    with pytest.raises(GradmeshError, match=None) as err:
        resolve(config)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_plan_file_is_inlined_and_sets_tensor_parallel(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(CNN))
    config = resolve(TrainConfig.of(model="cnn", workers=4, plan=str(path)))
    assert (
        config.layout.tensor_parallel == 2
        and json.loads(config.layout.plan)["layers"] == CNN["layers"]
    )
    with pytest.raises(GradmeshError, match="--tensor-parallel 4 contradicts the plan's"):
        resolve(config.with_options(tensor_parallel=4))


def test_a_memory_limit_no_plan_meets_is_one_line() -> None:
    setting = Setting("cnn", "digits", "3x32x32", 4, 64, 4)
    with pytest.raises(GradmeshError, match=r"no placement of model cnn on 4 workers fits within"):
        make_plan(setting, LINKS, 1, memory_limit=1000.0)
    # the job's optimizer state counts (`gradmesh plan --optimizer adamw`: two tensors a
    # parameter where SGD with momentum keeps one)
    _, _, prof, _ = make_plan(setting, LINKS, 1, optimizer_slots=2)
    unit = max(prof.units, key=lambda u: u.param_bytes)
    sgd = dataclasses.replace(prof, optimizer_slots=1)
    more = memory_bytes(prof, unit, "data", 1) - memory_bytes(sgd, unit, "data", 1)
    assert prof.optimizer_slots == 2 and more == unit.param_bytes > 0


def test_a_plan_profiles_the_model_its_arguments_build() -> None:
    """`gradmesh plan --model-args` (and `train --plan auto`'s) shape the model planned: an
    MLP of width 256 on 8 x 8 digits holds (64 + 1) x 256 + (256 + 1) x 10 parameters, not the
    default width's."""
    _, _, prof, _ = make_plan(Setting("mlp", "digits", "1x8x8", 2, 64, 2, "width=256"), LINKS, 1)
    assert sum(u.param_bytes for u in prof.units) == 4 * ((64 + 1) * 256 + (256 + 1) * 10)


def test_the_link_is_fitted_at_the_sizes_the_candidates_exchange() -> None:
    """Five sizes at most, spread in log scale from the smallest exchange (raised to 16 KB)
    to the whole model's gradient (cut to 8 MB), which is always among them."""
    prof = fake_profile(12)
    sizes = exchange_sizes(prof, [1, 2, 4])
    whole = sum(u.param_bytes for u in prof.units)
    assert len(sizes) == 5 and sizes == sorted(set(sizes))
    assert sizes[0] == SMALLEST_FIT and sizes[-1] == min(whole, LARGEST_FIT)
    ratios = [b / a for a, b in zip(sizes, sizes[1:], strict=False)]
    assert max(ratios) < 4 * min(ratios)  # spread, not bunched at one end
    tiny = fake_profile(1)
    tiny.units[0].param_bytes = 100
    assert exchange_sizes(tiny, [1]) == [SMALLEST_FIT]


def test_the_link_is_fitted_piecewise_per_group_size() -> None:
    """Each piece of the fit prices both its sizes exactly through the registered formula; a
    flat stretch (the same cost at two sizes) gets no negative beta; `Links.over` picks the
    piece by message size and the curve by group size."""
    from gradmesh.collectives.cost import COSTS
    from gradmesh.plan.probe import fit_segments

    ring = COSTS.get("ring")
    sizes = [1 << 14, 1 << 16, 1 << 18, 1 << 20]
    spent = [4e-3, 4e-3, 5e-3, 14e-3]  # flat, then a line
    pieces = fit_segments("ring", 4, sizes, spent, LINK)
    assert [int(p[0]) for p in pieces] == sizes[1:]
    assert pieces[0][2] == 0.0 and pieces[0][1] > 0  # the flat piece: latency alone
    for (upto, alpha, beta), lo in zip(pieces[1:], sizes[1:-1], strict=True):
        c = CostParams(alpha, beta, LINK.gamma)
        for n in (lo, upto):
            assert ring(4, n, c, 1) == pytest.approx(spent[sizes.index(n)], rel=1e-9)
    curve = [(int(upto), CostParams(a, b, LINK.gamma)) for upto, a, b in pieces]
    links = Links(LINK, LINK, 1, {}, {4: curve})
    assert links.over([0, 1, 2, 3], 100).alpha == pieces[0][1]
    assert links.over([0, 1, 2, 3], 200_000) == curve[1][1]  # in (64 KB, 256 KB]
    assert links.over([0, 1, 2, 3], 1 << 30) == curve[-1][1]  # larger: the last piece
    assert links.over([0, 2], 1 << 20) == LINK  # no curve for pairs: the level's figures
    flat = fit_segments("ring", 4, sizes[:2], spent[:2], LINK)  # the last piece needs a rate
    assert flat[-1][2] == LINK.beta
    assert ring(4, sizes[1], CostParams(flat[-1][1], LINK.beta, LINK.gamma), 1) == pytest.approx(
        spent[1]
    )
