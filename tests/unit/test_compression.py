"""Compressors without processes: each one's error bound, error feedback's invariant, int8's
overflow-free sum, decoding that refuses a message that does not match its context, and the
one-line errors for bad settings."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradmesh.compression.base import Link
from gradmesh.compression.quantize import CHUNK, SIGN_CHUNK, Int8
from gradmesh.compression.registry import COMPRESSORS, make, reduce
from gradmesh.errors import GradmeshError

NAMES = COMPRESSORS.names()
sizes = st.integers(1, 3000)
seeds = st.integers(0, 2**31 - 1)


def tensor(n: int, seed: int, spread: float = 3.0) -> torch.Tensor:
    """Values over several orders of magnitude, as gradients are."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * spread)


def round_trip(name: str, x: torch.Tensor, **options: object) -> torch.Tensor:
    compressor = make(name, error_feedback="off", **options)  # type: ignore[arg-type]
    payload, ctx = compressor.encode(x, compressor.new_state(x.numel()))
    out = torch.zeros_like(x)
    compressor.decode(payload, ctx, out)
    return out


@settings(max_examples=60, deadline=None)
@given(n=sizes, seed=seeds)
def test_casts_round_once(n: int, seed: int) -> None:
    x = tensor(n, seed, spread=1.0)
    for name, mantissa in (("fp16", 11), ("bf16", 8)):
        err = (round_trip(name, x) - x).abs()
        assert bool((err <= x.abs() * 2.0**-mantissa + 1e-7).all()), name


