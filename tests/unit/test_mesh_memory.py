"""The mesh planner's memory model (`gradmesh.planner.mesh_memory`): what a forward saves
per block (measured), the micro-batches a schedule keeps in flight, what sharding and
checkpointing take away, and the memory limit the plan obeys."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from gradmesh.errors import GradmeshError
from gradmesh.layout.memory import Saved, saved_activations
from gradmesh.models.gpt import GPT, GPTConfig
from gradmesh.planner import (
    Layout,
    MeshProfile,
    calibration_layouts,
    fit_calibration,
    fitting,
    in_flight,
    predict_memory,
    predict_mesh,
    preference,
    variants,
)
from gradmesh.planner.axes_cost import Sequences, context_held
from gradmesh.planner.mesh import Slice
from tests.unit.test_mesh_planner import LINKS


def _gpt_step(samples: int) -> tuple[GPT, Saved]:
    torch.manual_seed(0)
    config = GPTConfig(vocab=64, seq=32, dim=32, depth=3, heads=4)
    model = GPT(config)
    data = torch.randint(0, 64, (1000, 33))  # a dataset: each batch is a view of its storage
    x, y = data[:samples, :-1], data[:samples, 1:]

    def run() -> torch.Tensor:
        logits = model(x)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())

    return model, saved_activations(model, run, (x, y))


def test_saved_activations_are_what_a_step_holds_per_block_and_grow_with_the_samples() -> None:
    _, four = _gpt_step(4)
    model, eight = _gpt_step(8)
    assert list(four.blocks) == ["blocks.0", "blocks.1", "blocks.2"]
    saved = four.rest + sum(four.blocks.values())
    # the step's peak holds everything saved, and little beyond it (the first gradients)
    assert saved <= four.peak < 1.3 * saved
    # the dataset's storage (264 KB), the parameters and the buffers are not activations
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert four.rest < 1000 * 33 * 8 and all(n < 20 * weights for n in four.blocks.values())
    # per sample: twice the samples save twice the bytes (attention's scores included)
    for name in four.blocks:
        assert eight.blocks[name] == pytest.approx(2 * four.blocks[name], rel=0.01)
    # a block's input (what checkpointing keeps): samples x tokens x width in fp32
    assert four.inputs["blocks.1"] == 4 * 32 * 32 * 4
    assert all(four.inputs[n] < four.blocks[n] / 4 for n in four.blocks)
    # what a zero-bubble W keeps: the outputs of ln1, qkv (3 widths), proj, ln2, fc1 (4), fc2
    assert four.kept["blocks.1"] == 4 * 32 * (1 + 3 + 1 + 1 + 4 + 1) * 32 * 4
    # the token embedding, the final norm, the logits; the positions' embedding once (32 x 32)
    assert four.kept_rest == 4 * 32 * (32 + 32 + 64) * 4 + 32 * 32 * 4


def _profile() -> MeshProfile:
    """4 blocks of 40 kB (1 MB saved and 10 kB in per sample each), 20 kB of embeddings and head
    (200 kB saved per sample), measured at 2 samples with a 100 kB transient; Adam's two slots,
    and its step's temporaries one copy of the parameters; 4 ranks, global batch 32."""
    blocks = {f"h.{i}": 1.0 for i in range(4)}
    names = list(blocks)
    sl = Slice(
        {b: 1e-3 * b for b in (1, 2, 4, 8, 16, 32)},
        {b: [] for b in (1, 2, 4, 8, 16, 32)},
        2e-3,
        dict.fromkeys(names, 40_000),
        20_000,
        Saved(dict.fromkeys(names, 2_000_000), dict.fromkeys(names, 20_000), 400_000, 8_600_000),
        2,
        2 * 180_000,
        180_000,  # the optimizer step's temporaries: one more copy of the parameters
    )
    return MeshProfile("toy", 4, 32, 1, 4, blocks, dict.fromkeys(blocks, 10_000), {1: sl})


def test_a_model_of_one_block_holds_its_block() -> None:
    prof = _profile()
    sl = prof.slices[1]
    sl.block_param_bytes = {"h.0": 40_000}
    sl.saved = Saved({"h.0": 2_000_000}, {"h.0": 20_000}, 400_000, 2_600_000)
    prof.blocks = {}  # the profile cuts no pipeline from one block
    one = predict_memory(prof, Layout(4, 1, 1))
    assert one.param_bytes == 40_000 + 20_000
    assert one.activation_bytes == pytest.approx(8 * (1_000_000 + 200_000 + 100_000))


