"""The mesh planner (`gradmesh.planner.mesh`): the layouts it searches, its formulas, the
calibration it fits on real steps, and the dry run that measures one tp rank's slice alone."""

from __future__ import annotations

import pytest
import torch

from gradmesh.collectives.cost import CostParams
from gradmesh.errors import GradmeshError
from gradmesh.layout.engine import tp_plan
from gradmesh.layout.pipeline.order import bubble_formula
from gradmesh.layout.tensor.layers import dry_exchanges
from gradmesh.layout.tensor.plan import apply_tp_plan
from gradmesh.models.gpt import GPT, GPTConfig
from gradmesh.planner import (
    Calibration,
    Layout,
    Links,
    MeshProfile,
    calibration_layouts,
    fit_calibration,
    layouts,
    predict_mesh,
)
from gradmesh.planner.mesh import Slice

LINKS = Links(CostParams(1e-4, 1e-9, 1e-10), CostParams(1e-4, 1e-9, 1e-10), 4)


def test_layouts_cover_every_split_of_the_world_the_batch_and_blocks_allow() -> None:
    found = layouts(4, 64, 4, [1, 2, 4])
    names = {lay.name for lay in found}
    assert {"dp4", "dp2xtp2", "dp1xtp4", "dp2xpp2xm4", "dp2xpp2ixm4", "dp1xpp4xm8"} <= names
    assert all(lay.dp * lay.tp * lay.pp == 4 for lay in found)
    # interleaving needs two blocks per stage a rank holds: 4 blocks do not make 8 stages
    assert not any(lay.pp == 4 and lay.chunks > 1 for lay in found)
    # the micro-batches divide each replica's samples
    assert all((64 // lay.dp) % lay.microbatches == 0 for lay in found)
    assert [lay.name for lay in layouts(4, 8, 4, [1])] == [
        "dp4",
        *("dp2xpp2xm2", "dp2xpp2zbxm2", "dp2xpp2ixm2", "dp2xpp2vxm2"),
        *("dp2xpp2xm4", "dp2xpp2zbxm4", "dp2xpp2ixm4", "dp2xpp2vxm4"),
        *("dp1xpp4xm4", "dp1xpp4zbxm4", "dp1xpp4xm8", "dp1xpp4zbxm8"),
    ]
    assert layouts(4, 2, 4, [1]) == []  # no replica holds the micro-batches a pipeline needs


def _profile() -> MeshProfile:
    """A made-up profile of a 4-block model on 4 ranks, global batch 32: compute linear in the
    samples, 6 tp exchanges a micro-batch."""

    def at(tp: int, sizes: list[int]) -> Slice:
        return Slice(
            {b: 1e-3 * b / tp + 2e-4 for b in sizes},
            {b: [(4096 * b, "allreduce")] * 6 * (tp > 1) for b in sizes},
            2e-3 / tp,
            {f"h.{i}": 40_000 // tp for i in range(4)},
            20_000 // tp,
        )

    blocks = {"h.0": 3.0, "h.1": 2.0, "h.2": 2.0, "h.3": 3.0}
    prof = MeshProfile("toy", 4, 32, 1, 4, blocks, dict.fromkeys(blocks, 1024))
    prof.slices = {1: at(1, [2, 4, 8, 16]), 2: at(2, [4, 8, 16]), 4: at(4, [32])}
    return prof


def test_a_pipeline_prediction_is_its_busiest_rank_stretched_by_the_bubble() -> None:
    prof = _profile()
    lay = Layout(2, 1, 2, 4, "1f1b")
    p = predict_mesh(prof, lay, LINKS)
    b = 32 // (2 * 4)
    bubble = bubble_formula(2, 4, 1)
    # the balanced cut of (3, 2, 2, 3) puts half the FLOPs on each rank
    assert p.bubble == pytest.approx(bubble)
    assert p.compute_s == pytest.approx(4 / (1 - bubble) * 0.5 * prof.slices[1].seconds[b])
    # each rank holds two blocks and the embeddings/head (tied: on both end stages)
    assert p.param_bytes_per_rank == 2 * 40_000 + 20_000
    assert p.step_s == pytest.approx(
        p.compute_s + p.tensor_parallel_s + p.pipeline_s + p.sync_s + p.update_s
    )
    # without a pipeline nothing is stretched and the sync carries every parameter
    flat = predict_mesh(prof, Layout(4, 1, 1), LINKS)
    assert flat.bubble == 0 and flat.pipeline_s == 0
    assert flat.param_bytes_per_rank == 4 * 40_000 + 20_000


def test_calibration_recovers_the_terms_that_made_the_measurements() -> None:
    prof = _profile()
    truth = Calibration(step_overhead_s=3e-3, exchange_s=4e-4, microbatch_s=1.5e-3)
    found = layouts(4, 32, 4, [1, 2, 4])
    wanted = calibration_layouts(found, 4)
    assert [lay.name for lay in wanted] == ["dp4", "dp2xtp2", "dp2xpp2xm4"]
    measured = {lay: predict_mesh(prof, lay, LINKS, calibration=truth).step_s for lay in wanted}
    fitted = fit_calibration(prof, LINKS, measured)
    assert fitted.step_overhead_s == pytest.approx(truth.step_overhead_s)
    assert fitted.exchange_s == pytest.approx(truth.exchange_s)
    assert fitted.microbatch_s == pytest.approx(truth.microbatch_s)
    # a layout outside the calibration is then predicted as the same terms price it
    other = Layout(1, 4, 1)
    assert predict_mesh(prof, other, LINKS, calibration=fitted).step_s == pytest.approx(
        predict_mesh(prof, other, LINKS, calibration=truth).step_s
    )
    # steps faster than the formulas never make a term negative
    fast = fit_calibration(prof, LINKS, {lay: 1e-6 for lay in wanted})
    assert (fast.step_overhead_s, fast.exchange_s, fast.microbatch_s) == (0.0, 0.0, 0.0)


def test_a_dry_run_computes_one_tp_ranks_slice_alone_and_records_its_exchanges() -> None:
    torch.manual_seed(0)
    config = GPTConfig(vocab=64, seq=16, dim=32, depth=2, heads=4)
    whole = GPT(config)
    ids = torch.randint(0, 64, (3, 16))
    expected = whole(ids).shape
    model = apply_tp_plan(GPT(config), tp_plan("gpt", whole), 2, 0, "gpt")
    with dry_exchanges(2) as dry:
        out = model(ids)
        forward = list(dry.made)
        out.sum().backward()
    assert out.shape == expected
    # forward: the embedding's sum, each block's two rowwise sums, the head's gather
    assert [kind for _, _, kind in forward].count("allreduce") == 1 + 2 * 2
    assert [kind for _, _, kind in forward].count("allgather") == 1
    # backward adds the column layers' input gradients (q/k/v and fc1 in each block)
    assert len(dry.made) > len(forward)
    assert all(n > 0 for _, n, _ in dry.made)
    with pytest.raises(GradmeshError, match="not initialised"):  # outside it, a mesh is needed
        model(ids)