@settings(max_examples=60, deadline=None)
@given(n=sizes, seed=seeds)
def test_int8_errs_at_most_half_a_step_of_its_chunk(n: int, seed: int) -> None:
    x = tensor(n, seed)
    err = (round_trip("int8", x) - x).abs()
    padded = torch.zeros(-(-n // CHUNK) * CHUNK)
    padded[:n] = x
    step = padded.view(-1, CHUNK).abs().amax(1, keepdim=True) / 127
    bound = (step / 2 * (1 + 1e-5)).expand(-1, CHUNK).reshape(-1)[:n]
    assert bool((err <= bound + 1e-30).all())


@settings(max_examples=60, deadline=None)
@given(n=sizes, seed=seeds, ranks=st.integers(1, 127))
def test_int8_sums_of_w_ranks_never_overflow(n: int, seed: int, ranks: int) -> None:
    """Each rank's levels are bounded by 127 // W on a grid shared by all ranks (the max of
    their scales), so the int8 sum of W messages is the exact integer sum."""
    xs = [tensor(n, seed + r) for r in range(min(ranks, 8))]  # the extremes matter, not W copies
    xs += [xs[0]] * (ranks - len(xs))
    padded = torch.zeros(len(xs), -(-n // CHUNK) * CHUNK)
    padded[:, :n] = torch.stack(xs)
    scale = padded.view(len(xs), -1, CHUNK).abs().amax(2).amax(0)
    levels = 127 // ranks
    qs = [Int8()._quantize(x, scale, levels)[0] for x in xs]
    wide = torch.stack([q.to(torch.int32) for q in qs]).sum(0)
    narrow = torch.zeros_like(qs[0])
    for q in qs:
        narrow += q
    assert int(wide.abs().max()) <= 127 and torch.equal(narrow.to(torch.int32), wide)


@settings(max_examples=60, deadline=None)
@given(n=sizes, seed=seeds, ratio=st.floats(0.001, 1.0))
def test_topk_keeps_exactly_the_largest(n: int, seed: int, ratio: float) -> None:
    x = tensor(n, seed)
    out = round_trip("topk", x, ratio=ratio)
    kept = out != 0
    k = max(1, min(n, round(ratio * n)))
    assert int(kept.sum()) == k
    assert torch.equal(out[kept], x[kept])
    if k < n:
        assert float(x[kept].abs().min()) >= float(x[~kept].abs().max())


@settings(max_examples=60, deadline=None)
@given(n=sizes, seed=seeds)
def test_sign_keeps_signs_and_each_chunks_l1_norm(n: int, seed: int) -> None:
    x = tensor(n, seed, spread=1.0)
    out = round_trip("sign", x)
    assert torch.equal(out >= 0, x >= 0)
    for a in range(0, n, SIGN_CHUNK):
        chunk_in, chunk_out = x[a : a + SIGN_CHUNK], out[a : a + SIGN_CHUNK]
        assert float(chunk_out.abs().sum()) == pytest.approx(float(chunk_in.abs().sum()), 1e-4)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(2, 60), cols=st.integers(2, 60), seed=seeds, rank=st.integers(1, 3))
def test_powersgd_projects_never_grows_and_finds_a_low_rank_matrix(
    rows: int, cols: int, seed: int, rank: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(rows, rank, generator=g) @ torch.randn(rank, cols, generator=g)
    compressor = make("powersgd", rank=rank, error_feedback="off")
    state = compressor.new_state(m.numel(), [(rows, cols)])
    for _ in range(3):  # warm start: each call is one more power-iteration step
        out = m.clone()
        compressor.reduce(out.view(-1), state, Link())
        assert float(out.norm()) <= float(m.norm()) * (1 + 1e-4)  # P P^T M is a projection
    if (rows + cols) * rank < rows * cols:  # compressed, not sent exactly
        assert float((out - m).norm()) <= 1e-3 * float(m.norm())


@pytest.mark.parametrize("name", NAMES)
def test_error_feedback_keeps_exactly_what_was_not_sent(name: str) -> None:
    """At every step, sent + new residual == given + old residual: over any number of steps,
    everything given is either sent or still held. Exact for top-k (it only moves elements),
    to one float rounding for the quantizers."""
    compressor = make(name, ratio=0.05, error_feedback="on")
    n = 700
    state = compressor.new_state(n, [(35, 20)])
    given_total, sent_total = (
        torch.zeros(n, dtype=torch.float64),
        torch.zeros(n, dtype=torch.float64),
    )
    for step in range(6):
        g = tensor(n, step, spread=1.0)
        old = state.buffer("residual", g).clone()
        out = g.clone()
        reduce(out, compressor, state, Link())  # a group of one: the sum is what this rank sent
        new = state.buffer("residual", g)
        if name in ("topk", "none"):
            assert torch.equal(out + new, g + old)
        else:
            torch.testing.assert_close(out + new, g + old, rtol=1e-6, atol=1e-6)
        given_total += g.double()
        sent_total += out.double()
    total = sent_total + state.buffer("residual", g).double()
    torch.testing.assert_close(total, given_total, rtol=1e-5, atol=1e-5)  # float32 roundings


@pytest.mark.parametrize("name", [n for n in NAMES if n != "none"])
def test_state_round_trips_through_state_dict(name: str) -> None:
    compressor = make(name, error_feedback="on")
    first = compressor.new_state(600, [(30, 20)])
    reduce(tensor(600, 1), compressor, first, Link())
    second = compressor.new_state(600, [(30, 20)])
    second.load_state_dict(first.state_dict())
    a, b = tensor(600, 2), tensor(600, 2)
    reduce(a, compressor, first, Link())
    reduce(b, compressor, second, Link())
    assert torch.equal(a, b)
    with pytest.raises(GradmeshError, match="600 elements"):
        compressor.new_state(5).load_state_dict(first.state_dict())


@pytest.mark.parametrize("name", [n for n in NAMES if n != "none"])
def test_decode_refuses_a_message_that_does_not_match_its_context(name: str) -> None:
    compressor = make(name, error_feedback="off", rank=2)
    x = tensor(1000, 3)
    payload, ctx = compressor.encode(x, compressor.new_state(1000))
    out = torch.zeros(1000)
    bad = [
        (payload[:-1], ctx),  # truncated
        (torch.cat([payload, payload[:4]]), ctx),  # too long
        (payload, (ctx[0] + 1, ctx[1], ctx[2])),
        (payload, (ctx[0], ctx[1] + 7, ctx[2])),
        (payload, (ctx[0], ctx[1], ctx[2] + 1)),
    ]
    for p, c in bad:
        with pytest.raises(ValueError):
            compressor.decode(p, c, out)
    if name == "topk":  # an index outside the tensor
        k = ctx[1]
        forged = payload.clone()
        forged[4 * k : 4 * k + 4] = torch.tensor([5000], dtype=torch.int32).view(torch.uint8)
        with pytest.raises(ValueError, match="index"):
            compressor.decode(forged, ctx, out)


def test_bad_settings_are_one_line_errors() -> None:
    with pytest.raises(GradmeshError, match=r"unknown compressor 'zip' \(valid: bf16, fp16, int8"):
        make("zip")
    for ratio in (0.0, -0.1, 1.5):
        with pytest.raises(GradmeshError, match=r"--compression-ratio must be in \(0, 1\]"):
            make("topk", ratio=ratio)
    with pytest.raises(GradmeshError, match="--error-feedback"):
        make("topk", error_feedback="sometimes")
    with pytest.raises(GradmeshError, match="--compression-rank"):
        make("powersgd", rank=0)
    assert make("topk").error_feedback and make("sign").error_feedback
    assert not make("fp16").error_feedback and not make("topk", error_feedback="off").error_feedback