def test_the_ring_s_exchange_buffers_are_held_on_top_of_the_activations() -> None:
    """At cp c a rank's keys and values K (its chunks', its tp rank's heads, bf16 here), as each
    ring allocates them at a backward: gradmesh's holds the block it computes against and the
    one arriving, and the fp32 key and value gradients summed into and arriving (2 K + 2 x 2
    K); torch's all-gathering ring every rank's blocks and its own concatenated to send, and
    three fp32 gradient buffers ((c + 1) K + 3 x 2 K); all-to-all none of them."""
    prof = _profile()
    without = {c: predict_memory(prof, Layout(8 // c, 1, 1, cp=c)) for c in (2, 4)}
    prof.sequences = Sequences(4, 2 * 64 * 32 * 2, 64 * 32 * 2, 2.0 * 64 * 64 * 32, 4, 64, 2)
    for c in (2, 4):
        lay = Layout(8 // c, 1, 1, cp=c)
        k = 2 * 64 * 32 * 2 * lay.micro(32) / c
        rings = {
            (2 * k + 4 * k): lay,
            ((c + 1) * k + 6 * k): Layout(8 // c, 1, 1, cp=c, ring_gathers=True),
            0: Layout(8 // c, 1, 1, cp=c, attention="alltoall"),
        }
        for held, ring in rings.items():
            assert context_held(prof.sequences, ring, ring.micro(32)) == pytest.approx(held)
            extra = predict_memory(prof, ring).activation_bytes - without[c].activation_bytes
            assert extra == pytest.approx(held)
    # tp 2: each rank's half of the heads
    halves = Layout(2, 2, 1, cp=2)
    assert context_held(prof.sequences, halves, 8) == pytest.approx(6 * 2 * 64 * 32 * 2 * 8 / 4)
    assert context_held(prof.sequences, Layout(8, 1, 1), 4) == 0


def test_a_schedule_keeps_its_warm_up_in_flight() -> None:
    one = [10.0]
    assert in_flight(Layout(4, 1, 1), 0, one) == 10
    # 1F1B: the first stage runs p forwards before its first backward, the last one
    assert in_flight(Layout(1, 1, 2, 4, "1f1b"), 0, one) == 20
    assert in_flight(Layout(1, 1, 2, 4, "1f1b"), 1, one) == 10
    # GPipe: every micro-batch's forward before any backward
    assert in_flight(Layout(1, 1, 2, 4, "gpipe"), 0, one) == 40
    # interleaved, 2 chunks: the first rank's warm-up is 2 (p - 1) + (v - 1) p forwards, + 1
    assert in_flight(Layout(1, 1, 2, 4, "interleaved", 2), 0, [1.0, 1.0]) == 2 + 2 + 1


def test_memory_follows_the_stage_checkpointing_and_the_schedule() -> None:
    prof = _profile()
    whole = 4 * 40_000 + 20_000
    dp = predict_memory(prof, Layout(4, 1, 1))
    # 8 samples a rank: 4 blocks' and the rest's saved bytes per sample, and the transient
    per_sample = 4 * 1_000_000 + 200_000
    transient = (8_600_000 - 2 * per_sample) / 2
    assert dp.activation_bytes == pytest.approx(8 * (per_sample + transient))
    assert (dp.param_bytes, dp.grad_bytes, dp.optimizer_bytes) == (whole, whole, 2 * whole)
    assert dp.gathered_bytes == 0 and dp.dominant == "activations"
    z1 = predict_memory(prof, Layout(4, 1, 1, zero_stage=1))
    assert (z1.param_bytes, z1.optimizer_bytes) == (whole, 2 * whole / 4)
    z3 = predict_memory(prof, Layout(4, 1, 1, zero_stage=3))
    assert z3.state_bytes == pytest.approx(4 * whole / 4)
    # stage 3: the root gathered, two units at once and one unit's gradient
    assert z3.gathered_bytes == 20_000 + 3 * 40_000
    z2 = predict_memory(prof, Layout(4, 1, 1, zero_stage=2))
    assert z2.gathered_bytes == whole + 40_000  # every unit kept from forward to backward
    # the optimizer's temporaries come after backward: the larger phase counts, not both
    assert dp.optimizer_step_bytes == whole and z1.optimizer_step_bytes == whole / 4
    assert dp.step_bytes == dp.activation_bytes
    prof.slices[1].optimizer_step_bytes = 1000 * whole  # an optimizer with big temporaries
    heavy = predict_memory(prof, Layout(4, 1, 1))
    assert heavy.step_bytes == heavy.optimizer_step_bytes == 1000 * whole
    prof.slices[1].optimizer_step_bytes = whole
    # checkpointing keeps each block's input, and rebuilds one block in backward (1 MB a
    # sample: more than the rest's 200 kB) on top of the gradients flowing back (the transient)
    ac = predict_memory(prof, Layout(4, 1, 1, checkpointing=True))
    assert ac.activation_bytes == pytest.approx(8 * (4 * 10_000 + 1_000_000 + transient))
    # 1F1B on 2 stages, 4 micro-batches of 4: the first stage holds 2 of its 2 blocks + rest
    pp = predict_memory(prof, Layout(2, 1, 2, 4, "1f1b"))
    stage = 2 * 1_000_000 + 200_000
    assert pp.activation_bytes == pytest.approx(4 * (2 * stage + transient))
    assert pp.param_bytes == 2 * 40_000 + 20_000


def test_checkpointing_and_sharding_are_priced_where_they_cost_time() -> None:
    prof = _profile()
    plain = predict_mesh(prof, Layout(4, 1, 1), LINKS)
    ac = predict_mesh(prof, Layout(4, 1, 1, checkpointing=True), LINKS)
    assert ac.compute_s == pytest.approx(plain.compute_s * 4 / 3)
    z3 = predict_mesh(prof, Layout(4, 1, 1, zero_stage=3), LINKS)
    z2 = predict_mesh(prof, Layout(4, 1, 1, zero_stage=2), LINKS)
    # FSDP2 exchanges a unit at a time (4 blocks and the root): a collective's latency each,
    # an all-gather and a reduce-scatter per unit at stage 2, and at 3 again an all-gather of
    # each block (the root stays gathered from forward to backward)
    assert z3.sync_s > z2.sync_s > plain.sync_s
    link = LINKS.over([0, 1, 2, 3])
    again = 4 * ((4 - 1) * link.alpha + 3 / 4 * 40_000 * link.beta)
    assert z3.sync_s - z2.sync_s == pytest.approx(again)
    # each of those 14 collectives pays FSDP2's excess, fitted on a measured ZeRO-3 step
    lay = Layout(4, 1, 1, zero_stage=3)
    assert lay in calibration_layouts(variants([Layout(4, 1, 1)], blocks=4), 4)
    cal = fit_calibration(prof, LINKS, {lay: z3.step_s + 14 * 0.002})
    assert cal.unit_exchange_s == pytest.approx(0.002)
    slow = predict_mesh(prof, lay, LINKS, calibration=cal)
    assert slow.sync_s - z3.sync_s == pytest.approx(14 * 0.002)
    assert z2.update_s == pytest.approx(plain.update_s / 4)  # each rank steps its shard
    found = variants([Layout(4, 1, 1), Layout(2, 1, 2, 4, "1f1b")], blocks=4)
    names = {lay.name for lay in found}
    assert {"dp4xz1", "dp4xz3xac", "dp2xpp2xm4xac", "dp2xpp2xm4xz1"} <= names
    assert not any(lay.pp > 1 and lay.zero_stage > 1 for lay in found)  # stages 2, 3 refuse them
    assert len(variants([Layout(4, 1, 1)], blocks=0)) == 4  # nothing to recompute


def test_a_memory_limit_keeps_what_fits_and_names_the_smallest_need() -> None:
    prof = _profile()
    preds = [predict_mesh(prof, lay, LINKS) for lay in variants([Layout(4, 1, 1)], 4)]
    need = {p.layout.name: p.memory.total_bytes for p in preds if p.memory}
    limit = need["dp4xz3xac"] + 1
    kept = fitting(preds, limit, 4)
    assert {p.layout.name for p in kept} == {n for n, b in need.items() if b <= limit}
    assert "dp4" not in {p.layout.name for p in kept}
    # what saves memory is used only as far as the limit needs: no stage, then no recomputing
    saving = [(p.layout.zero_stage, p.layout.checkpointing) for p in sorted(kept, key=preference)]
    assert saving == sorted(saving)
    everything = sorted(fitting(preds, max(need.values()), 4), key=preference)
    assert everything[0].layout.name == "dp4"
    least = min(need.values())
    with pytest.raises(GradmeshError) as refused:
        fitting(preds, least - 1, 4)
    message = str(refused.value)
    assert f"needs {least / 2**20:.1f} MiB, most of it activations" in message
    assert "\n" not in message


def test_the_state_table_counts_what_each_optimizer_holds() -> None:
    """`STATE_TENSORS`, which the planner and the simulator price, against the state each
    registered optimizer keeps after a step (tensors of the parameter's size)."""
    from gradmesh.train.config import STATE_TENSORS, OptimizerConfig
    from gradmesh.train.optimizers import OPTIMIZERS, build_optimizer

    assert sorted(STATE_TENSORS) == sorted(OPTIMIZERS.names())
    for name in OPTIMIZERS.names():
        p = torch.nn.Parameter(torch.ones(5, 3))
        opt = build_optimizer(OptimizerConfig(name=name), [p], 0.1)
        p.grad = torch.ones_like(p)
        opt.step()
        held = [v for v in opt.state[p].values() if torch.is_tensor(v) and v.shape == p.shape]
        assert len(held) == STATE_TENSORS[name], name


def test_the_planner_takes_a_zero_bubble_schedule_where_it_fits_and_1f1b_where_memory_forbids() -> (
    None
):
    """ZB-H1 keeps 1F1B's p micro-batches of activations, but each micro-batch waiting for its
    W also keeps the gradients its weights' operations received (`Saved.kept`): the last stage,
    whose W's wait longest, holds p of them at its peak; ZBV holds 2 p chunks of half a stage."""
    prof = _profile()
    saved = prof.slices[1].saved
    assert saved is not None
    saved.kept, saved.kept_rest = dict.fromkeys(prof.block_names, 600_000), 200_000
    found = [Layout(2, 1, 2, 4, s, 2 if s == "zbv" else 1) for s in ("1f1b", "zb-h1", "zbv")]
    preds = {p.layout.schedule: p for p in (predict_mesh(prof, lay, LINKS) for lay in found)}
    assert (
        preds["zb-h1"].bubble < preds["1f1b"].bubble and preds["zbv"].bubble < preds["zb-h1"].bubble
    )
    assert preds["zb-h1"].step_s < preds["1f1b"].step_s
    need = {s: p.memory.total_bytes for s, p in preds.items() if p.memory}
    # the last rank: 2 micro-batches of 2 blocks and the rest, both with their kept gradients
    kept = 4 * (2 * 300_000 + 100_000)  # 4 samples a micro-batch; the profile's bytes are of 2
    assert need["zb-h1"] - need["1f1b"] == pytest.approx(2 * kept)
    fastest = sorted(preds.values(), key=preference)[0]
    assert fastest.layout.schedule in ("zb-h1", "zbv")
    roomy = fitting(list(preds.values()), need["zb-h1"], 4)
    assert sorted(roomy, key=preference)[0].layout.schedule == "zb-h1"
    tight = fitting(list(preds.values()), need["1f1b"], 4)
    assert [p.layout.schedule for p in tight] == ["1f1b"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--model", "cnn"], "plan --memory counts token models on the meta device"),
        (["--model", "gpt", "--layouts", "dp,zero9"], "unknown memory layout 'zero9'"),
        (["--model", "gpt", "--workers", "3", "--layouts", "dpxtp2"], "does not divide --world 3"),
        (
            ["--model", "gpt", "--workers", "4", "--layouts", "dpxcp4", "--sequence-length", "100"],
            "sequence of 100 tokens cannot be cut into 2 x --context-parallel 4 = 8 equal chunks",
        ),
    ],
)
def test_plan_memory_refuses_in_one_line(
    flags: list[str], message: str, cli_line: Callable[..., str]
) -> None:
    line = cli_line(["plan", "--memory", *flags])
    assert line.startswith("gradmesh plan: error: ") and message in line
